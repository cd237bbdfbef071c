"""The key/value cache of generation: per layer, the keys and values of every position computed so
far, so a decode step runs the model on one new token per row instead of the whole sequence.

Each layer's buffers are allocated at their full size (rows x kv heads x ``capacity`` x head dim)
on the first append, in the dtype and on the device of the keys the layer computes (bf16 under
bf16 autocast), and filled in place: a decode step copies one position per row and attends over
a view of the filled prefix, with no reallocation or concatenation. The whole cache is freed by
dropping the :class:`KVCache` (collocated RL frees it between rollout and training).
"""
from __future__ import annotations

import torch


class LayerCache:
    """One layer's cached keys and values; what :meth:`hetero.runtime.model.Attention.forward` takes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.length = 0
        """Positions cached: the position of the next token appended (rotary and learned positions)."""
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` (rows, kv heads, new positions, head dim) after the cached positions;
        returns the keys and values of every position so far (views of the buffers)."""
        B, H, T, D = k.shape
        end = self.length + T
        if end > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions: cannot append {T} after {self.length}")
        if self.k is None:
            self.k = k.new_empty(B, H, self.capacity, D)
            self.v = v.new_empty(B, H, self.capacity, D)
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()


class KVCache:
    """The caches of a model's layers (keyed by global layer index) for ``capacity`` positions."""

    def __init__(self, layers, capacity: int):
        self.layers = {int(i): LayerCache(capacity) for i in layers}
        self.capacity = capacity

    def layer(self, index: int) -> LayerCache:
        return self.layers[int(index)]

    @property
    def length(self) -> int:
        """Positions cached (every layer holds the same number between forward passes)."""
        return next(iter(self.layers.values())).length if self.layers else 0

    def nbytes(self) -> int:
        """Bytes the allocated buffers hold."""
        return sum(c.nbytes() for c in self.layers.values())
