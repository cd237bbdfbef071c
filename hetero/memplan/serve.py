"""The planned allocator at run time: record a step, plan its arena, serve the plan from the next step.

The allocator itself is a small C++ library (``csrc/planned_allocator.cpp``) built on first use with
``torch.utils.cpp_extension.load`` and cached in torch's extensions directory
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``). On the CPU it becomes c10's CPU
allocator (``c10::SetCPUAllocator``); on CUDA it is loaded by
``torch.cuda.memory.CUDAPluggableAllocator``, which must happen before the process's first CUDA
allocation.

A run goes through three modes (:class:`PlannedAllocator`):

1. pass: installed, every block straight from the backend (the model is built like this);
2. record, over two consecutive steps: every request and free of the training thread is logged;
3. serve, from the step after: :func:`plan_step` turns the second recorded step into a plan (the
   step's requests in order, each with an offset in one arena; blocks the step leaves live are
   freed by the next step at the point the first recorded step's were, so they are placed across
   the step boundary), and the allocator serves it. A request that matches no plan entry (size,
   phase, stream), or whose planned range is still held, is served by the fallback pool.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from hetero.memplan.arena import ALIGN, best_gap, LifetimeIndex
from hetero.memplan.trace import AllocationTrace

LOOK_AHEAD = 64
"""Entries of the first recorded step looked at to align it with the second (as the C++ matcher does)."""

KINDS = ("caching", "planned")
"""``--allocator`` values: PyTorch's default (caching) allocator, or the planned arena."""

_ACTIVE: "PlannedAllocator | None" = None


@functools.lru_cache(maxsize=2)
def load_extension(cuda: bool = False):
    """The compiled allocator module (built on the first call in this environment, then loaded from
    the cache). Raises RuntimeError with a one-line reason when it cannot be built."""
    from pathlib import Path

    source = Path(__file__).with_name("csrc") / "planned_allocator.cpp"
    try:
        from torch.utils import cpp_extension

        return cpp_extension.load(name="hetero_planned_alloc" + ("_cuda" if cuda else ""), sources=[str(source)],
                                  extra_cflags=["-O2"] + (["-DHETERO_WITH_CUDA"] if cuda else []),
                                  with_cuda=cuda, verbose=False)
    except Exception as e:  # noqa: BLE001 - compiler missing, headers missing, ninja missing: say which
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        raise RuntimeError(f"cannot build the planned allocator ({type(e).__name__}: "
                           f"{lines[-1] if lines else 'no message'})") from None


def mark_phase(phase: int) -> None:
    """Tell the installed planned allocator (if any) that the step enters ``phase`` (0: the pipeline
    schedule, 1: gradient sync and optimizer): it resynchronises its plan cursor there."""
    if _ACTIVE is not None:
        _ACTIVE.set_phase(phase)


# ------------------------------------------------------------------ planning a recorded step


@dataclass
class StepPlan:
    """The plan of one step: its requests in order (``sizes``, ``phases``, ``streams``), each
    request's arena ``offsets`` (-1: left to the fallback pool), the ``arena_bytes``, and the step
    as an :class:`AllocationTrace` (for the caching allocator's replay and the lower bound)."""
    sizes: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    phases: list[int] = field(default_factory=list)
    streams: list[int] = field(default_factory=list)
    arena_bytes: int = 0
    trace: AllocationTrace = field(default_factory=AllocationTrace)

    @property
    def unplanned_bytes(self) -> int:
        return sum(s for s, o in zip(self.sizes, self.offsets) if o < 0)


def plan_step(log: list[tuple], first: int, second: int) -> StepPlan:
    """The plan of step ``second`` from the allocator's record log (``(step, 'alloc'|'free', id,
    size, phase, stream)``) of steps ``first`` and ``second = first + 1``.

    A block the step allocates and frees lives between the two. A block it leaves live is the
    counterpart of one the first step allocated at the same place in its order (aligned by size,
    phase and stream, skipping what only the first step allocates, such as the optimizer's
    moments): the next step frees it where the second step freed that one, so it occupies its
    range from its allocation to the end of the step and from the start of the step to that
    free. A block whose counterpart was never freed, or was freed after this one was allocated,
    is not placed (the fallback pool serves it)."""
    ev2 = [e for e in log if e[0] == second]
    allocs1 = [e for e in log if e[0] == first and e[1] == "alloc"]
    freed_at = {e[2]: t for t, e in enumerate(ev2) if e[1] == "free"}
    allocs2 = [(t, e) for t, e in enumerate(ev2) if e[1] == "alloc"]
    n_events = len(ev2)
    counterpart, j = {}, 0
    for i, (_, e) in enumerate(allocs2):
        for k in range(j, min(j + LOOK_AHEAD, len(allocs1))):
            a = allocs1[k]
            if (a[3], a[4], a[5]) == (e[3], e[4], e[5]):
                counterpart[i], j = a[2], k + 1
                break
    plan = StepPlan(trace=AllocationTrace([(e[1], e[2], e[3]) for e in ev2],
                                          source=f"planned allocator: step {second} as recorded"))
    pieces: list[list[tuple[int, int]]] = []
    for i, (t, e) in enumerate(allocs2):
        plan.sizes.append(e[3])
        plan.phases.append(e[4])
        plan.streams.append(e[5])
        if e[2] in freed_at:
            pieces.append([(t, freed_at[e[2]])])
        else:
            g = freed_at.get(counterpart.get(i), None)
            pieces.append([(t, n_events)] + ([(0, g)] if g else []) if g is not None and g <= t else [])
    offsets, arena = place_cyclic([-(-max(s, 1) // ALIGN) * ALIGN for s in plan.sizes], pieces)
    plan.offsets, plan.arena_bytes = offsets, arena
    return plan


def place_cyclic(sizes: list[int], pieces: list[list[tuple[int, int]]]) -> tuple[list[int], int]:
    """Greedy-by-size placement (as :func:`hetero.memplan.arena.plan_arena`) of blocks that may live
    over several intervals (``pieces[i]``: ``[start, end)`` event ranges; a block live across the
    step boundary has two). A block without pieces is not placed (offset -1). Returns the offsets
    and the arena's size."""
    import numpy as np

    owner, ps, pe = [], [], []
    for b, ivs in enumerate(pieces):
        for s, e in ivs:
            if e > s:
                owner.append(b)
                ps.append(s)
                pe.append(e)
    offsets = np.full(len(sizes), -1, dtype=np.int64)
    if not owner:
        return offsets.tolist(), 0
    owner_a, ps_a, pe_a = np.asarray(owner), np.asarray(ps, dtype=np.int64), np.asarray(pe, dtype=np.int64)
    size_a = np.asarray(sizes, dtype=np.int64)
    of_block: dict[int, list[int]] = {}
    for pid, b in enumerate(owner):
        of_block.setdefault(b, []).append(pid)
    span = np.zeros(len(sizes), dtype=np.int64)
    np.add.at(span, owner_a, pe_a - ps_a)
    blocks = np.asarray(sorted(of_block), dtype=np.int64)
    order = blocks[np.lexsort((-span[blocks], -size_a[blocks]))]
    index = LifetimeIndex(ps_a, pe_a)
    for b in order:
        hits = np.concatenate([index.placed_overlapping(ps_a[p], pe_a[p]) for p in of_block[b]])
        near = np.unique(owner_a[hits]) if len(hits) else np.empty(0, dtype=np.int64)
        offsets[b] = best_gap(offsets[near], size_a[near], int(size_a[b]))
        for p in of_block[b]:
            index.place(p)
    placed = offsets >= 0
    return offsets.tolist(), int((offsets[placed] + size_a[placed]).max()) if placed.any() else 0


# ------------------------------------------------------------------ the allocator in a process


class PlannedAllocator:
    """One process's planned allocator for ``device`` (``cpu`` or ``cuda``): :meth:`install` it
    before the first allocation it is to serve, call :meth:`begin_step` / :meth:`end_step` around
    every training step (1-based). Steps ``record_from`` and ``record_from + 1`` are recorded; the
    plan is served from the step after."""

    kind = "planned"

    def __init__(self, device: str = "cpu", record_from: int = 1):
        self.device = "cuda" if str(device).startswith("cuda") else "cpu"
        self.record_from = record_from
        self.ext = None
        self.plan: StepPlan | None = None
        self.failure: str | None = None
        """Why the allocator is not in use (build or install failed), else None."""

    def install(self) -> bool:
        """Build (or load) the library and make it the device's allocator; False (and
        :attr:`failure` says why) when that fails: the process keeps the default allocator."""
        global _ACTIVE
        try:
            self.ext = load_extension(self.device == "cuda")
            if self.device == "cuda":
                import torch

                alloc = torch.cuda.memory.CUDAPluggableAllocator(self.ext.__file__, "hetero_planned_malloc",
                                                                  "hetero_planned_free")
                torch.cuda.memory.change_current_allocator(alloc)   # raises once CUDA has allocated
                self.ext.use_cuda_backend()
            elif not self.ext.install_cpu():
                raise RuntimeError("c10 kept a CPU allocator registered at a higher priority")
        except Exception as e:  # noqa: BLE001 - any failure: run with the default allocator, say why
            self.failure = str(e).splitlines()[0] if str(e) else type(e).__name__
            self.ext = None
            return False
        _ACTIVE = self
        return True

    def uninstall(self) -> None:
        """CPU: restore the allocator installed before (blocks handed out stay valid and come back
        here when their tensors die). CUDA keeps a pluggable allocator for the process's life."""
        global _ACTIVE
        if self.ext is not None and self.device == "cpu":
            self.ext.uninstall_cpu()
        if _ACTIVE is self:
            _ACTIVE = None

    @property
    def active(self) -> bool:
        return self.ext is not None

    def begin_step(self, step: int) -> None:
        if not self.active:
            return
        if step == self.record_from:
            self.ext.set_mode(1)
        self.ext.begin_step(step)

    def set_phase(self, phase: int) -> None:
        if self.active:
            self.ext.set_phase(phase)

    def end_step(self, step: int) -> None:
        """After the second recorded step: plan it and serve the plan from the next step on."""
        if not self.active or step != self.record_from + 1:
            return
        self.ext.set_mode(0)
        log = self.ext.take_log()
        self.plan = plan_step(log, self.record_from, step)
        p = self.plan
        if not self.ext.serve(p.sizes, p.offsets, p.phases, p.streams, p.arena_bytes):
            self.failure = f"could not reserve the planned arena of {p.arena_bytes} bytes"

    def stats(self) -> dict:
        """The counters of the run summary's ``allocator`` entry, with the recorded step's lower
        bound and the caching allocator's replay of it (what the default allocator would reserve)."""
        out = {"kind": self.kind if self.active else "caching"}
        if not self.active:
            out["fallback_reason"] = self.failure
            return out
        s = dict(self.ext.stats())
        out.update({k: int(s[k]) for k in ("reserved_bytes", "peak_live_bytes", "planned_bytes", "fallback_bytes",
                                           "planned_hits", "fallback_allocs", "planned_served_bytes",
                                           "fallback_served_bytes", "overlap_refusals", "unmatched_requests")})
        out["serving"] = s["mode"] == 2
        if self.plan is not None:
            from hetero.memplan.caching import simulate_caching_allocator

            out["plan_entries"] = len(self.plan.sizes)
            out["lower_bound_bytes"] = self.plan.trace.lower_bound_bytes()
            out["caching_replay_reserved_bytes"] = simulate_caching_allocator(self.plan.trace).reserved_bytes
        if self.failure:
            out["note"] = self.failure
        return out
