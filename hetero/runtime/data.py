"""Deterministic training data, addressed by global sample index.

Sample ``i`` (``seq_length + 1`` tokens: inputs and shifted targets) is a function of
``(seed, i)`` and the data file only. The batch of step ``t`` is samples
``[t * global_batch, (t + 1) * global_batch)``; pipelines, replicas and micro-batches take
consecutive slices of it in plan order. Two plans of the same model, seed and global batch
therefore see the same samples, and give the same losses up to reduction order.

Sources:
- ``--data FILE.npy``: a 1-D array of token ids (any integer dtype);
- ``--data FILE.bin``: raw ``uint16`` tokens (``FILE.int32.bin`` / ``FILE.i32``: ``int32``);
- ``--data FILE`` (anything else): text, byte-level tokens (needs ``vocab_size >= 256``);
- no file: a seeded synthetic stream of arithmetic sequences ``(a + b * k) mod vocab``, random
  per sample, learnable so the loss visibly falls.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hetero.errors import HeteroError
from hetero.specs.plan import Plan


class TokenSource:
    """Sample ``i`` -> ``seq_length + 1`` token ids (int64)."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, path: str | None = None):
        self.vocab, self.seq, self.seed = vocab_size, seq_length, seed
        self.tokens = _load_tokens(path, vocab_size) if path else None
        if self.tokens is not None and len(self.tokens) < seq_length + 2:
            raise HeteroError(f"--data {path}: {len(self.tokens)} tokens, fewer than seq_length + 2 = {seq_length + 2}")

    def sample(self, i: int) -> torch.Tensor:
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

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``[first, first + count)`` as (inputs, targets), each (count, seq_length)."""
        s = torch.stack([self.sample(first + k) for k in range(count)])
        return s[:, :-1].contiguous(), s[:, 1:].contiguous()


def _load_tokens(path: str, vocab: int) -> np.ndarray:
    import os

    if not os.path.exists(path):
        raise HeteroError(f"--data {path}: no such file")
    if path.endswith(".npy"):
        arr = np.load(path, mmap_mode="r")
    elif path.endswith((".int32.bin", ".i32")):
        arr = np.memmap(path, dtype=np.int32, mode="r")
    elif path.endswith(".bin"):
        arr = np.memmap(path, dtype=np.uint16, mode="r")
    else:
        if vocab < 256:
            raise HeteroError(f"--data {path}: byte-level text needs vocab_size >= 256, the model has {vocab}")
        with open(path, "rb") as f:
            arr = np.frombuffer(f.read(), dtype=np.uint8)
    arr = np.asarray(arr).reshape(-1)
    if arr.size and int(arr.max()) >= vocab:
        raise HeteroError(f"--data {path}: token id {int(arr.max())} >= vocab_size {vocab}")
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
