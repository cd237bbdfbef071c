"""Text ``--data`` tokenized with a Hugging Face tokenizer (``--tokenizer``), cached beside the text.

The cache is a raw token file the data loader memory-maps (``.bin``: uint16 ids when the vocabulary
fits, else ``.int32.bin``), named after a hash of the tokenizer and of the text's size and
modification time, so a changed text or another tokenizer makes a new one and a second run reads
the cached ids without tokenizing. The text is read in blocks ending at a line break (a multi-byte
character never straddles two blocks) and each block is encoded on its own, without special
tokens: only a token that would span a block boundary can differ from encoding the whole text at
once (about one per 4 MiB block). Large files show a progress bar.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np

from hetero.errors import HeteroError
from hetero.hf import require

BLOCK = 4 << 20
"""Bytes of text encoded at a time."""
PROGRESS_FROM = 32 << 20
"""Texts at least this large show a progress bar."""


def tokenizer_file(path: str) -> str:
    """The ``tokenizer.json`` that ``--tokenizer PATH`` names (the file, or a model folder holding it)."""
    if os.path.isdir(path):
        inner = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(inner):
            raise HeteroError(f"--tokenizer {path}: no tokenizer.json in the folder (fix: save the fast tokenizer "
                              f"there, e.g. AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR), or name a "
                              f"tokenizer.json)")
        return inner
    if not os.path.isfile(path):
        raise HeteroError(f"--tokenizer {path}: not found (fix: give a Hugging Face model folder or its "
                          f"tokenizer.json)")
    return path


def load_tokenizer(path: str, vocab_size: int):
    """The tokenizer of ``--tokenizer PATH``, checked against the model's ``vocab_size``."""
    Tokenizer = require("tokenizers", "--tokenizer").Tokenizer
    file = tokenizer_file(path)
    try:
        tok = Tokenizer.from_file(file)
    except Exception as e:   # tokenizers raises a plain Exception for a malformed file
        raise HeteroError(f"--tokenizer {file}: not a tokenizers file ({str(e).splitlines()[0][:160]}) (fix: give "
                          f"the tokenizer.json of a fast Hugging Face tokenizer)") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise HeteroError(f"--tokenizer {file}: its vocabulary has {size} tokens, more than the model's vocab_size "
                          f"{vocab_size}, so some ids would have no embedding (fix: use the model's own tokenizer, "
                          f"or a model file with vocab_size >= {size})")
    return tok, file


def cached_tokens(text_path: str, tokenizer_path: str, vocab_size: int, print_fn=None) -> str:
    """The token file of ``text_path`` under the tokenizer of ``tokenizer_path``, made on first use."""
    tok, file = load_tokenizer(tokenizer_path, vocab_size)
    with open(file, "rb") as f:
        digest = hashlib.sha256(f.read())
    st = os.stat(text_path)
    digest.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    wide = tok.get_vocab_size(with_added_tokens=True) > 65536
    out = f"{text_path}.tok-{digest.hexdigest()[:12]}{'.int32' if wide else ''}.bin"
    if os.path.isfile(out):
        return out
    dtype = np.int32 if wide else np.uint16
    tmp = f"{out}.{os.getpid()}.tmp"
    try:
        with open(text_path, "rb") as src, open(tmp, "wb") as dst, _progress(st.st_size, text_path) as advance:
            rest = b""
            while True:
                block = src.read(BLOCK)
                data = rest + block
                cut = data.rfind(b"\n") + 1 if block else len(data)
                if block and cut == 0:   # no line break yet: read on
                    rest = data
                    advance(len(block))
                    continue
                text, rest = data[:cut], data[cut:]
                if text:
                    ids = tok.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False).ids
                    dst.write(np.asarray(ids, dtype=dtype).tobytes())
                advance(len(block))
                if not block:
                    break
        os.replace(tmp, out)
    except OSError as e:
        raise HeteroError(f"--data {text_path}: cannot write the token cache {out}: {e.strerror or e} (fix: make "
                          f"the text's folder writable, or tokenize elsewhere and pass the token file)") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    if print_fn:
        print_fn(f"--data {text_path}: {os.path.getsize(out) // np.dtype(dtype).itemsize} tokens cached in {out}")
    return out


class _progress:
    """``with _progress(total, name) as advance``: a rich progress bar over the text's bytes when the
    file is large and the output a terminal-or-log console; else ``advance`` does nothing."""

    def __init__(self, total: int, name: str):
        self.total, self.name, self.bar = total, name, None

    def __enter__(self):
        if self.total < PROGRESS_FROM:
            return lambda n: None
        from rich.progress import Progress

        self.bar = Progress(transient=True)
        self.bar.start()
        task = self.bar.add_task(f"tokenizing {os.path.basename(self.name)}", total=self.total)
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False
