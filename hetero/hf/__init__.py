"""Hugging Face models in and out.

- :mod:`~hetero.hf.config`: a model folder's ``config.json`` <-> a :class:`~hetero.specs.model.ModelSpec`
  (Llama, Mistral and Qwen2 onto ``llama``; Mixtral and Qwen2-MoE onto ``llama`` with a ``moe`` block;
  GPT-2 onto ``gpt``);
- :mod:`~hetero.hf.weights`: where each runtime parameter lives in the safetensors files (names,
  Conv1D transposes, fused q/k/v, the rotary row order) and reading exactly a rank's slices;
- :mod:`~hetero.hf.convert`: ``hetero import-hf`` (folder -> model file + checkpoint) and
  ``hetero export-hf`` (checkpoint -> folder ``from_pretrained`` loads);
- :mod:`~hetero.hf.tokens`: a text ``--data`` tokenized with a ``tokenizers`` tokenizer into a
  memory-mapped token file cached beside it.

Needs the ``[hf]`` extra (``safetensors``, ``tokenizers``); ``transformers`` is never imported.
"""
from __future__ import annotations

HF_PREFIX = "hf:"
"""``--load hf:DIR``: start from a Hugging Face model folder instead of a hetero checkpoint."""


def hf_dir_of(load: str | None) -> str | None:
    """The folder of a ``--load hf:DIR`` argument, else None."""
    return load[len(HF_PREFIX):] if load and load.startswith(HF_PREFIX) else None


def require(module: str, flag: str):
    """Import ``module`` (safetensors, tokenizers) or fail with the install line for ``flag``."""
    import importlib

    from hetero.errors import HeteroError

    try:
        return importlib.import_module(module)
    except ImportError:
        raise HeteroError(f"{flag} needs the {module.split('.')[0]} package (fix: pip install 'hetero[hf]', "
                          f"or pip install safetensors tokenizers)") from None
