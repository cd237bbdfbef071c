"""The planned layout: every block of a trace placed at a fixed offset of one arena, ahead of time.

A training step allocates the same sizes in the same order every iteration, so the sizes and
lifetimes of a recorded step are known before it runs again. Placing them is offline dynamic
storage allocation (NP-hard in general); the heuristic here is greedy-by-size (Pisarchyk and Lee,
"Efficient memory management for deep neural net inference", 2020): blocks in decreasing size, each
at the lowest-waste gap among the blocks already placed that are live at the same time (best fit),
or on top of them. Large blocks first leaves the small ones to fill the gaps between them.

Offsets are multiples of 512 bytes, as the caching allocator's blocks are, so the two compare on
the same alignment.
"""
from __future__ import annotations

from dataclasses import dataclass

from hetero.memplan.trace import AllocationTrace

ALIGN = 512


@dataclass
class ArenaPlan:
    """``offsets[i]`` of block ``i`` of ``trace.blocks()`` (aligned sizes ``sizes[i]``, live over
    ``[starts[i], ends[i])``); ``arena_bytes``: the arena's size; ``dynamic_fallback_bytes``: bytes of
    blocks the plan cannot place ahead of time (their allocation is not in the trace), left to the
    caching allocator at run time."""
    offsets: list[int]
    sizes: list[int]
    starts: list[int]
    ends: list[int]
    arena_bytes: int
    dynamic_fallback_bytes: int

    def overlaps(self) -> list[tuple[int, int]]:
        """Pairs of blocks live at the same time whose byte ranges intersect (none in a valid plan)."""
        import numpy as np

        off, size = np.asarray(self.offsets), np.asarray(self.sizes)
        s, e = np.asarray(self.starts), np.asarray(self.ends)
        bad = []
        for i in range(len(off)):
            live = (s < e[i]) & (e > s[i]) & (off < off[i] + size[i]) & (off + size > off[i])
            live[i] = False
            bad += [(i, int(j)) for j in np.flatnonzero(live) if j > i]
        return bad


def plan_arena(trace: AllocationTrace, progress=None) -> ArenaPlan:
    """Greedy-by-size placement of every block of ``trace`` that it shows allocated. ``progress``:
    an optional callable ``progress(done, total)``."""
    import numpy as np

    blocks = trace.blocks()
    known = [b for b in blocks if b.start >= 0]
    fallback = sum(b.size for b in blocks if b.start < 0)
    n = len(known)
    sizes = np.array([-(-max(b.size, 1) // ALIGN) * ALIGN for b in known], dtype=np.int64)
    starts = np.array([b.start for b in known], dtype=np.int64)
    ends = np.array([b.end for b in known], dtype=np.int64)
    offsets = np.full(n, -1, dtype=np.int64)
    index = LifetimeIndex(starts, ends)
    # largest first; among equal sizes the longer-lived first (it constrains more blocks)
    order = np.lexsort((starts, -(ends - starts), -sizes))
    for done, i in enumerate(order):
        live = index.placed_overlapping(starts[i], ends[i])
        offsets[i] = best_gap(offsets[live], sizes[live], sizes[i])
        index.place(i)
        if progress is not None and (done % 4096 == 0 or done == n - 1):
            progress(done + 1, n)
    arena = int((offsets + sizes).max()) if n else 0
    return ArenaPlan(offsets.tolist(), sizes.tolist(), starts.tolist(), ends.tolist(), arena, fallback)


class LifetimeIndex:
    """Which placed blocks are live during ``[s, e)``, without looking at every block: blocks are
    binned by lifetime (tier ``j``: at most ``2**j`` events), each tier sorted by start, so only the
    blocks of a tier that start in ``(s - 2**j, e)`` can overlap. A training step's trace has
    hundreds of thousands of short blocks and few long ones: each query looks at about the blocks
    live around it, not at all of them (a whole-array scan per block took 120 s for 311k blocks).
    The tiers sit end to end in one array keyed ``tier x span + start``, so one ``searchsorted``
    finds every tier's window."""

    def __init__(self, starts, ends):
        import numpy as np

        self.placed = np.zeros(len(starts), dtype=bool)
        tier = np.ceil(np.log2(np.maximum(ends - starts, 1))).astype(np.int64)
        self.stride = int(ends.max(initial=0)) + 2 ** int(tier.max(initial=0)) + 1   # > any start - span
        key = tier * self.stride + starts
        self.order = np.argsort(key, kind="stable")       # block ids, by tier then start
        self.keys = key[self.order]
        self.ends = ends[self.order]
        self.tiers = np.unique(tier)
        self.spans = 2 ** self.tiers

    def place(self, i: int) -> None:
        self.placed[i] = True

    def placed_overlapping(self, s: int, e: int):
        import numpy as np

        base = self.tiers * self.stride
        lo = np.searchsorted(self.keys, base + np.maximum(s - self.spans, -1), "right")
        hi = np.searchsorted(self.keys, base + e, "left")
        counts = np.maximum(hi - lo, 0)
        total = int(counts.sum())
        if total == 0:
            return np.empty(0, dtype=np.int64)
        # the positions lo[t] .. hi[t] - 1 of every tier, in one array
        pos = np.arange(total) + np.repeat(lo - (np.cumsum(counts) - counts), counts)
        ids = self.order[pos]
        return ids[self.placed[ids] & (self.ends[pos] > s)]


def best_gap(offsets, sizes, size: int) -> int:
    """The offset of the smallest gap of at least ``size`` between the busy ranges
    ``[offsets, offsets + sizes)``, or the top of them."""
    import numpy as np

    if len(offsets) == 0:
        return 0
    idx = np.argsort(offsets, kind="stable")
    lo, hi = offsets[idx], offsets[idx] + sizes[idx]
    reach = np.maximum.accumulate(hi)        # the highest byte in use below each range's start
    gap_starts = np.concatenate(([0], reach[:-1]))
    gaps = lo - gap_starts
    fits = np.flatnonzero(gaps >= size)
    if len(fits) == 0:
        return int(reach[-1])
    best = fits[np.argmin(gaps[fits])]
    return int(gap_starts[best])
