"""Emulated slowdown of a compute span that meets other ranks partway through.

A device of the cluster file with ``slowdown: s`` computes for real, then waits ``(s - 1) x`` the
compute time (:func:`hetero.runtime.pipeline.timed`). Waiting once at the end of a forward or backward
is what a slower device does when nothing inside the span waits for another rank. An expert-parallel
MoE layer does: every rank of its group meets the others in the layer's all-to-alls, so a slower
device must arrive late at each of them, not only at the end. Otherwise the group runs each layer
at the faster device's pace, the slower rank catches up in one wait at the end, and a split of the
experts by device speed measures no better than an even one.

:func:`meeting` runs such a collective inside the current span: it first waits ``(s - 1) x`` the
span's compute since the last meeting (or its start), then runs the collective; the span's end
waits for the compute after the last meeting only. Time inside meetings (the waits and the
collective) is not compute and is never slowed.
"""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


class Span:
    """One timed compute span of a rank (a forward or a backward), ``slowdown`` times slower."""

    def __init__(self, slowdown: float, wait: Callable[[], None] | None = None):
        self.slowdown, self.wait = slowdown, wait
        self.mark = time.perf_counter()
        """Where the compute not yet slowed starts (the span's start, or the end of the last meeting)."""
        self.paced = 0.0
        """Compute seconds already slowed at meetings."""
        self.inside = 0.0
        """Seconds spent in meetings: the slowed waits and the collectives."""


_current: Span | None = None   # one rank per process, one span at a time (a forward or a backward)


def enter(span: Span) -> Span | None:
    """Make ``span`` the current one; returns the one it replaces (give it to :func:`leave`)."""
    global _current
    previous, _current = _current, span
    return previous


def leave(previous: Span | None) -> None:
    """End the current span, making ``previous`` current again."""
    global _current
    _current = previous


def meeting(collective: Callable[[], T]) -> T:
    """Run ``collective`` (one that other ranks meet in) as a slower device would reach it: after
    waiting ``(slowdown - 1) x`` the current span's compute since its last meeting. Outside a span,
    or at no slowdown, it just runs."""
    span = _current
    if span is None or span.slowdown <= 1.0:
        return collective()
    if span.wait:
        span.wait()
    start = time.perf_counter()
    compute = max(0.0, start - span.mark)
    time.sleep((span.slowdown - 1.0) * compute)
    out = collective()
    span.mark = time.perf_counter()
    span.paced += compute
    span.inside += span.mark - start
    return out
