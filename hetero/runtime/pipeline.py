"""Pipeline schedules (GPipe, 1F1B) written by hand over explicit send/recv.

Stages of one pipeline may run on different vendors, so activations and gradients travel through
:class:`~hetero.runtime.collectives.Collectives` (the host bridge between vendors) rather than
``torch.distributed.pipelining``, whose stages talk to each other on one process group.

Tensor parallelism inside a stage keeps the residual stream replicated on every tp rank, so the
hand-off between a stage of tp ``a`` and the next of tp ``b`` is a fan-out: receiver tp rank ``j``
takes the activation from sender tp rank ``j % a``, and gradients go back the same way (stage
``s`` tp rank ``i`` receives from stage ``s+1`` tp rank ``i % b``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from hetero.errors import HeteroError


def schedule_actions(kind: str, stage: int, num_stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The ordered ("F"|"B", micro-batch) actions of one stage."""
    M = micro_batches
    if kind == "gpipe":
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    if kind == "1f1b":
        warm = min(num_stages - stage - 1, M)
        acts = [("F", m) for m in range(warm)]
        for i in range(M - warm):
            acts += [("F", warm + i), ("B", i)]
        acts += [("B", m) for m in range(M - warm, M)]
        return acts
    raise HeteroError(f"schedule '{kind}' is not supported by the runtime (use 1f1b or gpipe)")


@dataclass
class Peers:
    """Who this rank exchanges activations and gradients with."""

    recv_act_from: int | None = None
    send_act_to: list[int] = field(default_factory=list)
    recv_grad_from: int | None = None
    send_grad_to: list[int] = field(default_factory=list)


def stage_peers(layout, me) -> Peers:
    """Peers of rank ``me`` along its pipeline replica (see the module docstring for the fan-out)."""
    def stage_ranks(stage):
        return layout.stage_ranks(me.pipeline, me.replica, stage)

    num_stages = 1 + max(r.stage for r in layout.ranks if (r.pipeline, r.replica) == (me.pipeline, me.replica))
    p = Peers()
    if me.stage > 0:
        prev = stage_ranks(me.stage - 1)
        p.recv_act_from = prev[me.tp_rank % len(prev)]
        p.send_grad_to = [r for i, r in enumerate(prev) if i % me.tp_size == me.tp_rank]
    if me.stage < num_stages - 1:
        nxt = stage_ranks(me.stage + 1)
        p.send_act_to = [r for i, r in enumerate(nxt) if i % me.tp_size == me.tp_rank]
        p.recv_grad_from = nxt[me.tp_rank % len(nxt)]
    return p


def timed(fn: Callable[[], object], slowdown: float = 1.0) -> tuple[object, float, float]:
    """Run ``fn`` as a device ``slowdown`` times slower would: really compute, then wait
    ``(slowdown - 1) x`` the compute time. Returns (result, start wall time, duration with the wait)."""
    wall = time.time()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    if slowdown > 1.0:
        time.sleep((slowdown - 1.0) * dt)
    return out, wall, time.perf_counter() - t0


@dataclass
class Timings:
    """Compute times of one step on this rank (emulated slowdown included)."""

    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)
    events: list[tuple[str, int, float, float]] = field(default_factory=list)
    """(kind F/B, micro-batch, start wall time, duration) for the trace."""
    schedule_s: float = 0.0
    """Wall time of the pipeline schedule (all micro-batches, waits and p2p included)."""
    sync_s: float = 0.0
    """Wall time of the data-parallel gradient sync and the global-norm all-reduce."""
    optimizer_s: float = 0.0
    """Wall time of the optimizer step (clipping and emulated slowdown included)."""


class StageExecutor:
    """Runs one step's schedule on one rank of one stage."""

    def __init__(self, module, comm, peers: Peers, *, first: bool, last: bool, act_shape: tuple[int, ...],
                 slowdown: float = 1.0, autocast_dtype: torch.dtype | None = None):
        self.module, self.comm, self.peers = module, comm, peers
        self.first, self.last = first, last
        self.act_shape = act_shape
        self.slowdown = slowdown
        self.autocast_dtype = autocast_dtype

    def _compute(self, fn: Callable[[], object]):
        return timed(fn, self.slowdown)

    def _forward(self, x):
        if self.autocast_dtype is not None:
            with torch.autocast("cpu", dtype=self.autocast_dtype):
                return self.module(x)
        return self.module(x)

    def run(self, actions, get_inputs: Callable[[int], torch.Tensor], get_targets: Callable[[int], torch.Tensor],
            loss_fn: Callable, loss_scale: float, timings: Timings) -> float:
        """Execute ``actions``; returns the sum of scaled micro-batch losses (last stage, else 0)."""
        saved: dict[int, tuple] = {}
        total = 0.0
        for kind, mb in actions:
            if kind == "F":
                if self.first:
                    x = get_inputs(mb)
                else:
                    x = torch.empty(self.act_shape, dtype=torch.float32)
                    self.comm.recv(x, self.peers.recv_act_from)
                    x.requires_grad_(True)
                if self.last:
                    tgt = get_targets(mb)
                    loss, t0, dt = self._compute(lambda: loss_fn(self._forward(x), tgt) * loss_scale)
                    total += float(loss.detach())
                    saved[mb] = (x, loss)
                else:
                    out, t0, dt = self._compute(lambda: self._forward(x).float())
                    for dst in self.peers.send_act_to:
                        self.comm.send(out.detach(), dst)
                    saved[mb] = (x, out)
                timings.forward_s.append(dt)
                timings.events.append(("F", mb, t0, dt))
            else:
                x, out = saved.pop(mb)
                if self.last:
                    _, t0, dt = self._compute(lambda: out.backward())
                else:
                    grad = torch.empty(self.act_shape, dtype=torch.float32)
                    self.comm.recv(grad, self.peers.recv_grad_from)
                    _, t0, dt = self._compute(lambda: out.backward(grad))
                if not self.first:
                    for dst in self.peers.send_grad_to:
                        self.comm.send(x.grad, dst)
                timings.backward_s.append(dt)
                timings.events.append(("B", mb, t0, dt))
        self.comm.wait_sends()
        return total
