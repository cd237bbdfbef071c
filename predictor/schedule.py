"""Pipeline-schedule simulation: GPipe, 1F1B and interleaved 1F1B for one pipeline.

Every device runs its kernels in the order the schedule prescribes; an op starts when the device
is free and its input is there: forward of micro-batch j on stage k needs stage k-1's forward of j
plus the p2p transfer; backward needs stage k+1's backward plus the transfer (the last stage's
backward needs its own forward). Sends are asynchronous (they do not hold the sender), but one
link (a device pair, one direction) carries one message at a time, in the order the receiver
takes them: point-to-point messages (NCCL, Gloo) move once both sides have posted them, so the
receiver's order of receives sets the link's. GPipe's burst of forwards over a slow link queues.
(With interleaving over two devices the receiver may take a later-sent message first; a FIFO in
send order would differ by up to 6% on random stage times.) The pipeline time is the end of the
last op. Stage times may differ per stage. A device is done with
the schedule (its gradients are ready to sync) when its last op has ended and its last send of each
edge has arrived: the runtime waits for its pending sends before the gradient sync
(:func:`pipeline_ends`).

Orders:
- ``gpipe``: all forwards, then all backwards;
- ``1f1b``: stage i of p runs min(p - i - 1, m) warm-up forwards, then alternates one forward and
  one backward, then drains the backwards (PipeDream-Flush / Megatron);
- ``interleaved``: Megatron's interleaved 1F1B with v model chunks per device: stages are given
  as the p v virtual stages; virtual stage k runs on device k mod p; micro-batches go in groups
  of p through chunk 0, then chunk 1, ..., a remainder of m mod p joining the last group; device
  i warms up with (p - i - 1) 2 + (v - 1) G chunk-forwards, G the largest group
  (:func:`interleave_group`). Should an order ever deadlock, the pipeline falls back to the GPipe
  order (all forwards first), which always completes (tests check no interleaved order does).

The dependency graph of a schedule does not depend on the durations, so it is put in a
topological order once per (schedule, stages, micro-batches) and every later simulation is one
pass of max/plus arithmetic over that list (a few hundred ns per op); results are memoised on the
stage times. (Extrapolating from short runs is not exact: with uneven stages the steady state can
take tens of micro-batches to settle.)
"""
from __future__ import annotations

import functools


class Deadlock(RuntimeError):
    pass


def interleave_group(p: int, m: int) -> int:
    """Micro-batches in the largest group of the interleaved order (p devices, m micro-batches).

    Micro-batches go through the chunks in groups of p (Megatron's order). A group smaller than p
    stalls device 0: the chunk-(c+1) forward of the group's first micro-batch waits for it to come
    back from the last device, and the group has fewer than p forwards to fill the wait (with
    Megatron's trailing group of m mod p, p = 4, v = 2, m = 6 took longer than m = 7, and longer
    than plain 1F1B). So the remainder joins the last full group, which is then p + m mod p (m
    itself when m < 2p), and the warm-up, (p - i - 1) 2 + (v - 1) G chunk-forwards on device i,
    covers that group: the bubble is then (p - 1) / v of a micro-batch's time for every m >= p,
    at the cost of (v - 1) (m mod p) more chunk activations held in the warm-up.
    """
    return m if m < p else p + m % p


def _orders(schedule: str, p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Per device, the ordered ops (kind 'F'/'B', micro-batch, virtual stage)."""
    if schedule == "interleaved" and v > 1:
        seqs = []
        total = m * v
        fwd_list, bwd_list = [], []
        G = interleave_group(p, m)
        starts = list(range(0, m - G + 1, p)) if m >= p else [0]
        for k, g in enumerate(starts):
            size = (starts[k + 1] if k + 1 < len(starts) else m) - g
            for c in range(v):
                for j in range(size):
                    fwd_list.append((g + j, c))
                    bwd_list.append((g + j, v - 1 - c))
        for i in range(p):
            warm = min((p - i - 1) * 2 + (v - 1) * G, total)
            seq: list[tuple[str, int, int]] = []
            fi = bi = 0
            for _ in range(warm):
                mb, c = fwd_list[fi]; fi += 1
                seq.append(("F", mb, c * p + i))
            while fi < total:
                mb, c = fwd_list[fi]; fi += 1
                seq.append(("F", mb, c * p + i))
                mb, c = bwd_list[bi]; bi += 1
                seq.append(("B", mb, c * p + i))
            while bi < total:
                mb, c = bwd_list[bi]; bi += 1
                seq.append(("B", mb, c * p + i))
            seqs.append(seq)
        return seqs
    gpipe = schedule == "gpipe" or schedule == "interleaved"
    return [[("F", j, i) if j >= 0 else ("B", ~j, i) for j in _one_chunk_ops(m if gpipe else min(p - i - 1, m), m)]
            for i in range(p)]


def simulate(schedule: str, fwd, bwd, p2p, m: int, interleave: int = 1, trace: bool = False, floors=None):
    """Simulate one pipeline replica.

    ``fwd`` / ``bwd``: per (virtual) stage, seconds of one micro-batch; ``p2p``: seconds to send one
    micro-batch's activation (or gradient) from stage k to k+1, len = stages - 1. For
    ``interleaved``, stages are the p v virtual stages. Returns (time, events) where events (only
    with ``trace``) are tuples (device, kind, micro-batch, virtual stage, start, end, ready) with
    ``ready`` the time the input arrived (None for ops without a transfer). ``floors`` (per
    virtual stage, or None): the earliest end of its first forward (micro-batch 0), which waits for
    the stage's parameters (ZeRO's all-gather, run from the start of the step under overlap).
    """
    t, _, events = _run(schedule, tuple(fwd), tuple(bwd), tuple(p2p), m, interleave, trace,
                        tuple(floors) if floors else None)
    return t, events


def executed_order(schedule: str, V: int, interleave: int) -> tuple[str, int]:
    """(order actually simulated and run, chunks per device) for ``V`` virtual stages: interleaving
    needs v > 1 chunks dividing the V stages, else the schedule runs as GPipe with one chunk per
    device."""
    v = interleave if schedule == "interleaved" and interleave > 1 and V % interleave == 0 else 1
    return (schedule if v > 1 or schedule != "interleaved" else "gpipe"), v


def _run(schedule: str, fwd: tuple, bwd: tuple, p2p: tuple, m: int, interleave: int, trace: bool,
         floors: tuple | None = None):
    """(pipeline time, per-device ready times, trace events or None) of one replica."""
    kind, v = executed_order(schedule, len(fwd), interleave)
    if v == 1 and not trace:
        return _evaluate_one_chunk(kind == "gpipe", fwd, bwd, p2p, m, floors)
    prog, ndev, sends, nlinks = _compile(kind, len(fwd), m, v)
    return _evaluate(prog, ndev, sends, nlinks, fwd + bwd, p2p + (0.0,), trace, floors)


def device_orders(schedule: str, stages: int, m: int,
                  interleave: int = 1) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Per device, the ordered ops ``(kind 'F'/'B', micro-batch, virtual stage)`` this module
    simulates for ``stages`` (virtual) stages and ``m`` micro-batches, deadlock fallback included:
    what the runtime executes, so the predicted and the executed schedule are the same."""
    kind, v = executed_order(schedule, stages, interleave)
    return _resolved(kind, stages, m, v)[0]


@functools.lru_cache(maxsize=256)
def _resolved(schedule: str, V: int, m: int, v: int):
    """(per-device orders, one dependency-respecting order of all ops) of the schedule, or of its
    GPipe fallback when the schedule's order would deadlock; tuples, shared by every caller (the
    planner asks for the same orders thousands of times: memory, simulation, trace)."""
    p = V // v
    seqs = _orders(schedule, p, m, v)
    try:
        order = _topo(seqs, V, m)
    except Deadlock:
        seqs = _orders("gpipe", V, m, 1) if v == 1 else _gpipe_virtual(p, m, v)
        order = _topo(seqs, V, m)
    return tuple(tuple(s) for s in seqs), tuple(order)


@functools.lru_cache(maxsize=4096)
def _compile(schedule: str, V: int, m: int, v: int):
    """Ops in a dependency-respecting order (the DAG does not depend on the durations), as tuples
    (slot, device, duration index, dependency slot or -1, comm index, kind, micro-batch, vstage,
    link index or -1); the number of devices; per (device, edge) the slot of the device's last op
    sending over that edge, as (device, slot, comm index): a device's sends on one edge arrive in
    order; and the number of links (sender device, receiver device), each a queue of messages in
    the receiver's order (the module docstring)."""
    p = V // v
    seqs, order = _resolved(schedule, V, m, v)
    nocomm = V - 1  # index of the appended 0.0
    if v == 1:
        return _compile_one_chunk(order, V, m), p, _last_sends(seqs, V, m), 2 * (V - 1)
    prog = []
    dev_of: dict[int, int] = {}
    links: dict[tuple[int, int], int] = {}
    for d, kind, j, vs in order:
        if kind == "F":
            slot, di = vs * m + j, vs
            dep, ci = ((vs - 1) * m + j, vs - 1) if vs else (-1, nocomm)
        else:
            slot, di = (V + vs) * m + j, V + vs
            if vs == V - 1:
                dep, ci = vs * m + j, nocomm
            else:
                dep, ci = (V + vs + 1) * m + j, vs
        dev_of[slot] = d
        li = links.setdefault((dev_of[dep], d), len(links)) if ci != nocomm else -1
        prog.append((slot, d, di, dep, ci, kind, j, vs, li))
    return tuple(prog), p, _last_sends(seqs, V, m), len(links)


def _compile_one_chunk(order, V: int, m: int) -> tuple:
    """:func:`_compile`'s program where device k runs stage k alone (GPipe, 1F1B): every op's
    dependency and link follow from its stage, so no table of devices or links is kept. Links are
    numbered k - 1 for the activations into stage k and V - 1 + k for the gradients into it (the
    general numbering is in order of first use; the simulation only needs them distinct)."""
    last = nocomm = V - 1
    prog = []
    add = prog.append
    for d, kind, j, vs in order:
        if kind == "F":
            if vs:
                add((vs * m + j, d, vs, (vs - 1) * m + j, vs - 1, kind, j, vs, vs - 1))
            else:
                add((j, d, 0, -1, nocomm, kind, j, 0, -1))
        elif vs == last:
            add(((V + vs) * m + j, d, V + vs, vs * m + j, nocomm, kind, j, vs, -1))
        else:
            add(((V + vs) * m + j, d, V + vs, (V + vs + 1) * m + j, vs, kind, j, vs, last + vs))
    return tuple(prog)


def _last_sends(seqs, V: int, m: int) -> tuple:
    """(device, slot, edge) of each device's last op sending over each edge (activation of
    virtual stage vs to vs + 1 on edge vs, gradient to vs - 1 on edge vs - 1), from the end of
    its order."""
    out = []
    for d, seq in enumerate(seqs):
        vss = range(d, V, len(seqs))  # the virtual stages device d runs
        edges = {vs for vs in vss if vs < V - 1} | {vs - 1 for vs in vss if vs > 0}
        for kind, j, vs in reversed(seq):
            if not edges:
                break
            edge = vs if kind == "F" else vs - 1
            if edge in edges:
                edges.discard(edge)
                out.append((d, (vs if kind == "F" else V + vs) * m + j, edge))
    return tuple(out)


def _topo(seqs, V: int, m: int):
    """The ops of every device in one dependency-respecting order: devices in turn, each running
    as far as its inputs allow (raises :class:`Deadlock` when none can go on)."""
    if len(seqs) == V:
        return _topo_one_chunk(seqs, V)
    done = [[False] * m for _ in range(2 * V)]
    ptr = [0] * len(seqs)
    remaining = sum(len(s) for s in seqs)
    order = []
    while remaining:
        progress = False
        for d, seq in enumerate(seqs):
            k = ptr[d]
            while k < len(seq):
                kind, j, vs = seq[k]
                if kind == "F":
                    if vs and not done[vs - 1][j]:
                        break
                    done[vs][j] = True
                else:
                    if not done[vs][j] if vs == V - 1 else not done[V + vs + 1][j]:
                        break
                    done[V + vs][j] = True
                order.append((d, kind, j, vs))
                k += 1
            if k != ptr[d]:
                remaining -= k - ptr[d]
                ptr[d] = k
                progress = True
        if not progress:
            raise Deadlock("schedule order deadlocks")
    return order


def _topo_one_chunk(seqs, V: int):
    """:func:`_topo` (the same order) where device k runs stage k alone. Every device then runs its
    forwards, and its backwards, in micro-batch order, so "micro-batch j's forward is done on stage
    k" is "stage k has run more than j forwards": counters replace the table of finished ops."""
    fdone, bdone, ptr = [0] * V, [0] * V, [0] * V
    last = V - 1
    remaining = sum(len(s) for s in seqs)
    order = []
    add = order.append
    while remaining:
        progress = False
        for d, seq in enumerate(seqs):
            k = start = ptr[d]
            n = len(seq)
            while k < n:
                op = seq[k]
                if op[0] == "F":
                    if d and fdone[d - 1] <= op[1]:
                        break
                    fdone[d] += 1
                else:
                    if (fdone[d] if d == last else bdone[d + 1]) <= op[1]:
                        break
                    bdone[d] += 1
                add((d,) + op)
                k += 1
            if k != start:
                remaining -= k - start
                ptr[d] = k
                progress = True
        if not progress:
            raise Deadlock("schedule order deadlocks")
    return order


def _gpipe_virtual(p: int, m: int, v: int):
    seqs = []
    for i in range(p):
        seq = [("F", j, c * p + i) for c in range(v) for j in range(m)]
        seq += [("B", j, c * p + i) for c in reversed(range(v)) for j in range(m)]
        seqs.append(seq)
    return seqs


def _ready(free, arrive, sends) -> tuple:
    """Per device: when it is done with the schedule (last op ended, last sends arrived)."""
    ready = list(free)
    for d, slot, _ in sends:
        r = arrive[slot]   # every send has its receive in the program, which set its arrival
        if r > ready[d]:
            ready[d] = r
    return tuple(ready)


def _evaluate(prog, ndev: int, sends, nlinks: int, durs, comm, trace: bool, floors: tuple | None = None):
    """(pipeline time, per-device ready times, trace events or None). A message leaves when its
    producer ends and its link is free (``link``: when each link's last message arrives).
    ``floors``: per virtual stage, the earliest end of its forward of micro-batch 0."""
    end = [0.0] * (len(durs) * (len(prog) // len(durs) + 1))
    free = [0.0] * ndev
    link = [0.0] * nlinks
    arrive: dict[int, float] = {}   # producer slot -> when its message arrived
    events = [] if trace else None
    for slot, d, di, dep, ci, kind, j, vs, li in prog:
        t = free[d]
        ready = None
        if dep >= 0:
            r = end[dep]
            if li >= 0:
                if link[li] > r:
                    r = link[li]
                r += comm[ci]
                link[li] = arrive[dep] = r
                if comm[ci] > 0:
                    ready = r
            if r > t:
                t = r
        start = t
        t += durs[di]
        if floors is not None and j == 0 and kind == "F" and floors[vs] > t:
            t = floors[vs]
        end[slot] = t
        free[d] = t
        if trace:
            events.append((d, kind, j, vs, start, t, ready))
    return max(free), _ready(free, arrive, sends), events


@functools.lru_cache(maxsize=4096)
def _one_chunk_ops(warm: int, m: int) -> tuple:
    """A device's ops with ``warm`` warm-up forwards (m: GPipe), then forward / backward pairs,
    then the remaining backwards, as ints: j for micro-batch j's forward, ~j for its backward: the
    one order of every one-chunk schedule, which :func:`_orders` spells out for the program and
    :func:`_evaluate_one_chunk` runs as is. It depends on (warm, m) alone, so pipelines of any depth
    share it."""
    ops = list(range(warm))
    for k in range(m - warm):
        ops += (warm + k, ~k)
    ops += [~j for j in range(m - warm, m)]
    return tuple(ops)


def _evaluate_one_chunk(gpipe: bool, fwd: tuple, bwd: tuple, p2p: tuple, m: int, floors: tuple | None):
    """:func:`_evaluate` of a GPipe or 1F1B order with one stage per device, without a program:
    the devices take turns (down the pipeline, then up: forwards flow down, gradients up) running
    their ops as far as their inputs allow. Every op's time is the same max/plus arithmetic in the
    same operand order as :func:`_evaluate`'s, and any order that respects the dependencies gives
    the same floats (a link's queue is in its receiver's order either way), so the results are
    :func:`_evaluate`'s; the topological sort and the compiled program are never built (the
    planner's predictions mostly see a (stages, micro-batches) pair once, so building them cost
    more than running them).
    """
    V = len(fwd)
    last = V - 1
    # per device: ends of its forwards / backwards so far (micro-batch order), when the newest
    # activation / gradient into it arrived (its links' queues), and where its order stands
    fend = [[] for _ in range(V)]
    bend = [[] for _ in range(V)]
    f_link = [0.0] * V
    b_link = [0.0] * V
    free = [0.0] * V
    seqs = [_one_chunk_ops(m if gpipe else min(V - d - 1, m), m) for d in range(V)]
    ptr = [0] * V
    n_ops = 2 * m
    remaining = V * n_ops
    sweeps = (tuple(range(V)), tuple(range(last, -1, -1)))
    turn = stalled = 0
    while remaining:
        progress = False
        for d in sweeps[turn]:
            k = start = ptr[d]
            if k == n_ops:
                continue
            seq = seqs[d]
            fe, be = fend[d], bend[d]
            t = free[d]
            f_in = fend[d - 1] if d else None
            b_in = fe if d == last else bend[d + 1]
            fdur, bdur = fwd[d], bwd[d]
            fcomm = p2p[d - 1] if d else 0.0
            bcomm = p2p[d] if d != last else 0.0
            floor = floors[d] if floors is not None else None
            # the forward and backward arms repeat each other's max/plus steps inline: a call per
            # op would cost as much as the op (this loop runs millions of times in one search)
            while k < n_ops:
                j = seq[k]
                if j >= 0:
                    if d:
                        if len(f_in) <= j:   # not yet run upstream
                            break
                        r = f_in[j]
                        if f_link[d] > r:
                            r = f_link[d]
                        r += fcomm
                        f_link[d] = r
                        if r > t:
                            t = r
                    t += fdur
                    if j == 0 and floor is not None and floor > t:
                        t = floor
                    fe.append(t)
                else:
                    j = ~j
                    if len(b_in) <= j:   # not yet run downstream
                        break
                    r = b_in[j]
                    if d != last:
                        if b_link[d] > r:
                            r = b_link[d]
                        r += bcomm
                        b_link[d] = r
                    if r > t:
                        t = r
                    t += bdur
                    be.append(t)
                k += 1
            if k != start:
                free[d] = t
                remaining -= k - start
                ptr[d] = k
                progress = True
        stalled = 0 if progress else stalled + 1
        if stalled == 2:   # neither direction moved
            raise Deadlock("schedule order deadlocks")
        turn ^= 1
    # a device is done when its last op ended and its last activation / gradient sent has arrived
    # (a link's newest arrival is its last message's: each device sends in micro-batch order)
    ready = list(free)
    for d in range(V):
        if d < last and f_link[d + 1] > ready[d]:
            ready[d] = f_link[d + 1]
        if d and b_link[d - 1] > ready[d]:
            ready[d] = b_link[d - 1]
    return max(free), tuple(ready), None


@functools.lru_cache(maxsize=1 << 16)
def _ends(schedule: str, fwd: tuple, bwd: tuple, p2p: tuple, m: int, interleave: int,
          floors: tuple | None = None) -> tuple[float, tuple]:
    return _run(schedule, fwd, bwd, p2p, m, interleave, False, floors)[:2]


def pipeline_ends(schedule: str, fwd, bwd, p2p, m: int, interleave: int = 1, floors=None) -> tuple[float, tuple]:
    """(time of one replica's micro-batches through the pipeline, per physical device the time it
    is done with the schedule: its last op ended and its last sends arrived), memoised on the
    stage times. Device i runs (virtual) stages i, i + p, ... (p devices). ``floors``: see
    :func:`simulate`."""
    return _ends(schedule, tuple(fwd), tuple(bwd), tuple(p2p), m, interleave, tuple(floors) if floors else None)


def pipeline_time(schedule: str, fwd, bwd, p2p, m: int, interleave: int = 1) -> float:
    """Time of one replica's micro-batches through the pipeline (memoised on the stage times)."""
    return _ends(schedule, tuple(fwd), tuple(bwd), tuple(p2p), m, interleave)[0]


__all__ = ["simulate", "pipeline_time", "pipeline_ends", "device_orders", "executed_order", "interleave_group",
           "Deadlock"]
