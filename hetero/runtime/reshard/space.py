"""The virtual parameter space: training state addressed independently of any layout.

Every parameter of the model is one tensor of the space, named by its global name
(``layers.3.attn.wq.weight``, ``wte.weight``, ...) and its full shape. A *region* is a tensor name
plus a box: one ``[start, stop)`` range per dimension. A rank of any plan holds a set of regions:
a pipeline stage holds its layers' tensors whole, a tp rank holds one slice of each split tensor
along its split dimension (the ranges torch's ``Shard(d)`` gives it, uneven ones included), a
data-parallel replica holds the same regions as its twin. A ZeRO slice, a flat element range of a
tensor, is at most three boxes (:func:`flat_range_boxes`).

The optimizer state lives in the same space: a region of a parameter stands for the fp32 master
values, both AdamW moments (``exp_avg``, ``exp_avg_sq``) and the step counter of those elements,
so moving a region moves all of them together (:data:`STATE_KINDS`). The run-wide scalars (the
step, the fp16 loss scale) are agreed on by the ranks and move with the control message, not here.

Nothing here depends on torch.distributed or builds a module: shapes come from the meta device.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

Box = tuple[tuple[int, int], ...]
"""One ``(start, stop)`` per dimension of a tensor."""

STATE_KINDS = ("param", "exp_avg", "exp_avg_sq")
"""The per-element state a region carries (fp32 each); the AdamW step rides along as one value."""

BYTES_PER_ELEMENT = 4 * len(STATE_KINDS)
"""fp32 master value plus two fp32 moments per element."""

STEP_BYTES = 4
"""The AdamW step counter (float32) that travels with every piece of a tensor."""


@dataclass(frozen=True)
class Region:
    """``name``'s elements inside ``box``."""

    name: str
    box: Box

    @property
    def numel(self) -> int:
        return box_numel(self.box)


def box_numel(box: Box) -> int:
    return math.prod(max(0, b - a) for a, b in box)


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, int(n)) for n in shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None when they share no element."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def relative(box: Box, within: Box) -> tuple[slice, ...]:
    """Index of ``box`` inside a tensor that holds exactly ``within`` (``box`` lies inside it)."""
    return tuple(slice(a - w, b - w) for (a, b), (w, _) in zip(box, within))


def contiguous_within(box: Box, within: Box) -> bool:
    """Whether ``box`` (inside ``within``) is one contiguous run of a row-major tensor that holds
    exactly ``within``: single indices first, then one partial range, then whole dimensions (a tp
    slice along dim 0 is; one along dim 1 of a matrix is not)."""
    k = 0
    while k < len(box) and box[k][1] - box[k][0] == 1:
        k += 1
    return all(box[d] == within[d] for d in range(k + 1, len(box)))


def shard_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """The ``[start, stop)`` that part ``index`` of ``parts`` holds of a dimension of size ``n``, as
    torch's ``Shard`` placement splits it (``torch.chunk``: ceil-sized parts, the last ones shorter
    or empty)."""
    size = -(-n // parts)
    start = min(index * size, n)
    return start, min(start + size, n)


def tp_box(shape: tuple[int, ...], dim: int | None, tp_size: int, tp_rank: int) -> Box:
    """The box a tp rank holds of a tensor split along ``dim`` (None or tp 1: the whole tensor)."""
    box = list(full_box(shape))
    if dim is not None and tp_size > 1:
        box[dim] = shard_range(shape[dim], tp_size, tp_rank)
    return tuple(box)


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The elements ``[start, stop)`` of a tensor in row-major order (a ZeRO slice) as boxes: a
    partial first row, whole rows, a partial last row (three boxes at most for a matrix; the partial
    rows split the same way for more dimensions)."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start, stop),)]
    inner = math.prod(shape[1:])
    r0, r1 = start // inner, (stop - 1) // inner
    if r0 == r1:
        return [((r0, r0 + 1),) + b for b in flat_range_boxes(shape[1:], start - r0 * inner, stop - r0 * inner)]
    out = []
    first_whole = r0 if start == r0 * inner else r0 + 1
    if first_whole > r0:
        out += [((r0, r0 + 1),) + b for b in flat_range_boxes(shape[1:], start - r0 * inner, inner)]
    last_whole = r1 + 1 if stop == (r1 + 1) * inner else r1   # exclusive
    if last_whole > first_whole:
        out.append(((first_whole, last_whole),) + full_box(shape[1:]))
    if last_whole == r1:
        out += [((r1, r1 + 1),) + b for b in flat_range_boxes(shape[1:], 0, stop - r1 * inner)]
    return out


class ParameterSpace:
    """The tensors of one model: name -> full shape and the dimension tp splits (None: whole)."""

    def __init__(self, model):
        from hetero.runtime.model import stage_param_shapes, tp_shard_dim

        self.model = model
        # every tensor of the model: one stage holding every layer and both ends
        self.shapes = stage_param_shapes(model, (0, model.num_layers), True, True)
        self.split_dim = {n: tp_shard_dim(n) for n in self.shapes}
        self._stage = functools.lru_cache(maxsize=None)(
            lambda chunks, first, last: tuple(stage_param_shapes(model, chunks[0], first, last, chunks)))

    def rank_regions(self, plan, info) -> dict[str, Box]:
        """What rank ``info`` (a :class:`hetero.layout.RankInfo` of ``plan``) holds: name -> box."""
        from hetero.runtime.expert_parallel import holds_tensor, rank_experts

        names = self._stage(info.chunk_layers(plan), *info.holds_ends(plan))
        experts = rank_experts(self.model, plan, info)   # expert parallelism: its own routed experts only
        return {n: tp_box(self.shapes[n], self.split_dim[n], info.tp_size, info.tp_rank) for n in names
                if holds_tensor(n, experts)}

    def layout_regions(self, plan, layout) -> dict[int, dict[str, Box]]:
        """Every rank of ``layout`` (``plan``'s) -> its regions."""
        return {info.rank: self.rank_regions(plan, info) for info in layout.ranks}

    def total_bytes(self) -> int:
        """Bytes of one whole copy of the state (parameters and both moments, fp32)."""
        return sum(math.prod(s) for s in self.shapes.values()) * BYTES_PER_ELEMENT
