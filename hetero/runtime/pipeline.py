"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B) run by hand over explicit send/recv.

Stages of one pipeline may run on different vendors, so activations and gradients travel through
:class:`~hetero.runtime.collectives.Collectives` (the host bridge between vendors) rather than
``torch.distributed.pipelining``, whose stages talk to each other on one process group.

Tensor parallelism inside a stage keeps the residual stream replicated on every tp rank, so the
hand-off between a stage of tp ``a`` and the next of tp ``b`` is a scatter-gather (Megatron-LM's
scatter-gather optimisation): receiver tp rank ``j`` takes slice ``j`` of ``b`` of the flattened
activation from sender tp rank ``j % a``, and the receiving stage all-gathers the slices among its
tp ranks. One activation's bytes cross between the stages per replica, whatever the tp sizes,
instead of ``b`` full copies (inside a node the slices take parallel device pairs, which the
predictor charges as such). Gradients go back the same way: stage ``s``
tp rank ``i`` takes slice ``i`` of ``a`` from stage ``s+1`` tp rank ``i % b``, then all-gathers.
Both tp sizes divide the hidden size, so the slices are equal.

Interleaved 1F1B: a rank runs several model chunks (virtual stage k on physical stage k mod p);
the last physical stage hands chunk c's output to the first physical stage's chunk c + 1. Every
rank executes the order the predictor simulates (:func:`schedule_actions`); receives block,
sends do not, and messages between two ranks arrive in the order sent per tag.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from hetero.errors import HeteroError
from hetero.runtime import pacing
from hetero.runtime.device import waiter
from hetero.runtime.model import backward_loss, loss_value

ACTIVATION_TAG, GRADIENT_TAG = 1, 2
"""Activations and gradients travel on separate tags: with two physical stages interleaved, the
same pair of ranks carries both, and one first-in-first-out queue would hand a gradient to a
receive that expects an activation (same shape) when the two sides' orders interleave differently."""


def schedule_actions(kind: str, stage: int, num_stages: int, micro_batches: int,
                     interleave: int = 1) -> list[tuple[str, int, int]]:
    """The ordered ("F"|"B", micro-batch, chunk) actions of physical stage ``stage`` of
    ``num_stages``: the order the predictor simulates (:func:`hetero.predictor.schedule.device_orders`),
    so what runs is what was predicted. ``chunk`` indexes the rank's model chunks (interleaved:
    virtual stage ``chunk x num_stages + stage``; otherwise always 0)."""
    from hetero.predictor.schedule import device_orders

    if kind not in ("gpipe", "1f1b", "interleaved"):
        raise HeteroError(f"schedule '{kind}' is not supported by the runtime (use 1f1b, gpipe or interleaved)")
    v = interleave if kind == "interleaved" else 1
    order = device_orders(kind, num_stages * v, micro_batches, v)[stage]
    return [(k, mb, vs // num_stages) for k, mb, vs in order]


@dataclass
class Peers:
    """Who this rank exchanges activations and gradients with (for one model chunk). A send goes
    to ``(rank, slice, slices)``: the receiver takes slice ``slice`` of ``slices`` of the flattened
    tensor. A receive takes this rank's slice (its place in ``tp_ranks``) and all-gathers the rest
    from ``tp_ranks``, its stage's tp group in tp order."""

    recv_act_from: int | None = None
    send_act_to: list[tuple[int, int, int]] = field(default_factory=list)
    recv_grad_from: int | None = None
    send_grad_to: list[tuple[int, int, int]] = field(default_factory=list)
    tp_ranks: list[int] = field(default_factory=list)


def stage_peers(layout, me, vstage: int | None = None, num_virtual: int | None = None) -> Peers:
    """Peers of rank ``me`` along its pipeline replica (see the module docstring for the scatter-gather),
    for its virtual stage ``vstage`` of ``num_virtual`` (default: its own stage, no interleaving).
    Virtual stage k runs on physical stage k mod (physical stages)."""
    def stage_ranks(stage):
        return layout.stage_ranks(me.pipeline, me.replica, stage)

    num_stages = 1 + max(r.stage for r in layout.ranks if (r.pipeline, r.replica) == (me.pipeline, me.replica))
    k = me.stage if vstage is None else vstage
    n = num_stages if num_virtual is None else num_virtual
    p = Peers(tp_ranks=stage_ranks(me.stage))
    if k > 0:
        prev = stage_ranks((k - 1) % num_stages)
        p.recv_act_from = prev[me.tp_rank % len(prev)]
        p.send_grad_to = [(r, i, len(prev)) for i, r in enumerate(prev) if i % me.tp_size == me.tp_rank]
    if k < n - 1:
        nxt = stage_ranks((k + 1) % num_stages)
        p.send_act_to = [(r, j, len(nxt)) for j, r in enumerate(nxt) if j % me.tp_size == me.tp_rank]
        p.recv_grad_from = nxt[me.tp_rank % len(nxt)]
    return p


def timed(fn: Callable[[], object], slowdown: float = 1.0,
          wait: Callable[[], None] | None = None,
          comm_wait: Callable[[], float] | None = None) -> tuple[object, float, float]:
    """Run ``fn`` as a device ``slowdown`` times slower would: really compute, then wait
    ``(slowdown - 1) x`` the compute time. Returns (result, start wall time, duration with the wait).
    ``wait``: blocks until the device has run what was queued, called before and after ``fn`` so
    that asynchronous (accelerator) work is timed, not its queuing. ``comm_wait``: seconds this rank
    has waited for communication so far (a forward waiting for ZeRO's parameter all-gather), which
    is not compute and is not slowed. Collectives that other ranks meet inside ``fn`` (an expert-parallel
    exchange) wait for the compute before them as they start (:func:`hetero.runtime.pacing.meeting`);
    the end waits for the rest."""
    if wait:
        wait()
    waited = comm_wait() if comm_wait else 0.0
    wall = time.time()
    t0 = time.perf_counter()
    span = pacing.Span(slowdown, wait)   # collectives met inside (expert parallelism) pace it: pacing.meeting
    previous = pacing.enter(span)
    try:
        out = fn()
    finally:
        pacing.leave(previous)
    if wait:
        wait()
    dt = time.perf_counter() - t0 - span.inside - span.paced
    if comm_wait:
        dt -= comm_wait() - waited
    if slowdown > 1.0:
        time.sleep((slowdown - 1.0) * max(0.0, dt))
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
    """Wall time of the optimizer step: the gradient-norm pass and AdamW with the clip factor
    (emulated slowdown included)."""

    @contextlib.contextmanager
    def span(self, name: str, event: str | None = None):
        """Time the ``with`` block: add its seconds to the field ``name`` (``"sync_s"``) and, given
        ``event``, record it as the trace event ``(event, -1, start wall time, seconds)``."""
        wall, t0 = time.time(), time.perf_counter()
        yield
        dt = time.perf_counter() - t0
        setattr(self, name, getattr(self, name) + dt)
        if event is not None:
            self.events.append((event, -1, wall, dt))


class StageExecutor:
    """Runs one step's schedule on one rank of one stage (its model chunks, when interleaved)."""

    def __init__(self, module, comm, peers: list[Peers], *, first: bool, last: bool,
                 act_shape: tuple[int, ...], slowdown: float = 1.0, autocast_dtype: torch.dtype | None = None,
                 device: torch.device | None = None):
        self.module, self.comm = module, comm
        self.peers = list(peers)  # one per model chunk
        self.first, self.last = first, last  # before chunk 0 / after the last chunk
        self.act_shape = act_shape
        self.slowdown = slowdown
        self.autocast_dtype = autocast_dtype
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.comm_wait: Callable[[], float] | None = None
        """Seconds waited for communication inside the compute so far (see :func:`timed`)."""
        """Where the stage computes: received activations and gradients are placed there."""

    def _compute(self, fn: Callable[[], object]):
        return timed(fn, self.slowdown, waiter(self.device), self.comm_wait)

    def _send(self, tensor: torch.Tensor, targets: list[tuple[int, int, int]], tag: int) -> None:
        """Each target its slice of ``tensor`` (flattened)."""
        tensor = tensor.detach()
        flat = tensor.reshape(-1)
        for dst, part, parts in targets:
            self.comm.send(flat.chunk(parts)[part] if parts > 1 else tensor, dst, tag)

    def _recv(self, src: int, peers: Peers, tag: int) -> torch.Tensor:
        """This rank's slice from ``src``, completed by an all-gather over its tp group."""
        numel = math.prod(self.act_shape)
        tp = max(1, len(peers.tp_ranks))
        if tp == 1:
            return self.comm.recv(torch.empty(self.act_shape, dtype=torch.float32, device=self.device), src, tag)
        mine = self.comm.recv(torch.empty(numel // tp, dtype=torch.float32, device=self.device), src, tag)
        full = torch.empty(numel, dtype=torch.float32, device=self.device)
        slots = full.chunk(tp)
        order = sorted(peers.tp_ranks)   # the gather's order; slot i belongs to tp_ranks[i]
        self.comm.all_gather([slots[peers.tp_ranks.index(r)] for r in order], mine, order)
        return full.view(self.act_shape)

    def _forward(self, x, chunk: int):
        if self.autocast_dtype is not None:
            with torch.autocast(self.device.type, dtype=self.autocast_dtype):
                return self.module(x, chunk)
        return self.module(x, chunk)

    def run(self, actions, *, get_inputs: Callable[[int], torch.Tensor],
            get_targets: Callable[[int], torch.Tensor], loss_fn: Callable, loss_scale: float, timings: Timings,
            before_backward: Callable[[], None] | None = None, reducer=None) -> float:
        """Execute ``actions`` ((kind, micro-batch, chunk) triples); returns the sum of scaled
        micro-batch losses (last stage, else 0). ``before_backward`` runs once, before the first
        backward (gradient buffers are bound there). ``reducer``
        (:class:`~hetero.runtime.overlap.OverlappedReduction`) is told before each chunk's last
        backward and after this rank's last point-to-point operation."""
        saved: dict[tuple[int, int], tuple] = {}
        total = 0.0
        last_chunk = len(self.peers) - 1
        last_backward = {chunk: i for i, (kind, _, chunk) in enumerate(actions) if kind == "B"}
        last_p2p = max((i for i, a in enumerate(actions) if self._p2p(a, last_chunk)), default=-1)
        if reducer is not None:
            reducer.start_step(p2p=last_p2p >= 0)
        for i, (kind, mb, chunk) in enumerate(actions):
            peers = self.peers[chunk]
            first = self.first and chunk == 0
            last = self.last and chunk == last_chunk
            if reducer is not None and i == last_backward.get(chunk):
                reducer.arm(chunk)
            if kind == "F":
                if first:
                    x = get_inputs(mb)
                else:
                    x = self._recv(peers.recv_act_from, peers, ACTIVATION_TAG)
                    x.requires_grad_(True)
                if last:
                    tgt = get_targets(mb)
                    loss, t0, dt = self._compute(lambda: loss_fn(self._forward(x, chunk), tgt) * loss_scale)
                    total += loss_value(loss)
                    saved[(chunk, mb)] = (x, loss)
                else:
                    out, t0, dt = self._compute(lambda: self._forward(x, chunk).float())
                    self._send(out, peers.send_act_to, ACTIVATION_TAG)
                    saved[(chunk, mb)] = (x, out)
                timings.forward_s.append(dt)
                timings.events.append(("F", mb, t0, dt))
            else:
                if before_backward is not None:
                    before_backward()
                    before_backward = None
                x, out = saved.pop((chunk, mb))
                if last:
                    grad = None
                else:
                    grad = self._recv(peers.recv_grad_from, peers, GRADIENT_TAG)
                if reducer is not None and i == last_p2p and first:   # a first stage sends nothing back
                    reducer.p2p_done()
                if last:
                    _, t0, dt = self._compute(lambda: backward_loss(out))
                else:
                    _, t0, dt = self._compute(lambda: out.backward(grad))
                if not first:
                    self._send(x.grad, peers.send_grad_to, GRADIENT_TAG)
                timings.backward_s.append(dt)
                timings.events.append(("B", mb, t0, dt))
            if reducer is not None and i == last_p2p and not (kind == "B" and first):
                reducer.p2p_done()
        self.comm.wait_sends()
        return total

    def _p2p(self, action: tuple[str, int, int], last_chunk: int) -> bool:
        """Whether ``action`` receives or sends an activation or a gradient."""
        _, _, chunk = action
        first, last = self.first and chunk == 0, self.last and chunk == last_chunk
        return not (first and last)
