"""Hugging Face checks shared by the dense and mixture-of-experts conversion tests
(tests/test_hf.py, tests/test_hf_moe.py)."""
from __future__ import annotations

__all__ = ["assert_logits_equal_transformers", "word_tokenizer"]


def assert_logits_equal_transformers(path, vocab: int):
    """Build the whole model of the HF checkpoint at ``path`` as one runtime stage, load its weights,
    and assert its logits on a seeded batch of token ids below ``vocab`` equal those of
    ``transformers`` to 1e-5. Returns the model spec read from the checkpoint."""
    import torch
    import transformers

    from hetero.hf.config import read_hf_config
    from hetero.hf.weights import load_stage_weights
    from hetero.runtime.model import build_stage

    spec = read_hf_config(str(path)).spec
    ours = build_stage(spec, (0, spec.num_layers), True, True, seed=5)
    load_stage_weights(str(path), ours, spec)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    x = torch.randint(0, vocab, (2, spec.seq_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x).logits, rtol=1e-5, atol=1e-5)
    return spec


def word_tokenizer(folder, words: int):
    """Save a Hugging Face tokenizer folder at ``folder`` (made here): a word-level vocabulary of
    ``[UNK]`` 0, ``<s>`` 1, ``</s>`` 2 and the words ``w0`` .. ``w{words - 1}`` (ids 3 on), split on
    whitespace, ``<s>`` put before every text it encodes with special tokens, ``</s>`` its end token
    (tokenizer_config.json). Returns the folder."""
    import json

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.processors import TemplateProcessing

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(words)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder
