"""A whole model in one process, for generation: built from the model file and filled from a
checkpoint (``hetero launch --save``, ``hetero import-hf``), a Hugging Face folder (``hf:DIR``), or
its deterministic initial weights. Used where the plan puts the whole model in one process
(``hetero generate``, a rollout rank holding a full copy)."""
from __future__ import annotations

import os

import torch

from hetero.errors import HeteroError


def load_whole_model(spec, load: str | None, *, seed: int = 0, device: str | torch.device = "cpu",
                     flag: str = "--load"):
    """A :class:`~hetero.runtime.model.StageModel` of every layer of ``spec`` (first and last stage)
    on ``device``, in eval mode, with the weights of ``load``: a checkpoint directory, ``hf:DIR``, or
    None for the initial weights of ``seed`` (those ``hetero launch --seed`` starts from). The
    checkpoint's optimizer state is not read. Errors (missing files, another model) name ``flag``."""
    from hetero.hf import hf_dir_of
    from hetero.runtime.model import build_stage

    model = build_stage(spec, (0, spec.num_layers), True, True, seed)
    hf_dir = hf_dir_of(load)
    if hf_dir is not None:
        from hetero.hf.weights import load_stage_weights

        load_stage_weights(hf_dir, model, spec)
    elif load is not None:
        if not os.path.isdir(load):
            raise HeteroError(f"{flag} {load}: not a directory (fix: give a checkpoint hetero launch --save or "
                              f"hetero import-hf wrote, or hf:DIR for a Hugging Face model folder)")
        import warnings

        from hetero.runtime.checkpoint import load_checkpoint

        try:
            with warnings.catch_warnings():   # "no process group: loading as a single process" is the intent
                warnings.simplefilter("ignore")
                load_checkpoint(load, model, None, spec.num_layers)
        except HeteroError as e:   # the checkpoint module speaks of --load
            raise HeteroError(str(e).replace(f"--load {load}", f"{flag} {load}", 1)) from None
    return model.to(device).eval()
