"""The live exchange of a transition and the stage rebuilt around what arrived.

:func:`live_state` reads what a rank holds now (its stage's parameters and AdamW state, tp shards as
their local parts) as regions of the virtual parameter space. :func:`exchange` runs one rank's part
of a :class:`~hetero.runtime.reshard.transition.Transition` over ``torch.distributed``
point-to-point (Gloo here): local pieces are copied in memory; every other piece is cut into
messages of at most ``chunk_bytes``, each sent as one transfer per state kind (master values, both
moments) plus the step counter, straight out of the old state tensor and into the new one where the
slice is contiguous (a strided tp slice is staged).

Order and memory. Every rank lists the messages of the whole transition in one global order
(round-robin over the links, so early messages spread over them). Each rank walks that list,
posting a non-blocking send or receive for each message it takes part in, and waits for its oldest
outstanding one whenever the bytes in flight would pass ``max_bytes``. That cannot deadlock: a rank
waits on its oldest message m; if m's peer has not posted it yet, the peer waits on an older message
of its own, and following such waits walks down the global order, which ends at a message both ends
have posted. The bytes a rank stages at once stay under ``max_bytes`` (plus the state it builds).

:func:`rebuild_stage` then builds the rank's stage for its new layers and tp degree on the meta
device (no initialisation), shards it there, and adopts the exchanged tensors as its parameters
and a fresh AdamW's moments. :func:`load_regions` is the fallback: a rank's regions read from a
plan-independent checkpoint.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetero.runtime.reshard.space import (BYTES_PER_ELEMENT, STATE_KINDS, Box, box_numel, contiguous_within, intersect,
                                          relative)
from hetero.runtime.reshard.transition import Piece, Transition

DEFAULT_MAX_BYTES = 256 << 20
"""Bytes a rank stages for the exchange at once (send and receive buffers in flight)."""

NO_STEP = -1.0


@dataclass
class TensorState:
    """One tensor's region on one rank: the master values and both moments (local tensors of the
    region's shape) and the AdamW step counter."""

    box: Box
    tensors: dict[str, torch.Tensor]
    step: torch.Tensor | None


def live_state(module, optimizer, regions: dict[str, Box]) -> dict[str, TensorState]:
    """What this rank holds now, by tensor name (``regions``: its boxes in the plan it runs)."""
    from hetero.runtime.grads import local_part

    out = {}
    for name, p in module.named_parameters():
        box = regions[name]
        local = local_part(p.detach())
        shape = tuple(b - a for a, b in box)
        if tuple(local.shape) != shape:   # the space's idea of a tp slice must be torch's
            raise RuntimeError(f"{name}: this rank holds {tuple(local.shape)}, the parameter space says {shape}")
        st = optimizer.state.get(p, {})
        tensors = {"param": local}
        for k in STATE_KINDS[1:]:
            tensors[k] = local_part(st[k]) if k in st else torch.zeros_like(local)
        step = st.get("step")
        out[name] = TensorState(box, tensors, None if step is None else torch.as_tensor(step).detach().cpu())
    return out


def sharded_live_state(module, sharded, regions: dict[str, Box]) -> dict[str, TensorState]:
    """:func:`live_state` of a ZeRO rank (``sharded``: its :class:`~hetero.runtime.zero.ShardedAdamW`):
    its stage's whole regions, as a ``zero_stage: 0`` rank holds them, with the moments (and a bf16
    model's exact fp32 masters) gathered from the slices by :meth:`~hetero.runtime.zero.ShardedAdamW.full_state`.
    A collective over the rank's holder sets: every rank of the world calls it while all are alive
    (a pause), never after a failure."""
    from hetero.runtime.grads import local_part

    full = sharded.full_state(keep=lambda name: name in regions)   # waits for deferred gathers first
    out = {}
    for name, p in module.named_parameters():
        box = regions[name]
        idx = tuple(slice(a, b) for a, b in box)   # full_state's tensors are whole: the region is a box of them
        st = full.pop(name, None)   # its whole tensors freed as its region is cut out
        tensors = {"param": st["param"][idx].contiguous() if st is not None and "param" in st
                   else local_part(p.detach())}
        if tuple(tensors["param"].shape) != tuple(b - a for a, b in box):
            raise RuntimeError(f"{name}: this rank holds {tuple(tensors['param'].shape)}, the parameter space "
                               f"says {tuple(b - a for a, b in box)}")
        for k in STATE_KINDS[1:]:
            tensors[k] = st[k][idx].contiguous() if st is not None else torch.zeros_like(tensors["param"])
        out[name] = TensorState(box, tensors, None if st is None else st["step"].reshape(()).detach().cpu())
    return out


def full_states(module, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """A plain AdamW's state (:func:`rebuild_stage`'s) as the full per-parameter states
    :meth:`~hetero.runtime.zero.ShardedAdamW.load_full_state` takes (a tp shard's moments gathered
    inside its tp group: the tp ranks of a stage call it together)."""
    out = {}
    for name, p in module.named_parameters():
        st = optimizer.state.get(p)
        if not st:
            continue
        whole = {k: st[k].full_tensor() if hasattr(st[k], "full_tensor") else st[k] for k in STATE_KINDS[1:]}
        out[name] = {**whole, "step": torch.as_tensor(st["step"])}
    return out


@dataclass
class ExchangeStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    messages: int = 0
    peak_in_flight: int = 0


def messages(transition: Transition, chunk_bytes: int) -> list[Piece]:
    """Every moved piece cut into messages of at most ``chunk_bytes`` (at least one row each), in the
    global order every rank walks: round-robin over the links."""
    by_link: dict[tuple[int, int], list[Piece]] = {}
    for p in transition.moved:
        by_link.setdefault((p.src, p.dst), []).extend(_cut(p, chunk_bytes))
    order = []
    for link in sorted(by_link):
        order += [(i, link, m) for i, m in enumerate(by_link[link])]
    return [m for _, _, m in sorted(order, key=lambda x: (x[0], x[1]))]


def _cut(p: Piece, chunk_bytes: int) -> list[Piece]:
    if p.nbytes <= chunk_bytes or not p.box:
        return [p]
    lo, hi = p.box[0]
    row = max(1, p.nbytes // max(1, hi - lo))
    step = max(1, chunk_bytes // row)
    return [Piece(p.src, p.dst, p.name, ((a, min(a + step, hi)),) + p.box[1:], with_step=a == lo)
            for a in range(lo, hi, step)]


def exchange(rank: int, transition: Transition, live: dict[str, TensorState], targets: dict[str, Box],
             *, group=None, max_bytes: int = DEFAULT_MAX_BYTES, chunk_bytes: int | None = None,
             device: torch.device | str = "cpu", describe=lambda r: f"rank {r}", same_host=None,
             prepared: dict[str, TensorState] | None = None) -> tuple[dict[str, TensorState], ExchangeStats]:
    """This rank's part of ``transition`` (every rank of ``group`` calls it with the same transition):
    returns its new state, by tensor name, for its ``targets`` regions, and what it moved. A peer
    lost during the exchange ends it with :class:`~hetero.runtime.reshard.ReconfigurationError`
    naming that peer (``describe``: rank -> words), after at most the group's timeout.

    ``same_host``: ``(store, key prefix, {rank: process id}, timeout_s)`` when every rank is a process
    on this machine holding its state in host memory (all ranks decide alike): the receivers read
    their pieces out of the senders' memory (:mod:`hetero.runtime.reshard.cma`) instead of
    point-to-point messages.

    ``prepared``: state tensors allocated ahead, by tensor name (a joining process allocates and
    touches its regions while the others train, so the exchange writes into memory already mapped);
    one whose box is not the target's is not used."""
    chunk_bytes = chunk_bytes or max(1 << 20, max_bytes // 4)
    if chunk_bytes > max_bytes:
        raise ValueError(f"chunk_bytes {chunk_bytes} exceeds max_bytes {max_bytes}")
    stats = ExchangeStats()
    kept = _kept(rank, transition, live, targets, device)
    prepared = prepared or {}

    def fresh(name: str, box: Box) -> TensorState:
        if name in prepared and prepared[name].box == box:
            return TensorState(box, dict(prepared[name].tensors), None)
        return _blank(box, device, torch.empty)

    def keep(name: str, box: Box) -> TensorState:   # the old tensors themselves, or a view of them
        old = live[name]
        idx = relative(box, old.box)
        tensors = dict(old.tensors) if box == old.box else {k: t[idx] for k, t in old.tensors.items()}
        return TensorState(box, tensors, None if old.step is None else old.step.clone())
    new = {name: keep(name, box) if name in kept else fresh(name, box) for name, box in targets.items()}
    for p in transition.pieces:   # what this rank keeps: its own tensors, or a copy where the box changed
        if p.src == rank and p.dst == rank:
            stats.bytes_local += p.nbytes
            if p.name not in kept:
                src = live[p.name]
                _put(new[p.name], p.box, lambda k, s=src, b=p.box: s.tensors[k][relative(b, s.box)], src.step)
    def lost(other, e):
        from hetero.runtime.reshard import ReconfigurationError

        return ReconfigurationError(f"reshard: {describe(other)} was lost during the exchange "
                                    f"({str(e).splitlines()[0][:200]})")

    if same_host is not None:
        _exchange_same_host(rank, transition, live, new, stats, same_host, lost)
        return new, stats
    in_flight: collections.deque = collections.deque()
    held = 0

    def post(op, tensor, other, tag):
        try:   # a send to a peer already gone can fail as it is posted, not only at its wait
            return op(tensor, peer(other), group=group, tag=tag)
        except Exception as e:  # noqa: BLE001 - re-raised naming the peer
            raise lost(other, e) from None

    def finish_oldest():
        nonlocal held
        work, nbytes, done, other = in_flight.popleft()
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - re-raised naming the peer
            raise lost(other, e) from None
        if done:
            done()
        held -= nbytes

    peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    for index, m in enumerate(messages(transition, chunk_bytes)):
        if rank not in (m.src, m.dst):
            continue
        while in_flight and held + m.nbytes > max_bytes:
            finish_oldest()
        # one transfer per state kind (and the step): a contiguous slice goes out of, or lands in,
        # the state tensor itself; only a strided one (a tp slice along dim 1) is staged
        if m.src == rank:
            src = live[m.name]
            for k, part in enumerate(_parts(src, m.box, m.with_step)):
                work = post(dist.isend, part.contiguous(), m.dst, index * _TAGS + k)
                in_flight.append((work, 0, None, m.dst))
            stats.bytes_sent += m.nbytes
        else:
            dst = new[m.name]
            idx = relative(m.box, dst.box)
            for k, kind in enumerate(STATE_KINDS):
                view = dst.tensors[kind][idx]
                buf = view if view.is_contiguous() else torch.empty(view.shape)
                work = post(dist.irecv, buf, m.src, index * _TAGS + k)
                in_flight.append((work, 0, None if buf is view else (lambda v=view, b=buf: v.copy_(b)), m.src))
            if m.with_step:
                step = torch.empty(())
                work = post(dist.irecv, step, m.src, index * _TAGS + len(STATE_KINDS))
                in_flight.append((work, 0, lambda t=dst, s=step: _set_step(t, s), m.src))
            stats.bytes_received += m.nbytes
        # counted once per message, released with its last transfer
        in_flight[-1] = in_flight[-1][:1] + (m.nbytes,) + in_flight[-1][2:]
        stats.messages += 1
        held += m.nbytes
        stats.peak_in_flight = max(stats.peak_in_flight, held)
    while in_flight:
        finish_oldest()
    return new, stats


def prepare_regions(regions: dict[str, Box], device: torch.device | str = "cpu") -> dict[str, TensorState]:
    """State tensors for ``regions``, allocated and written once (zeros), so their pages are mapped
    before an exchange writes into them (:func:`exchange`'s ``prepared``)."""
    return {name: _blank(box, device, torch.zeros) for name, box in regions.items()}


def _blank(box: Box, device, make) -> TensorState:
    """A region's state tensors (master values, both moments) made by ``make`` (torch.empty or
    torch.zeros), with no step yet."""
    return TensorState(box, {k: make(tuple(b - a for a, b in box), dtype=torch.float32, device=device)
                             for k in STATE_KINDS}, None)


def _kept(rank: int, transition: Transition, live: dict[str, TensorState], targets: dict[str, Box],
          device) -> set[str]:
    """The tensors whose new region this rank keeps from what it holds, neither allocated again nor
    copied: the old state tensors themselves where the box is the same, and in host memory a
    contiguous view of them where the new box is a contiguous part of the old one (a tp slice along
    dim 0); :func:`~hetero.runtime.host_memory.release_unused_pages` gives the rest of such a
    tensor back once the old stage is dropped. The old stage and optimizer that held them are
    dropped after the exchange; a peer may still read them meanwhile, which is why nothing writes
    into them."""
    device = torch.device(device)
    usable = {name: st.box for name, st in live.items()
              if all(t.is_contiguous() and t.device == device for t in st.tensors.values())}
    return kept_names(rank, transition, usable, targets, views=device.type == "cpu")


def kept_names(rank: int, transition: Transition, held: dict[str, Box], targets: dict[str, Box],
               views: bool = True) -> set[str]:
    """The names whose ``targets`` box ``rank`` keeps, all of it, from itself, out of the box it
    holds (``held``: name -> box of a contiguous tensor): the same box, or with ``views`` a contiguous
    part of it (:func:`~hetero.runtime.reshard.space.contiguous_within`). :func:`exchange` takes
    them over without a copy."""
    def keepable(name: str, box: Box) -> bool:
        old = held.get(name)
        if old is None:
            return False
        if old == box:
            return True
        return views and intersect(box, old) == box and contiguous_within(box, old)
    kept = {name for name, box in targets.items() if keepable(name, box)}
    for p in transition.pieces:
        if p.dst == rank and p.name in kept and not (p.src == rank and p.box == targets[p.name]):
            kept.discard(p.name)
    return kept


def reserve_bytes(space, held: dict[int, dict[str, Box]], losses) -> dict[int, int]:
    """Old rank -> the most state its exchange allocates over ``losses`` (each: ``(members``, old rank
    -> rank in the new plan, ``transition, new plan, new layout)``, a loss with an exchange);
    ``held``: old rank -> its regions. What the launcher tells each rank to reserve."""
    need: dict[int, int] = {}
    for members, transition, plan, layout in losses:
        for old, new in members.items():   # a member's rank in the exchange is its new rank
            targets = space.rank_regions(plan, layout.ranks[new])
            need[old] = max(need.get(old, 0), fresh_bytes(new, transition, held[old], targets))
    return need


def fresh_bytes(rank: int, transition: Transition, held: dict[str, Box], targets: dict[str, Box]) -> int:
    """Bytes of state tensors :func:`exchange` allocates on ``rank`` in host memory (``held``: its old
    boxes, ``targets``: its new ones): every target region but those it keeps (:func:`kept_names`)."""
    kept = kept_names(rank, transition, held, targets)
    return sum(box_numel(box) for name, box in targets.items() if name not in kept) * BYTES_PER_ELEMENT


_TAGS = len(STATE_KINDS) + 1
"""Tags per message: one per state kind and one for the step."""


def _exchange_same_host(rank: int, transition: Transition, live: dict[str, TensorState],
                        new: dict[str, TensorState], stats: ExchangeStats, same_host, lost) -> None:
    """:func:`exchange`'s moved pieces read straight out of the senders' memory: each piece whole
    (nothing is staged, so no chunks), the step counter with it."""
    from hetero.runtime.reshard import cma

    store, prefix, pids, timeout_s = same_host
    ex = cma.Exchange(store, prefix, rank, pids, timeout_s)
    moved = transition.moved
    sent = {}
    for i, p in enumerate(moved):
        if p.src == rank:
            src = live[p.name]
            step = float(src.step) if (p.with_step and src.step is not None) else None
            sent[i] = (_parts(src, p.box, with_step=False), step)
            stats.bytes_sent += p.nbytes
    ex.publish(sent)
    wanted = []
    for i, p in enumerate(moved):
        if p.dst == rank:
            dst = new[p.name]
            idx = relative(p.box, dst.box)
            wanted.append((i, p.src, [dst.tensors[k][idx] for k in STATE_KINDS]))
            stats.bytes_received += p.nbytes
    stats.messages = len(sent) + len(wanted)
    try:
        steps = ex.receive(wanted)
        ex.serve({p.dst for p in moved if p.src == rank})
    except cma.PeerGone as e:
        raise lost(e.rank, e) from None
    for i, step in steps.items():
        if step is not None:
            _set_step(new[moved[i].name], torch.tensor(step, dtype=torch.float32))


def _parts(state: TensorState, box: Box, with_step: bool) -> list[torch.Tensor]:
    idx = relative(box, state.box)
    parts = [state.tensors[k][idx] for k in STATE_KINDS]
    if with_step:   # NO_STEP: no update applied yet (AdamW has no state)
        parts.append(state.step.reshape(()).to(torch.float32) if state.step is not None
                     else torch.tensor(NO_STEP))
    return parts


def _set_step(target: TensorState, step: torch.Tensor) -> None:
    if target.step is None and float(step) != NO_STEP:
        target.step = step


def _put(target: TensorState, box: Box, values, step: torch.Tensor | None) -> None:
    idx = relative(box, target.box)
    for k in STATE_KINDS:
        target.tensors[k][idx].copy_(values(k))
    if target.step is None and step is not None:
        target.step = step.clone()


def rebuild_stage(model, plan, info, state: dict[str, TensorState], *, mesh=None, device="cpu",
                  lr: float = 1e-3, weight_decay: float = 0.0):
    """The stage ``info`` (a rank of ``plan``) runs, with its parameters and a fresh AdamW's state
    taken from ``state`` (this rank's regions after :func:`exchange`); ``mesh``: its tp mesh (tp > 1).
    The exchanged tensors become the parameters' and moments' storage (no copy, no initialisation):
    the stage is built on the meta device, sharded there, and its parameters replaced.
    Returns (module, optimizer)."""
    from torch import nn
    from torch.distributed.tensor import DTensor

    from hetero.runtime.expert_parallel import keep_experts, rank_experts
    from hetero.runtime.grads import make_optimizer
    from hetero.runtime.model import StageModel, apply_tensor_parallel, rope_tables, skip_init

    first, last = info.holds_ends(plan)
    chunks = info.chunk_layers(plan)
    with torch.device("meta"), skip_init():   # every value is replaced below
        module = StageModel(model, chunks[0], first, last, chunks)
    keep_experts(module, rank_experts(model, plan, info))   # expert parallelism: its own routed experts
    module.set_recompute(plan.recompute)
    if info.tp_size > 1:
        apply_tensor_parallel(module, mesh, src_data_rank=None)   # placements only: nothing to move on meta

    def like(p, t):
        t = t.to(device)
        if isinstance(p, DTensor):
            return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        return t

    params = {}
    for name, p in list(module.named_parameters()):
        owner, leaf = name.rsplit(".", 1)
        new = nn.Parameter(like(p, state[name].tensors["param"]))
        setattr(module.get_submodule(owner), leaf, new)
        params[name] = new
    tables = None
    for name, buf in list(module.named_buffers()):   # rope tables: computed, not exchanged
        owner, leaf = name.rsplit(".", 1)
        if leaf not in ("cos", "sin"):
            raise RuntimeError(f"{name}: a buffer the reshard does not know how to rebuild")
        tables = tables or rope_tables(model.seq_length, model.head_dim, model.rope_theta)
        module.get_submodule(owner).register_buffer(leaf, tables[leaf == "sin"].to(device), persistent=False)
    optimizer = make_optimizer(module.parameters(), lr, weight_decay)
    for name, p in params.items():
        st = state[name]
        if st.step is None:   # no update applied yet: AdamW creates its state at the first step
            continue
        optimizer.state[p] = {"step": st.step.to(torch.float32).to(p.device, copy=True),
                              "exp_avg": like(p, st.tensors["exp_avg"]), "exp_avg_sq": like(p, st.tensors["exp_avg_sq"])}
    return module, optimizer


def load_regions(path: str, regions: dict[str, Box], shapes: dict[str, tuple]) -> tuple[dict[str, TensorState], int]:
    """This rank's ``regions`` read from the plan-independent checkpoint at ``path`` (a collective
    over the default group: every rank calls it, one that needs nothing with ``{}``), as
    :func:`exchange` returns them; and the checkpoint's step. The fallback when no live rank holds
    a region: the whole state then comes from the checkpoint, so it is one step's."""
    import torch.distributed.checkpoint as dcp

    from hetero.runtime.checkpoint import SafeReader

    want: dict[str, torch.Tensor] = {"meta/step": torch.tensor(0, dtype=torch.int64)}
    for name in regions:
        want[f"model/{name}"] = torch.empty(shapes[name])
        for k in STATE_KINDS[1:]:
            want[f"optim/{name}/{k}"] = torch.empty(shapes[name])
        want[f"optim/{name}/step"] = torch.tensor(0.0)
    dcp.load(want, storage_reader=SafeReader(path))
    out = {}
    for name, box in regions.items():
        idx = tuple(slice(a, b) for a, b in box)
        tensors = {"param": want[f"model/{name}"][idx].clone()}
        tensors.update({k: want[f"optim/{name}/{k}"][idx].clone() for k in STATE_KINDS[1:]})
        out[name] = TensorState(box, tensors, want[f"optim/{name}/step"])
    return out, int(want["meta/step"])
