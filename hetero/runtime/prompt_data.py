"""Prompt/completion training data: ``--data FILE.jsonl``, one JSON object a line.

- ``{"prompt": str, "completion": str}``: the loss is on the completion's tokens only;
- ``{"text": str}``: the loss is on every token (but the first, which no position predicts).

Other keys of a line are ignored; blank lines are skipped. A line is one sample:
``tokenizer(prompt) + tokenizer(completion)`` (+ the tokenizer's end token where it has one),
right-padded to ``seq_length + 1`` tokens. The tokenizer is :mod:`hetero.tokenizer`'s: ``bytes``
(UTF-8 bytes as ids, the default) or a Hugging Face tokenizer (``--tokenizer``); as generation does,
a prompt (and a text) is encoded with the tokenizer's special tokens (a begin-of-text token where its
post-processor adds one), a completion without.

Targets (``seq_length`` per sample, position ``k`` predicting token ``k + 1``) are the next tokens
where they carry loss and :data:`~hetero.runtime.batch.IGNORE_INDEX` where they do not (prompt and
padding tokens). The step's loss is the mean over the global batch's loss tokens: every micro-batch
loss is a sum over its tokens divided by :meth:`PromptSource.loss_tokens` of the whole step, so the
loss does not depend on how a plan splits the batch.

Sample ``i`` is line ``perm_e[i mod n]`` of the ``n`` lines, ``perm_e`` the permutation of epoch
``e = i // n`` drawn from ``(seed, e)``: a function of (seed, i), the same for every plan; every line
is seen once per epoch.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from hetero.errors import HeteroError
from hetero.runtime.batch import IGNORE_INDEX, Batch

PAD_ID = 0
"""The id padding takes (it carries no loss, and a causal model's earlier positions never see it)."""


@dataclass(frozen=True)
class PromptSample:
    """One line's tokens: ``ids`` (at most ``seq_length + 1``), the targets from ``loss_from`` on carry
    loss (target ``k`` predicts ``ids[k + 1]``: loss where ``k + 1 >= loss_from``)."""

    ids: np.ndarray
    loss_from: int
    line: int
    """The line number in the file (1-based)."""

    @property
    def loss_tokens(self) -> int:
        return len(self.ids) - self.loss_from


def is_prompt_file(path: str | None) -> bool:
    """Whether ``--data path`` is prompt/completion data (a ``.jsonl`` file)."""
    return bool(path) and path.lower().endswith(".jsonl")


def read_prompt_file(path: str, seq_length: int, vocab_size: int, tokenizer: str | None = None) -> list[PromptSample]:
    """Every line of the JSONL ``path`` tokenized and checked: the launcher calls it before any process
    starts; a line that is not JSON, has neither form, carries no loss token, or does not fit
    ``seq_length + 1`` tokens raises :class:`~hetero.errors.HeteroError` naming the file and the line."""
    from hetero.tokenizer import load_text_tokenizer

    def bad(where: str, what: str, fix: str) -> HeteroError:
        return HeteroError(f"--data {path}{where}: {what} (fix: {fix})")

    if not os.path.isfile(path):
        raise bad("", "not found" if not os.path.exists(path) else "not a file",
                  'give a JSON-lines file of {"prompt": ..., "completion": ...} or {"text": ...} objects')
    tok = load_text_tokenizer(tokenizer, vocab_size)
    end = [] if tok.eos_id is None else [tok.eos_id]
    samples = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f": line {number}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise bad(where, f"not UTF-8 text (byte {e.start})", "save the file as UTF-8") from None
            if not text.strip():
                continue
            try:
                item = json.loads(text)
            except json.JSONDecodeError as e:
                raise bad(where, f"not JSON ({e.msg}, column {e.colno})", "write one JSON object per line") from None
            form = _form(item)
            if form is None:
                keys = sorted(item) if isinstance(item, dict) else type(item).__name__
                raise bad(where, f"neither {{\"prompt\", \"completion\"}} nor {{\"text\"}} with string values "
                                 f"(got {keys})",
                          'write {"prompt": "...", "completion": "..."} (loss on the completion) or '
                          '{"text": "..."} (loss on every token)')
            if form == "text":
                prompt, ids = [], tok.encode(item["text"], special=True) + end
            else:
                prompt = tok.encode(item["prompt"], special=True)
                ids = prompt + tok.encode(item["completion"], special=False) + end
            if len(ids) > seq_length + 1:
                raise bad(where, f"{len(ids)} tokens, more than one sample holds (seq_length + 1 = {seq_length + 1})",
                          "shorten the line, or train a model with a longer seq_length")
            sample = PromptSample(np.asarray(ids, dtype=np.int64), max(1, len(prompt)), number)
            if sample.loss_tokens < 1:
                raise bad(where, "no token carries loss (an empty completion, or a text of one token)",
                          "give a non-empty completion or a longer text")
            if int(sample.ids.max(initial=0)) >= vocab_size:
                raise bad(where, f"token id {int(sample.ids.max())} is not below the model's vocab_size {vocab_size}",
                          "use the model's own tokenizer")
            samples.append(sample)
    if not samples:
        raise bad("", "no lines", 'write one {"prompt": ..., "completion": ...} or {"text": ...} object per line')
    return samples


def _form(item) -> str | None:
    """"prompt" or "text": which form a parsed line has; None: neither (or both)."""
    if not isinstance(item, dict):
        return None
    pair = isinstance(item.get("prompt"), str) and isinstance(item.get("completion"), str)
    text = isinstance(item.get("text"), str)
    if pair == text or (text and ("prompt" in item or "completion" in item)):
        return None
    return "prompt" if pair else "text"


class PromptSource:
    """Sample ``i`` -> a line of a JSONL file (see the module docstring): the same ``batch`` /
    ``loss_tokens`` interface as :class:`~hetero.runtime.data.TokenSource`."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, path: str, tokenizer: str | None = None):
        self.seq, self.seed = seq_length, seed
        self.samples = read_prompt_file(path, seq_length, vocab_size, tokenizer)
        self._orders: dict[int, np.ndarray] = {}
        """Line order of the epochs in use (a step's batch spans at most two)."""
        self._counts: dict[tuple[int, int], int] = {}

    def line_of(self, i: int) -> PromptSample:
        """The line sample ``i`` takes."""
        n = len(self.samples)
        epoch = i // n
        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.clear()
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(n)
        return self.samples[int(self._orders[epoch][i % n])]

    def batch(self, first: int, count: int):
        """Samples ``[first, first + count)`` as a :class:`~hetero.runtime.batch.Batch`."""
        import torch

        tokens = np.full((count, self.seq + 1), PAD_ID, dtype=np.int64)
        targets = np.full((count, self.seq), IGNORE_INDEX, dtype=np.int64)
        for row in range(count):
            s = self.line_of(first + row)
            tokens[row, :len(s.ids)] = s.ids
            targets[row, s.loss_from - 1:len(s.ids) - 1] = s.ids[s.loss_from:]
        return Batch(torch.from_numpy(tokens[:, :-1].copy()), torch.from_numpy(targets))

    def loss_tokens(self, first: int, count: int) -> int:
        """Targets that carry loss in samples ``[first, first + count)`` (the step's loss normaliser)."""
        key = (first, count)
        if key not in self._counts:
            if len(self._counts) > 64:
                self._counts.clear()
            self._counts[key] = sum(self.line_of(first + k).loss_tokens for k in range(count))
        return self._counts[key]
