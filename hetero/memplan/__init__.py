"""Memory planning: how much a stage's allocations fragment under PyTorch's caching allocator, and
how little a layout planned ahead of time needs (``hetero memplan``).

- :mod:`~hetero.memplan.trace`: an allocation trace (allocs and frees in order), its lower bound,
  and reading a CUDA memory snapshot safely;
- :mod:`~hetero.memplan.record`: recording one stage's training steps as a trace, on fake tensors;
- :mod:`~hetero.memplan.caching`: what the caching allocator reserves for a trace;
- :mod:`~hetero.memplan.arena`: a static layout of every block in one arena (greedy by size);
- :mod:`~hetero.memplan.serve`: the planned allocator at run time (``hetero launch --allocator
  planned``): two steps recorded, the second planned, the plan served from one arena.

:func:`memory_plan` puts them together into the ``hetero memplan --json`` report (docs/formats.md).
"""
from __future__ import annotations

from hetero.memplan.arena import ArenaPlan, plan_arena
from hetero.memplan.caching import CachingResult, simulate_caching_allocator
from hetero.memplan.trace import AllocationTrace, load_snapshot

__all__ = ["AllocationTrace", "ArenaPlan", "CachingResult", "fragmentation", "load_snapshot", "memory_plan", "memory_plan_and_layout",
           "plan_arena", "simulate_caching_allocator"]


def fragmentation(lower_bound: int, held: int) -> float:
    """``1 - lower_bound / held`` (0 when nothing is held): the share of held bytes never live at once."""
    return 1.0 - lower_bound / held if held else 0.0


def memory_plan(trace: AllocationTrace, progress=None) -> dict:
    """The memory-plan report of ``trace``: its event count and lower bound, what the caching
    allocator reserves for it, and the planned arena; each with its fragmentation
    ``1 - lower_bound / bytes held``, and the planned layout's reduction of it."""
    return memory_plan_and_layout(trace, progress)[0]


def memory_plan_and_layout(trace: AllocationTrace, progress=None) -> tuple[dict, CachingResult, ArenaPlan]:
    """:func:`memory_plan`'s report, with the caching allocator's replay and the planned layout it
    was made from (``hetero memplan --plot`` draws them)."""
    lower = trace.lower_bound_bytes()
    cached = simulate_caching_allocator(trace)
    arena = plan_arena(trace, progress)
    frag_c = fragmentation(lower, cached.reserved_bytes)
    frag_p = fragmentation(lower, arena.arena_bytes + arena.dynamic_fallback_bytes)
    report = {"events": len(trace.events), "lower_bound_bytes": lower,
              "caching_allocator": {"reserved_bytes": cached.reserved_bytes, "fragmentation": frag_c},
              "planned": {"arena_bytes": arena.arena_bytes, "fragmentation": frag_p,
                          "dynamic_fallback_bytes": arena.dynamic_fallback_bytes},
              "fragmentation_reduction": 1.0 - frag_p / frag_c if frag_c > 0 else 0.0}
    return report, cached, arena
