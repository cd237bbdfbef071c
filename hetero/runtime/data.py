"""Deterministic training data, addressed by global sample index.

Sample ``i`` (``seq_length + 1`` tokens: inputs and shifted targets) is a function of
``(seed, i)`` and the data file only. The batch of step ``t`` is samples
``[t * global_batch, (t + 1) * global_batch)``; pipelines, replicas and micro-batches take
consecutive slices of it in plan order. Two plans of the same model, seed and global batch
therefore see the same samples, and give the same losses up to reduction order.

Sources:
- ``--data FILE.npy``: a 1-D array of token ids (any integer dtype);
- ``--data FILE.bin``: raw ``uint16`` tokens (``FILE.int32.bin`` / ``FILE.i32``: ``int32``);
- ``--data FILE.jsonl``: prompt/completion lines, the loss on the completions' tokens only
  (:mod:`hetero.runtime.prompt_data`);
- ``--data FILE`` (anything else): text, byte-level tokens (needs ``vocab_size >= 256``);
- no file: a seeded synthetic stream of arithmetic sequences ``(a + b * k) mod vocab``, random
  per sample, learnable so the loss visibly falls.

Every source gives ``batch(first, count) -> Batch`` (inputs, and targets where
:data:`IGNORE_INDEX` marks a token that carries no loss) and ``loss_tokens(first, count)``, the
targets that carry loss in those samples: an engine divides the summed token losses of each
micro-batch by ``loss_tokens(step * global_batch, global_batch)``, so the step's loss is the mean
over the global batch's loss tokens whatever the plan.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hetero.errors import HeteroError
from hetero.runtime.batch import IGNORE_INDEX, Batch
from hetero.specs.plan import Plan

__all__ = ["IGNORE_INDEX", "Batch", "TokenSource", "data_source", "check_data", "check_token_file",
           "MicroBatchSlice", "replica_slice"]

if TYPE_CHECKING:
    import torch

SCAN_CHUNK = 1 << 24
"""Token ids checked per slice of a file (memory-mapped: a big file is read once, slice by slice)."""
def data_source(vocab_size: int, seq_length: int, seed: int, path: str | None = None,
                tokenizer: str | None = None):
    """The run's data source: :class:`~hetero.runtime.prompt_data.PromptSource` for a ``.jsonl``
    ``path`` (``tokenizer``: its Hugging Face tokenizer, None: UTF-8 bytes), else :class:`TokenSource`."""
    from hetero.runtime.prompt_data import PromptSource, is_prompt_file

    if is_prompt_file(path):
        return PromptSource(vocab_size, seq_length, seed, path, tokenizer)
    return TokenSource(vocab_size, seq_length, seed, path)


def check_data(path: str, vocab_size: int, seq_length: int, tokenizer: str | None = None) -> None:
    """Check a ``--data`` file before any process starts (:func:`check_token_file`, or every line of a
    prompt/completion file); raises :class:`~hetero.errors.HeteroError` naming the file (and line)."""
    from hetero.runtime.prompt_data import is_prompt_file, read_prompt_file

    if is_prompt_file(path):
        read_prompt_file(path, seq_length, vocab_size, tokenizer)
    else:
        check_token_file(path, vocab_size, seq_length)


class TokenSource:
    """Sample ``i`` -> ``seq_length + 1`` token ids (int64)."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, path: str | None = None):
        self.vocab, self.seq, self.seed = vocab_size, seq_length, seed
        self.tokens = check_token_file(path, vocab_size, seq_length) if path else None

    def sample(self, i: int) -> torch.Tensor:
        import torch

        n = self.seq + 1
        if self.tokens is not None:
            span = len(self.tokens) - n
            g = np.random.default_rng([self.seed, i])
            start = int(g.integers(0, span + 1))
            return torch.from_numpy(np.asarray(self.tokens[start:start + n], dtype=np.int64))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        a = int(torch.randint(0, self.vocab, (1,), generator=g))
        b = int(torch.randint(1, 8, (1,), generator=g))
        return (a + b * torch.arange(n, dtype=torch.int64)) % self.vocab

    def batch(self, first: int, count: int) -> Batch:
        """Samples ``[first, first + count)``: every target carries loss."""
        import torch

        s = torch.stack([self.sample(first + k) for k in range(count)])
        return Batch(s[:, :-1].contiguous(), s[:, 1:].contiguous())

    def loss_tokens(self, first: int, count: int) -> int:
        """Targets that carry loss in samples ``[first, first + count)``: all of them."""
        return count * self.seq


def check_token_file(path: str, vocab: int, seq_length: int) -> np.ndarray:
    """The token ids of a ``--data`` file (memory-mapped, 1-D), checked before any training: a file,
    of an integer dtype, every id in ``0 .. vocab - 1``, at least ``seq_length + 1`` ids (one
    sample: ``seq_length`` inputs and the next token of the last one). The launcher calls it before
    it starts a process; each error names the file and the fix."""
    def bad(what: str, fix: str) -> HeteroError:
        return HeteroError(f"--data {path}: {what} (fix: {fix})")

    if not os.path.exists(path):
        raise bad("not found", "give the path of a token file (.npy, .bin, .int32.bin) or a text file")
    if not os.path.isfile(path):
        raise bad("not a file", "give a token file (.npy, .bin, .int32.bin) or a text file, not a directory")
    try:
        if path.endswith(".npy"):
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            dtype = np.int32 if path.endswith((".int32.bin", ".i32")) else \
                np.uint16 if path.endswith(".bin") else np.uint8
            if dtype is np.uint8 and vocab < 256:
                raise bad(f"byte-level text needs vocab_size >= 256, the model has {vocab}",
                          "give a token file (.npy, .bin) of ids below vocab_size")
            size = os.path.getsize(path)
            if size % np.dtype(dtype).itemsize:
                raise bad(f"{size} bytes, not a whole number of {np.dtype(dtype).name} token ids",
                          "write raw uint16 ids as .bin, int32 as .int32.bin")
            arr = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    except (ValueError, OSError) as e:   # a damaged or pickled .npy, a file that cannot be mapped
        raise bad(f"not a readable token array ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
                  "save the ids with numpy.save as a 1-D integer array") from None
    if not (np.issubdtype(arr.dtype, np.integer) and arr.dtype != np.bool_):
        raise bad(f"token ids of dtype {arr.dtype}, not integers",
                  "save the ids as integers, e.g. numpy.save(path, ids.astype(numpy.int32))")
    arr = arr.reshape(-1)
    need = seq_length + 1
    if arr.size < need:
        raise bad(f"{arr.size} token ids, fewer than one sample needs (seq_length + 1 = {need})",
                  f"give a file of at least {need} ids, or a model with a shorter seq_length")
    signed = np.issubdtype(arr.dtype, np.signedinteger)
    for first in range(0, arr.size, SCAN_CHUNK):
        chunk = np.asarray(arr[first:first + SCAN_CHUNK])
        low, high = (int(chunk.min()) if signed else 0), int(chunk.max())
        if low < 0 or high >= vocab:
            at = first + int(np.argmax((chunk < 0) | (chunk >= vocab)))
            value = int(arr[at])
            if value < 0:
                raise bad(f"token id {value} at position {at} is negative; ids are 0 .. vocab_size - 1 = {vocab - 1}",
                          "re-tokenize, or save the ids in an unsigned or wider dtype if they were wrapped "
                          "(e.g. ids above 32767 saved as int16)")
            raise bad(f"token id {value} at position {at} is not below the model's vocab_size {vocab}",
                      "tokenize with the model's vocabulary, or raise vocab_size in the model file")
    return arr


@dataclass(frozen=True)
class MicroBatchSlice:
    """Where one replica's micro-batches start in the global batch."""

    offset: int
    micro_batch_size: int
    micro_batches: int

    def sample_range(self, step: int, global_batch: int, mb: int) -> tuple[int, int]:
        first = step * global_batch + self.offset + mb * self.micro_batch_size
        return first, self.micro_batch_size


def replica_slice(plan: Plan, pipeline: int, replica: int) -> MicroBatchSlice:
    """The slice of every global batch that (pipeline, replica) trains on."""
    offset = 0
    for pi, p in enumerate(plan.pipelines):
        per_replica = p.micro_batches * plan.mbs(p)
        if pi == pipeline:
            return MicroBatchSlice(offset + replica * per_replica, plan.mbs(p), p.micro_batches)
        offset += p.replicas * per_replica
    raise IndexError(pipeline)
