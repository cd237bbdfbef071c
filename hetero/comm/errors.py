"""Errors and reduction operators of the unified communicator."""
from __future__ import annotations

import enum
from typing import Sequence

from hetero.errors import HeteroError


class HeteroCommError(HeteroError, RuntimeError):
    """A collective or point-to-point operation failed.

    Attributes name what failed: ``op`` (e.g. ``"all_reduce"``), ``group`` (the group's name),
    ``ranks`` (its global ranks) and ``missing`` (global ranks that did not arrive, when known).
    """

    def __init__(self, message: str, op: str = "", group: str = "", ranks: Sequence[int] = (),
                 missing: Sequence[int] | None = None):
        super().__init__(message)
        self.op = op
        self.group = group
        self.ranks = list(ranks)
        self.missing = None if missing is None else list(missing)


class HeteroCommTimeout(HeteroCommError, TimeoutError):
    """An operation did not complete within its timeout; ``missing`` lists the ranks that never arrived."""


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    AVG = "avg"  # global sum / number of ranks in the group (floor division for integer tensors)

    @classmethod
    def parse(cls, op) -> "ReduceOp":
        hit = _PARSED.get(op) if isinstance(op, (str, ReduceOp)) else None
        if hit is not None:
            return hit
        if isinstance(op, str):
            try:
                return cls(op.lower())
            except ValueError:
                pass
        name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
        try:
            return cls(str(name).lower())
        except ValueError:
            raise ValueError(f"unsupported reduce op {op!r} (use one of: sum, max, min, avg)") from None

    def torch_op(self):
        """The ``torch.distributed.ReduceOp`` used for this op (AVG is reduced as SUM, then divided)."""
        if not _TORCH_OPS:
            import torch.distributed as dist

            _TORCH_OPS.update(sum=dist.ReduceOp.SUM, max=dist.ReduceOp.MAX, min=dist.ReduceOp.MIN,
                              avg=dist.ReduceOp.SUM)
        return _TORCH_OPS[self.value]


_TORCH_OPS: dict = {}
_PARSED = {**{m: m for m in ReduceOp}, **{m.value: m for m in ReduceOp}, **{m.value.upper(): m for m in ReduceOp}}


def divide_(tensor, count: int):
    """In-place ``tensor / count`` (floor division for integer tensors): the AVG epilogue."""
    if count == 1:
        return tensor
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.div_(count)
    return tensor.div_(count, rounding_mode="floor")
