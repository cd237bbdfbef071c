"""A transition between two layouts of the virtual parameter space: who sends what to whom.

Given what every live rank holds (``sources``: rank -> name -> box, from the old plan) and what
every rank of the new plan must hold (``targets``), :func:`plan_transition` lists the pieces
``(source rank, destination rank, region)`` whose union is exactly every target region: the
intersections of old and new owners, nothing more. Ranks here are the ranks of the world the
exchange runs in (a survivor keeps its state under its new rank).

Where several ranks hold a region (data-parallel replicas, a tensor every tp rank holds whole),
the source is chosen by, in order: the destination itself (no transfer), a rank of the
destination's vendor (the exchange stays on the vendor's library instead of the host bridge), and
then the rank that has sent the fewest bytes so far, so the links share the work. A region several
equally good ranks hold is split among them (along its longest dimension), so one destination
pulls it over several links at once.

A target element no source holds is reported in :attr:`Transition.missing` (a stage without a
replica lost its only copy): the caller falls back to a checkpoint or ends the run.

Every rank computes the same transition from the same inputs (a pure function, iterated in sorted
order), so no plan of the exchange itself needs to be sent around.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hetero.runtime.reshard.space import BYTES_PER_ELEMENT, STEP_BYTES, Box, Region, box_numel, intersect


@dataclass(frozen=True)
class Piece:
    """``name``'s elements in ``box`` (with their AdamW state) go from ``src`` to ``dst``."""

    src: int
    dst: int
    name: str
    box: Box
    with_step: bool = True
    """Whether it carries the tensor's AdamW step counter (a piece cut into several messages: the
    first one only)."""

    @property
    def numel(self) -> int:
        return box_numel(self.box)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: master values, both moments, and the step counter."""
        return self.numel * BYTES_PER_ELEMENT + (STEP_BYTES if self.with_step else 0)


@dataclass
class Transition:
    """The pieces of a transition (local ones included: ``src == dst``) and what no source holds."""

    pieces: list[Piece]
    missing: list[tuple[int, Region]] = field(default_factory=list)
    """(destination rank, region) pairs no live rank holds."""

    @property
    def moved(self) -> list[Piece]:
        """The pieces that cross from one rank to another."""
        return [p for p in self.pieces if p.src != p.dst]

    @property
    def intersection_bytes(self) -> int:
        """Bytes the exchange must move between ranks (the intersection volume, local copies excluded)."""
        return sum(p.nbytes for p in self.moved)

    @property
    def local_bytes(self) -> int:
        """Bytes a rank keeps from its own old state (copied in memory, never sent)."""
        return sum(p.nbytes for p in self.pieces if p.src == p.dst)

    def link_bytes(self) -> dict[tuple[int, int], int]:
        """(source, destination) -> bytes that link carries."""
        out: dict[tuple[int, int], int] = {}
        for p in self.moved:
            out[(p.src, p.dst)] = out.get((p.src, p.dst), 0) + p.nbytes
        return out

    def for_rank(self, rank: int) -> tuple[list[Piece], list[Piece]]:
        """(pieces ``rank`` sends, pieces it receives, local ones included in both)."""
        return ([p for p in self.pieces if p.src == rank], [p for p in self.pieces if p.dst == rank])


def plan_transition(sources: dict[int, dict[str, Box]], targets: dict[int, dict[str, Box]],
                    vendors: dict[int, str] | None = None) -> Transition:
    """The pieces that build every ``targets`` region from the ``sources`` regions (see the module
    docstring for how a source is chosen); ``vendors``: rank -> vendor tag of both sides' ranks."""
    vendors = vendors or {}
    holders: dict[str, list[tuple[int, Box]]] = {}
    for rank in sorted(sources):
        for name, box in sorted(sources[rank].items()):
            holders.setdefault(name, []).append((rank, box))
    sent: dict[int, int] = {r: 0 for r in sources}
    pieces: list[Piece] = []
    missing: list[tuple[int, Region]] = []
    for dst in sorted(targets):
        for name, want in sorted(targets[dst].items()):
            cands = [(r, b) for r, b in holders.get(name, ()) if intersect(b, want) is not None]
            chosen: list[tuple[int, Box]] = []
            for cell in _cells(want, [intersect(b, want) for _, b in cands]):
                covering = [r for r, b in cands if intersect(b, cell) == cell]
                if not covering:
                    missing.append((dst, Region(name, cell)))
                    continue
                tier = lambda r: 0 if r == dst else (1 if vendors.get(r) == vendors.get(dst) else 2)  # noqa: E731
                best = min(tier(r) for r in covering)
                covering = [r for r in covering if tier(r) == best]
                parts = _split(cell, len(covering)) if best > 0 else [cell]
                for part in parts:
                    src = min(covering, key=lambda r: (sent[r], r))
                    if src != dst:
                        sent[src] += box_numel(part) * BYTES_PER_ELEMENT
                    chosen.append((src, part))
            pieces += [Piece(src, dst, name, box) for src, box in _merge(chosen)]
    return Transition(pieces, missing)


def _cells(want: Box, boxes: list[Box]) -> list[Box]:
    """``want`` cut at every edge of ``boxes`` (each inside ``want``): cells that every box either
    holds whole or not at all."""
    cuts = []
    for d, (lo, hi) in enumerate(want):
        points = {lo, hi} | {p for b in boxes for p in b[d]}
        cuts.append(sorted(p for p in points if lo <= p <= hi))
    return [tuple(c) for c in itertools.product(*[list(zip(c, c[1:])) for c in cuts])]


def _split(box: Box, k: int) -> list[Box]:
    """``box`` in up to ``k`` near-equal parts along its longest dimension."""
    if k <= 1 or not box:
        return [box]
    d = max(range(len(box)), key=lambda i: box[i][1] - box[i][0])
    lo, hi = box[d]
    k = min(k, hi - lo)
    edges = [lo + (hi - lo) * i // k for i in range(k + 1)]
    return [box[:d] + ((a, b),) + box[d + 1:] for a, b in zip(edges, edges[1:])]


def _merge(chosen: list[tuple[int, Box]]) -> list[tuple[int, Box]]:
    """Adjacent boxes from one source joined into one (fewer, larger messages)."""
    out = list(chosen)
    merged = True
    while merged:
        merged = False
        for i, j in itertools.combinations(range(len(out)), 2):
            joined = _join(out[i], out[j])
            if joined is not None:
                out[i] = joined
                del out[j]
                merged = True
                break
    return sorted(out, key=lambda x: (x[1], x[0]))


def _join(a: tuple[int, Box], b: tuple[int, Box]) -> tuple[int, Box] | None:
    (ra, ba), (rb, bb) = a, b
    if ra != rb:
        return None
    differ = [d for d in range(len(ba)) if ba[d] != bb[d]]
    if len(differ) != 1:
        return None
    d = differ[0]
    (a0, a1), (b0, b1) = ba[d], bb[d]
    if a1 == b0 or b1 == a0:
        return ra, ba[:d] + ((min(a0, b0), max(a1, b1)),) + ba[d + 1:]
    return None
