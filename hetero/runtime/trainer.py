"""The step loop: engine steps, per-step metrics, hooks that may pause at a step boundary.

``Trainer.add_hook(fn)``: ``fn(trainer, result)`` runs after every step on every rank; returning
``False`` (on any rank: the decision is all-reduced) stops the loop at that step boundary, with
the model, optimizer and ``trainer.step`` intact, so elastic reconfiguration can take over from
there. ``trainer.request_pause()`` does the same from elsewhere in the process.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from hetero.runtime.collectives import Collectives
from hetero.runtime.engine import NativeEngine, RunContext
from hetero.runtime.lr_schedule import options_lr
from hetero.runtime.pipeline import Timings
from hetero.runtime.spec import describe_rank


class InjectedFailure(SystemExit):
    """Raised by ``--inject-failure STEP:RANK`` on that rank at that step (the worker then dies hard)."""


@dataclass
class StepResult:
    """One training step as every rank sees it after the step's all-reduce."""

    step: int
    """1-based step number."""
    loss: float
    time_s: float
    grad_norm: float
    forward_s: list[float]
    """Per rank: mean forward compute time of one micro-batch this step."""
    backward_s: list[float]
    schedule_s: list[float] = field(default_factory=list)
    """Per rank: wall time of the pipeline schedule (compute, waits, p2p)."""
    sync_s: list[float] = field(default_factory=list)
    """Per rank: gradient sync + global-norm all-reduce."""
    optimizer_s: list[float] = field(default_factory=list)
    """Per rank: optimizer step, the gradient-norm pass and AdamW (emulated slowdown included)."""
    loss_scale: float | None = None
    """fp16: the loss scale this step ran with (None otherwise)."""
    skipped: bool = False
    """fp16: the update was skipped because a gradient overflowed at that scale."""
    lr: float | None = None
    """The learning rate the step's update applied (:mod:`hetero.runtime.lr_schedule`)."""
    moe_aux_loss: float = 0.0
    """MoE models: the aux loss term the step added to the training loss (``loss`` stays the LM loss)."""
    moe_dropped: int = 0
    """MoE models with a capacity: token assignments dropped over capacity in the step, all ranks."""


PER_RANK = ("forward_s", "backward_s", "schedule_s", "sync_s", "optimizer_s")


@dataclass
class TrainState:
    results: list[StepResult] = field(default_factory=list)
    events: list = field(default_factory=list)


class Trainer:
    """One rank's training: process groups, the engine (native or DeepSpeed), the step loop."""

    total_steps: int | None = None
    """None (a rank that joined a running job, built without ``__init__``): the end of :meth:`train`'s
    call, which the worker makes with the run's remaining steps."""

    def __init__(self, spec, rank: int, on_ready: Callable[[], None] | None = None):
        self.ctx = ctx = RunContext(spec, rank)
        self.rank, self.world = rank, ctx.layout.world_size
        opts = ctx.options
        torch.manual_seed(opts.seed)
        torch.set_num_threads(max(1, opts.threads))
        if opts.load and opts.engine != "deepspeed":   # before meeting the other ranks (see there)
            from hetero.runtime.checkpoint import check_layer_count

            check_layer_count(opts.load, ctx.model.num_layers)
        self.allocator = _install_allocator(opts.allocator, ctx.device)
        """The planned allocator (``--allocator planned``), installed before anything is allocated on
        the rank's device; None with the default allocator."""
        self.comm = Collectives.init(rank, self.world, opts.timeout_s,
                                     describe=lambda r: describe_rank(ctx.layout.ranks[r]),
                                     vendors=[r.vendor for r in ctx.layout.ranks],
                                     device=ctx.device, device_types=ctx.device_types)
        if on_ready:
            on_ready()
        engine_cls = NativeEngine
        if opts.engine == "deepspeed":
            from hetero.runtime.ds_engine import DeepSpeedEngine

            engine_cls = DeepSpeedEngine
        ctx.parallel.create_groups(self.comm)
        self.engine = engine_cls(ctx, self.comm)
        self.step = 0
        if opts.load:
            self.step = self.engine.load(opts.load)
        self.applied_step = self.step
        """The last step whose optimizer update this rank applied: ahead of ``step`` when a peer fails
        between the update and the step's closing all-reduce (an elastic handoff records it)."""
        self.total_steps = self.step + opts.steps
        """The run's last step, where the learning-rate schedule ends its decay: a resumed run's steps
        count on from the checkpoint's."""
        self.hooks: list[Callable] = []
        self._pause = False
        self.state = TrainState()
        self.tokens_per_step = ctx.plan.global_batch_size * ctx.model.seq_length

    def add_hook(self, fn: Callable) -> None:
        """Run ``fn(trainer, result)`` after every step; ``False`` stops the loop (see module docstring)."""
        self.hooks.append(fn)

    def request_pause(self) -> None:
        """Stop the loop at the next step boundary."""
        self._pause = True

    def train(self, steps: int, log: Callable[[StepResult], None] | None = None) -> TrainState:
        """Run up to ``steps`` more steps, calling ``log(result)`` after each; returns the state."""
        end = self.step + steps
        inject = self.ctx.options.inject_failure
        while self.step < end:
            number = self.step + 1
            if inject and inject[0] == number and inject[1] == self.rank:
                raise InjectedFailure(f"injected failure at step {number}")
            timings = Timings()
            t0 = time.perf_counter()
            if self.allocator:
                self.allocator.begin_step(number)
            lr = options_lr(self.ctx.options, self.step, self.total_steps or end)
            self.engine.set_lr(lr)
            loss, norm = self.engine.train_step(self.step, timings)
            self.applied_step = number
            # One all-reduce gives every rank the loss and every rank's compute times.
            W, K = self.world, len(PER_RANK)
            row = torch.zeros(K * W + 3, dtype=torch.float64)
            row[0] = loss
            row[-2:] = torch.tensor(getattr(self.engine, "step_moe", (0.0, 0)), dtype=torch.float64)
            mine = (_mean(timings.forward_s), _mean(timings.backward_s), timings.schedule_s, timings.sync_s,
                    timings.optimizer_s)
            for i, v in enumerate(mine):
                row[1 + i * W + self.rank] = v
            self.comm.all_reduce(row)
            elapsed = time.perf_counter() - t0
            col = lambda i: [float(v) for v in row[1 + i * W:1 + (i + 1) * W]]  # noqa: E731
            result = StepResult(step=number, loss=float(row[0]), time_s=elapsed, grad_norm=norm,
                                forward_s=col(0), backward_s=col(1), schedule_s=col(2), sync_s=col(3),
                                optimizer_s=col(4), loss_scale=getattr(self.engine, "step_loss_scale", None),
                                skipped=bool(getattr(self.engine, "step_skipped", False)), lr=lr,
                                moe_aux_loss=float(row[-2]), moe_dropped=int(row[-1]))
            self.state.results.append(result)
            if self.ctx.options.trace:
                self.state.events.extend((k, mb, number, t, d) for k, mb, t, d in timings.events)
            self.step = number
            if log:
                log(result)
            stop = self._pause or any(h(self, result) is False for h in self.hooks)
            flag = self.comm.all_reduce(torch.tensor([1.0 if stop else 0.0]), op="max")
            if self.allocator:   # after the second recorded step: plan it, serve it from the next
                self.allocator.end_step(number)
            if float(flag[0]) > 0:
                self._pause = False
                break
        getattr(self.engine, "settle", lambda: None)()   # ZeRO's last parameter all-gathers
        return self.state

    def save(self, path: str) -> None:
        self.engine.save(path, self.step)

    def gather_optimizer_state_bytes(self) -> list[int | None]:
        """Every rank's bytes of optimizer state (None where the engine does not say); a collective."""
        fn = getattr(self.engine, "optimizer_state_bytes", None)
        return self.comm.all_gather_object(fn() if fn else None)

    def gather_allocator_stats(self) -> list[dict] | None:
        """Every rank's allocator counters (:meth:`PlannedAllocator.stats`), or None with the default
        allocator; a collective."""
        if self.ctx.options.allocator == "caching":
            return None
        return self.comm.all_gather_object(self.allocator.stats() if self.allocator else {"kind": "caching"})

    def gather_events(self) -> list | None:
        """Every rank's trace events, on rank 0 (None elsewhere); a collective: all ranks call it."""
        events = self.comm.all_gather_object(self.state.events)
        return events if self.rank == 0 else None


def _install_allocator(kind: str, device):
    """``--allocator planned``: the rank's :class:`~hetero.memplan.serve.PlannedAllocator`, installed
    (or, where that fails, kept uninstalled: its stats say why and the rank runs with the default
    allocator, which a message on stderr names)."""
    if kind != "planned":
        return None
    import sys

    from hetero.memplan.serve import PlannedAllocator

    alloc = PlannedAllocator(device.type)
    if not alloc.install():
        print(f"note: --allocator planned: {alloc.failure}; running with the default allocator", file=sys.stderr,
              flush=True)
    return alloc


def _mean(xs) -> float:
    return statistics.fmean(xs) if xs else 0.0


def steady(values: list[float]) -> list[float]:
    """Drop the first (warm-up) step when there are more."""
    return values[1:] if len(values) > 1 else values


def summary_dict(trainer: Trainer, predicted: float | None, state_bytes: list | None = None,
                 allocator_stats: list | None = None) -> dict:
    """The training run summary of docs/formats.md (plus optional extra fields); ``state_bytes``: every
    rank's optimizer state bytes (:meth:`Trainer.gather_optimizer_state_bytes`); ``allocator_stats``:
    every rank's allocator counters (:meth:`Trainer.gather_allocator_stats`)."""
    ctx, res = trainer.ctx, trainer.state.results
    times = [r.time_s for r in res]
    st = steady(times)
    tokens_per_s = trainer.tokens_per_step / statistics.fmean(st) if st else 0.0
    ranks = []
    world = len(ctx.layout.ranks)
    now = [r for r in res if len(r.forward_s) == world]   # per rank: the steps of a world this size (an elastic run grew)
    for info in ctx.layout.ranks:
        f = steady([r.forward_s[info.rank] for r in now])
        b = steady([r.backward_s[info.rank] for r in now])
        ranks.append({"rank": info.rank, "group": info.group, "pipeline": info.pipeline, "replica": info.replica,
                      "stage": info.stage, "layers": list(info.layers),
                      "forward_time_s": _mean(f), "backward_time_s": _mean(b),
                      "schedule_time_s": _mean(steady([r.schedule_s[info.rank] for r in now if r.schedule_s])),
                      "grad_sync_time_s": _mean(steady([r.sync_s[info.rank] for r in now if r.sync_s])),
                      "optimizer_time_s": _mean(steady([r.optimizer_s[info.rank] for r in now if r.optimizer_s])),
                      "vendor": info.vendor, "device": ctx.device_types[info.rank],
                      "tp_rank": info.tp_rank, "tp_size": info.tp_size})
        if state_bytes and state_bytes[info.rank] is not None:
            ranks[-1]["optimizer_state_bytes"] = int(state_bytes[info.rank])
        if allocator_stats and allocator_stats[info.rank] is not None:
            ranks[-1]["allocator"] = allocator_stats[info.rank]
        if len(info.chunks) > 1:  # interleaved: the layers of every model chunk this rank runs
            ranks[-1]["chunk_layers"] = [list(c) for c in info.chunk_layers(ctx.plan)]
        if ctx.model.moe is not None:   # routed experts held per MoE layer (all of them without expert parallelism)
            held = [layer for a, b in info.chunk_layers(ctx.plan) for layer in range(a, b)]
            ep = ctx.parallel.experts.held(info.rank) if ctx.parallel.experts is not None else {}
            ranks[-1]["experts"] = {str(layer): ep.get(layer, ctx.model.moe.num_experts) for layer in held
                                    if ctx.model.is_moe_layer(layer)}
    scaling = {}
    if any(r.loss_scale is not None for r in res):  # fp16 with the native engine
        scaling = {"loss_scales": [r.loss_scale for r in res], "skipped_steps": [r.step for r in res if r.skipped]}
    # a diverged step's loss is NaN / inf: null, since JSON has no NaN / Infinity (as for grad_norms)
    losses = [r.loss if math.isfinite(r.loss) else None for r in res]
    moe = {}
    if ctx.model.moe is not None:   # the aux term beside the LM loss; the training loss is their sum
        moe = {"moe_aux_losses": [r.moe_aux_loss for r in res], "moe_dropped": [r.moe_dropped for r in res]}
    return {**scaling, **moe, "steps": len(res), "losses": losses, "lrs": [r.lr for r in res], "iteration_times_s": times,
            "tokens_per_s": tokens_per_s, "predicted_iteration_time_s": predicted, "ranks": ranks,
            "reconfigurations": [],
            "median_iteration_time_s": statistics.median(st) if st else None,
            # a skipped fp16 step has no finite norm: null, since JSON has no NaN / Infinity
            "grad_norms": [r.grad_norm if math.isfinite(r.grad_norm) else None for r in res],
            "engine": ctx.options.engine,
            "overlap": bool(getattr(trainer.engine, "reducer", None)),
            "compiled_blocks": int(getattr(trainer.engine, "compiled", 0)),
            "schedule": ctx.plan.schedule,
            "communicator": "hetero.comm" if trainer.comm.hc is not None else "torch.distributed", "global_batch_size": ctx.plan.global_batch_size,
            "seq_length": ctx.model.seq_length, "world_size": trainer.world, "pid": os.getpid()}
