"""What an allocator reserves for a stage: PyTorch's caching allocator or the planned arena.

The predicted peak (:mod:`.memory`) counts bytes live at once. What a device must have is what its
allocator reserves for them: PyTorch's caching allocator keeps freed blocks in segments that later
requests of other sizes cannot always reuse (fragmentation), and the planned allocator
(``hetero launch --allocator planned``) serves the step from one arena laid out ahead of time.

Both are modelled the same way, ``reserved = a x model states + b x activations + overhead``
(states: weights, gradients and optimizer moments; activations: everything else of the peak;
the framework overhead as :mod:`.memory` has it), with ``(a, b)`` fitted by least squares on the
relative error over the runtime's own stages recorded at full width and replayed
(``data/caching_fragmentation.json``, written by ``benchmarks/bench_fragmentation.py``): the caching
allocator's replay (:mod:`hetero.memplan.caching`) for ``caching``, the greedy arena
(:mod:`hetero.memplan.arena`) for ``planned``. :func:`fit_errors` gives each stage's error with the
coefficients fitted on all stages, :func:`held_out_errors` with each stage left out of its own fit.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Protocol

from hetero.errors import HeteroError

KINDS = ("caching", "planned")
"""Allocators the predictor can judge fit by (``--allocator``); None: the live peak itself."""

DATA = Path(__file__).with_name("data") / "caching_fragmentation.json"
_TARGET = {"caching": "caching_reserved_bytes", "planned": "arena_bytes"}


@functools.lru_cache(maxsize=1)
def _stages() -> tuple[dict, ...]:
    return tuple(json.loads(DATA.read_text())["stages"])


def _fit(rows, kind: str) -> tuple[float, float]:
    import numpy as np

    # the recorded lower bound stands for the predicted peak: split in the predictor's proportions
    x = np.array([[r["predicted_state_bytes"], r["predicted_activation_bytes"]] for r in rows], dtype=float)
    x *= np.array([r["lower_bound_bytes"] / r["predicted_live_bytes"] for r in rows])[:, None]
    y = np.array([r[_TARGET[kind]] for r in rows], dtype=float)
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)
    return float(coef[0]), float(coef[1])


@functools.lru_cache(maxsize=None)
def coefficients(kind: str) -> tuple[float, float]:
    """``(a, b)`` of ``kind``: reserved = a x states + b x activations (+ overhead)."""
    if kind not in KINDS:
        raise ValueError(f"allocator must be one of {', '.join(KINDS)}, got {kind!r}")
    return _fit(_stages(), kind)


def reserved_bytes(kind: str | None, breakdown) -> float:
    """The bytes ``kind``'s allocator reserves for a stage whose peak is ``breakdown``
    (:class:`.memory.MemoryBreakdown`); ``None``: the peak itself."""
    if kind is None:
        return breakdown.total
    a, b = coefficients(kind)
    states = breakdown.weights + breakdown.gradients + breakdown.optimizer
    return a * states + b * breakdown.activations + breakdown.overhead


def _errors(r: dict, kind: str, a: float, b: float) -> dict:
    s, act, target = r["predicted_state_bytes"], r["predicted_activation_bytes"], r[_TARGET[kind]]
    scale = r["lower_bound_bytes"] / r["predicted_live_bytes"]
    return {"case": r["case"], "stage": r["stage"], "replayed_bytes": target,
            "error": (a * s + b * act) / target - 1, "fit_error": scale * (a * s + b * act) / target - 1}


def fit_errors(kind: str) -> list[dict]:
    """Per recorded stage: the model's reservation for the predictor's peak of that stage against the
    replay's (``error``), and for the recorded lower bound (``fit_error``: the model alone)."""
    a, b = coefficients(kind)
    return [_errors(r, kind, a, b) for r in _stages()]


def held_out_errors(kind: str) -> list[dict]:
    """As :func:`fit_errors`, each stage with ``(a, b)`` fitted on the other stages only (leave one
    out): how the model does on a stage it has not seen."""
    coefficients(kind)   # the same check of ``kind``
    rows = _stages()
    return [_errors(r, kind, *_fit(rows[:i] + rows[i + 1:], kind)) for i, r in enumerate(rows)]


# ---------------------------------------------------------------------------- the step's own requests
class StageRecorder(Protocol):
    """Records the memory requests one physical stage makes over its training steps, as the runtime
    makes them (an :class:`hetero.memplan.trace.AllocationTrace`): its model, schedule, autocast,
    gradient buffers and optimizer, run on fake tensors. The predictor owns this interface and never
    imports the runtime: the ``hetero`` package registers the runtime's recorder
    (:func:`hetero.memplan.record.record_stage`) when it is imported (:func:`register_stage_recorder`)."""

    def __call__(self, model, plan, pipeline: int, stage: int, *, chunks=None, marks: bool = False,
                 micro_batches: int | None = None): ...


_RECORDER: list[StageRecorder] = []


def register_stage_recorder(recorder: StageRecorder | None) -> None:
    """Make ``recorder`` the one :func:`simulated_trace` records stages with (None: none)."""
    _RECORDER[:] = [recorder] if recorder is not None else []
    _REPLAYS.clear()   # replays made with another recorder


def stage_recorder() -> StageRecorder:
    """The registered :class:`StageRecorder`; a clear error where none is."""
    if not _RECORDER:
        raise HeteroError("allocator 'caching' replays a stage's own requests, and no stage recorder is registered "
                          "(fix: import hetero, which registers the runtime's, or call "
                          "hetero.predictor.allocator.register_stage_recorder)")
    return _RECORDER[0]


def stage_of(plan, pipeline: int, stage: int) -> dict:
    """The layer ranges (model chunks), ends and tp of physical stage ``stage`` of pipeline
    ``pipeline``; errors name the option and the valid range."""
    if not 0 <= pipeline < len(plan.pipelines):
        raise HeteroError(f"--pipeline {pipeline}: the plan has pipelines 0-{len(plan.pipelines) - 1}")
    p = plan.pipelines[pipeline]
    phys = len(plan.physical_stages(p))
    if not 0 <= stage < phys:
        raise HeteroError(f"--stage {stage}: pipeline {pipeline} of the plan has stages 0-{phys - 1}")
    vstages = list(range(stage, len(p.stages), phys))
    return {"chunks": tuple(tuple(p.stages[v].layers) for v in vstages), "first": stage == 0,
            "last": vstages[-1] == len(p.stages) - 1, "tp": p.stages[stage].tp, "group": p.stages[stage].group,
            "micro_batch_size": plan.mbs(p), "micro_batches": p.micro_batches, "physical_stages": phys,
            "virtual": plan.virtual_chunks(p)}


REPLAY_DEPTH = 4
"""Chunks of up to this many layers are recorded whole; deeper ones are recorded with this many
and their requests deepened by :func:`hetero.memplan.expand.expand_layers`."""

_REPLAYS: dict = {}


def _stage_key(model, plan, pipeline: int, stage: int) -> tuple:
    """Everything of ``plan`` that decides what physical stage ``stage`` of ``pipeline`` requests,
    in which order: stages of different plans that agree on it share one replay."""
    from .memory import zero_degrees

    w = stage_of(plan, pipeline, stage)
    degree = zero_degrees(model, plan)[pipeline][stage] if plan.zero_stage >= 1 else 1.0
    return (model, plan.schedule, plan.recompute, plan.zero_stage, degree, stage, w["physical_stages"],
            _micro_batches(plan, w, stage), w["virtual"], w["micro_batch_size"], w["tp"], w["first"], w["last"],
            tuple(b - a for a, b in w["chunks"]), sum(p.replicas for p in plan.pipelines),
            all(s.tp == 1 for p in plan.pipelines for s in p.stages))


STEADY_MICRO_BATCHES = 2
"""Under 1F1B a stage is recorded with at most this many micro-batches more than it holds at once."""


def _micro_batches(plan, where: dict, stage: int) -> int:
    """The micro-batches to record: under 1F1B (one chunk per device) the stage's warm-up and
    :data:`STEADY_MICRO_BATCHES` of its steady state, where each further micro-batch repeats the
    steady state's requests on blocks of the same sizes freed just before, and reserves nothing
    new; every micro-batch otherwise (GPipe and interleaved hold more of them)."""
    m = where["micro_batches"]
    if plan.schedule != "1f1b" or where["virtual"] > 1:
        return m
    return min(m, where["physical_stages"] - stage + STEADY_MICRO_BATCHES)


def simulated_trace(model, plan, pipeline: int, stage: int):
    """The requests physical stage ``stage`` of ``pipeline`` makes over two training steps, in the
    runtime's order (:class:`hetero.memplan.trace.AllocationTrace`): its stage model, schedule,
    autocast, gradient buffers and sum and AdamW run on fake tensors
    (the registered :class:`StageRecorder`), every chunk cut to :data:`REPLAY_DEPTH` layers at
    most, then deepened back to the plan's layers by repeating a middle layer's requests
    (:func:`hetero.memplan.expand.expand_layers`): the cost of recording does not grow with depth;
    under 1F1B with the micro-batches :func:`_micro_batches` gives (the step's requests repeat
    beyond them: what they reserve does not change, the trace is shorter)."""
    from hetero.memplan.expand import expand_layers

    record_stage = stage_recorder()
    where = stage_of(plan, pipeline, stage)
    chunks, m = where["chunks"], _micro_batches(plan, where, stage)
    if max(b - a for a, b in chunks) <= REPLAY_DEPTH:
        return record_stage(model, plan, pipeline, stage, micro_batches=m)
    cut = [(a, min(b, a + REPLAY_DEPTH)) for a, b in chunks]
    trace = record_stage(model, plan, pipeline, stage, chunks=cut, marks=True, micro_batches=m)
    return expand_layers(trace.events, cut, {a: b - a for a, b in chunks})


def replay_layer_passes(plan, pipeline: int, stage: int) -> int:
    """The layer forwards and backwards one recorded step of :func:`simulated_trace` runs: what
    its cost grows with (a few milliseconds each on fake tensors)."""
    w = stage_of(plan, pipeline, stage)
    layers = sum(min(b - a, REPLAY_DEPTH) for a, b in w["chunks"])
    return 2 * _micro_batches(plan, w, stage) * layers


def simulated_caching_bytes(model, plan, pipeline: int, stage: int) -> int | None:
    """What PyTorch's caching allocator reserves for physical stage ``stage`` of ``pipeline``: the
    :func:`simulated_trace` of its requests replayed through :mod:`hetero.memplan.caching`; tensors
    only (no framework overhead). Memoised per stage signature (:func:`_stage_key`). None where the
    stage cannot be recorded or deepened (the caller falls back to :func:`reserved_bytes`)."""
    key = _stage_key(model, plan, pipeline, stage)
    if key not in _REPLAYS:
        from hetero.memplan.caching import simulate_caching_allocator

        try:
            _REPLAYS[key] = simulate_caching_allocator(simulated_trace(model, plan, pipeline, stage)).reserved_bytes
        except (ValueError, RuntimeError, NotImplementedError):   # a model the recorder cannot run
            _REPLAYS[key] = None
        if len(_REPLAYS) > 4096:
            _REPLAYS.pop(next(iter(_REPLAYS)))
    return _REPLAYS[key]
