"""Text <-> token ids for prompts and completions: ``bytes`` or a Hugging Face tokenizer.

- ``bytes``: the UTF-8 bytes of the text are the ids (0..255; the model needs ``vocab_size >= 256``).
  It has no end token; ids of 256 and above, which a larger model may still generate, decode to no text.
- any other name: a Hugging Face ``tokenizer.json`` or the model folder holding it (see
  :func:`hetero.hf.tokens.tokenizer_file`). Its end token(s) come from the folder's
  ``generation_config.json`` or ``config.json`` (``eos_token_id``), else ``tokenizer_config.json``
  (``eos_token``).

Convention: a prompt is encoded with the tokenizer's special tokens (``encode(text, special=True)``:
the begin-of-text token its post-processor adds, as the model was trained), a completion without
(``special=False``), followed by the end token where there is one.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

from hetero.errors import HeteroError

BYTES = "bytes"


class TextTokenizer:
    """``encode(text, special) -> ids``, ``decode(ids) -> text`` and the end token ids."""

    name: str
    eos_ids: tuple[int, ...] = ()

    def encode(self, text: str, special: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    @property
    def eos_id(self) -> int | None:
        """The first end token, or None."""
        return self.eos_ids[0] if self.eos_ids else None


class BytesTokenizer(TextTokenizer):
    name = BYTES

    def encode(self, text: str, special: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # a sampled cut can end inside a multi-byte character: shown as U+FFFD, never an error
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer(TextTokenizer):
    def __init__(self, path: str, vocab_size: int):
        from hetero.hf.tokens import load_tokenizer

        self.tok, self.file = load_tokenizer(path, vocab_size)
        self.name = path
        self.eos_ids = _eos_ids(os.path.dirname(self.file), self.tok)

    def encode(self, text: str, special: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def load_text_tokenizer(name: str | None, vocab_size: int, flag: str = "--tokenizer") -> TextTokenizer:
    """The tokenizer ``name`` names (None or ``bytes``: UTF-8 bytes) for a model of ``vocab_size``."""
    if name in (None, BYTES):
        if vocab_size < 256:
            raise HeteroError(f"{flag} bytes: the model's vocab_size is {vocab_size}, but UTF-8 bytes need ids up to "
                              f"255 (fix: a model with vocab_size >= 256, or a Hugging Face tokenizer)")
        return BytesTokenizer()
    return HFTokenizer(name, vocab_size)


def _eos_ids(folder: str, tok) -> tuple[int, ...]:
    """End token ids named in the tokenizer's folder (none found: no end token)."""
    for file in ("generation_config.json", "config.json"):
        value = _read_json(os.path.join(folder, file)).get("eos_token_id")
        ids = value if isinstance(value, list) else [value]
        ids = tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool))
        if ids:
            return ids
    token = _read_json(os.path.join(folder, "tokenizer_config.json")).get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    i = tok.token_to_id(token) if isinstance(token, str) else None
    return (i,) if i is not None else ()


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}   # absent or unreadable: this source names no end token
    return data if isinstance(data, dict) else {}
