"""Where a plan's ranks live: the node of every (pipeline, replica, physical stage) tp block.

Which traffic crosses a node's NIC, and how many streams share it, depends on the rank order:

- ``packed`` (default): the hetero runtime's layout (:func:`hetero.layout.build_layout`): a group's
  tp blocks in plan order -- pipeline, replica, stage -- packed first-fit decreasing into nodes.
  A replica's stages are adjacent, so several stages of one replica often share a node (their
  p2p stays on NVLink, but every stage's data-parallel ring leaves through the same NIC).
- ``megatron``: Megatron-LM / Megatron-DeepSpeed's order, tp fastest, then dp, then pp
  (``rank = pp_rank * tp * dp + dp_rank * tp + tp_rank``): the replicas of one stage are
  adjacent. With ``tp * dp >= devices_per_node`` a node holds (part of) one stage, so every p2p of
  a pipeline crosses the network, and ``devices_per_node / tp`` replicas send at once through
  one NIC; each DP ring has ``devices_per_node / tp`` members per node.

:func:`block_nodes` gives (group, node) per block; :func:`p2p_links` the p2p summary per pipeline
edge. Both are pure functions of the plan's structure (the caller memoises them).
"""
from __future__ import annotations

import functools
import math

from hetero.syncorder import BUCKET_CAP_BYTES, in_sync_order

from .memory import gathers_in_bf16

PLACEMENTS = ("packed", "megatron")


def block_nodes(groups: dict, plan, placement: str = "packed") -> dict[tuple[int, int, int], tuple[str, int]]:
    """(pipeline, replica, physical stage) -> (group, node index inside the group)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r} (known: {', '.join(PLACEMENTS)})")
    blocks: dict[str, list[tuple[tuple[int, int, int], int]]] = {}
    for pi, p in enumerate(plan.pipelines):
        phys = plan.physical_stages(p)
        if placement == "packed":
            order = [(r, k) for r in range(p.replicas) for k in range(len(phys))]
        else:
            order = [(r, k) for k in range(len(phys)) for r in range(p.replicas)]
        for r, k in order:
            blocks.setdefault(phys[k].group, []).append(((pi, r, k), phys[k].tp))
    out: dict[tuple[int, int, int], tuple[str, int]] = {}
    for name, bl in blocks.items():
        g = groups[name]
        sizes = [tp for _, tp in bl]
        where = _pack(sizes, g.nodes, g.devices_per_node)
        for (key, _), n in zip(bl, where):
            out[key] = (name, n)
    return out


def _pack(sizes: list[int], nodes: int, per_node: int) -> list[int]:
    """Node of each block: first-fit decreasing (the runtime's rule, :func:`hetero.specs.plan.pack_blocks`);
    equal blocks that tile a node are filled in order (the same result, in linear time). A plan too
    big for the group (predicted unchecked) wraps onto the last node."""
    s0 = sizes[0] if sizes else 1
    if all(s == s0 for s in sizes) and per_node % s0 == 0:
        per = per_node // s0
        return [min(i // per, nodes - 1) for i in range(len(sizes))]
    from hetero.specs.plan import pack_blocks

    where = pack_blocks(sizes, nodes, per_node)
    if where is None:
        where, used, n = [], 0, 0
        for s in sizes:
            if used + s > per_node and n < nodes - 1:
                n, used = n + 1, 0
            where.append(n)
            used += s
    return where


def p2p_links(plan, where: dict) -> dict[tuple[int, int], tuple[bool, int]]:
    """Per (pipeline, virtual stage k) with a successor: (same_node, streams). ``same_node``: every
    replica's k -> k+1 transfer stays inside one node (of one group); ``streams``: the most
    replicas whose transfer of that edge leaves (or enters) one node at once -- they share its NIC."""
    out = {}
    for pi, p in enumerate(plan.pipelines):
        V = len(p.stages)
        phys = max(1, len(plan.physical_stages(p)))
        for k in range(V - 1):
            a, b = k % phys, (k + 1) % phys
            send: dict = {}
            recv: dict = {}
            cross = 0
            for r in range(p.replicas):
                na, nb = where[(pi, r, a)], where[(pi, r, b)]
                if na != nb:
                    cross += 1
                    send[na] = send.get(na, 0) + 1
                    recv[nb] = recv.get(nb, 0) + 1
            streams = max(max(send.values(), default=1), max(recv.values(), default=1))
            out[(pi, k)] = (cross == 0, streams)
    return out


__all__ = ["PLACEMENTS", "block_nodes", "p2p_links"]


def dp_sync(cm, plan, placement: str = "packed", where: dict | None = None) -> tuple[dict, "SyncPlan"]:
    """(per (pipeline, physical stage) the seconds its devices spend on the data-parallel gradient
    sync, with the placement's NIC sharing (see
    :meth:`hetero.predictor.costs.StageCostModel.dp_sync_times`); the sync's buckets in the order
    every rank runs them, :class:`SyncPlan`).

    Every layer (embedding, head) is summed over all its holders. Inside a group, the holders of a
    layer form one ring per tp rank: on NVLink when they all sit in one node, else over the network,
    where a node's NIC carries one ring per tp rank of the holders it hosts (``rings x 2 (n-1)/n x
    bytes / tp``). Stages sync at about the same time (after their schedules), so rings of
    different stages that leave the same node are taken to share its NIC: a device's sync lasts at
    least the NIC time of the busiest node its rings cross. Holders in several groups: in-group
    reduction, then the group leaders over ``network.cross_group`` (host-staged across vendors);
    under ZeRO the leaders also all-gather the updated parameters (hetero.comm's cross-group
    reduce-scatter is a hierarchical all-reduce, so ZeRO saves nothing of it there).
    Tied embeddings (gpt): the last stage holds a copy of the word embedding, summed together with
    the first stages' (Megatron's embedding all-reduce between the first and last stage); the
    learned positions are the first stages' alone.
    ``where``: :func:`block_nodes` of the plan, when the caller has it already.
    """
    from . import comm

    groups, fac, net = cm._groups, cm._factors, cm.cluster.network
    if where is None:
        where = block_nodes(groups, plan, placement)
    zs = plan.zero_stage
    # stage (pi, physical k) -> {(group, node): tp ranks there}
    stage_nodes: dict[tuple[int, int], dict] = {}
    for (pi, r, k), gn in where.items():
        d = stage_nodes.setdefault((pi, k), {})
        d[gn] = plan.physical_stages(plan.pipelines[pi])[k].tp
    node_load: dict[tuple[str, int], float] = {}
    node_later: dict[tuple[str, int], float] = {}   # of node_load: parameter all-gathers that can run later
    own: dict[tuple[int, int], float] = {}
    own_later: dict[tuple[int, int], float] = {}     # of own: the same
    later: dict[frozenset, float] = {}   # holder stages -> seconds of their parameter all-gather (ZeRO, not
    # across vendors) that the runtime runs under the next step's forward (hetero.runtime.zero.ShardedAdamW)
    crossed: dict[tuple[int, int], set] = {}
    held: dict[frozenset, float] = {}   # holder stages -> seconds of their all-reduces
    tail: dict[frozenset, float] = {}   # holder stages -> of those, seconds the backward cannot hide
    bridged: dict[frozenset, bool] = {}   # holder stages -> their sum crosses vendors (host bridge)

    def ring(holders, nbytes):
        """holders: list of (pi, k, group, tp, replicas); nbytes: ({size of the split dim: bytes of
        the tensors tp splits along it}, bytes every tp rank holds whole); adds the sync time to
        each holder. As hetero.runtime.grads and hetero.runtime.zero sum:

        - holders of one tp degree: each tp rank sums (ZeRO: shards) its own tensors with its peers,
          rings of replicas over split / tp + whole bytes;
        - holders of several tp degrees, no ZeRO: split tensors chunk by chunk (T = lcm of the
          degrees; a chunk over one rank per tp group: the lowest degree's ranks carry split /
          tp_min), then the rest as full tensors over every holder rank: the whole tensors, and
          every split tensor whose split dim T does not divide (an ffn width, a vocabulary);
        - holders of several tp degrees under ZeRO: full tensors over every holder rank.
        A full-tensor sum of split tensors first gathers them inside each holder's tp group."""
        split, whole_bytes = nbytes
        split_bytes = sum(split.values())
        tps = {h[3] for h in holders}
        if len(tps) == 1:
            # whole tensors are not split: x tp, so that their 1/tp in the ring is all of them
            parts = [(split_bytes + whole_bytes * next(iter(tps)), False, 0.0, 1)]
        elif zs >= 1:
            parts = [(split_bytes + whole_bytes, True, split_bytes, 1)]
        else:
            T = math.lcm(*tps)
            rest = sum(b for size, b in split.items() if size % T)
            # a rank of the lowest degree sums each of its T / t_min chunks in turn
            parts = [(split_bytes - rest, False, 0.0, T // min(tps)), (whole_bytes + rest, True, rest, 1)]
        across = len({cm._dev[h[2]].vendor for h in holders}) > 1
        # ZeRO: the reduce-scatter and the parameter all-gather each move half of what the rings cost
        # (one vendor); the all-gather can run under the next step's forward, as the runtime runs it
        # at tp 1 (into the parameters' own vector) and not across vendors
        defer = zs >= 1 and not across and tps == {1}
        # a bf16 model gathers bf16 values (every ZeRO all-gather of the runtime, ``packed``): half
        # the bytes of the fp32 gradients the reduce-scatter sums
        ratio = low_gather / e if zs >= 1 else 1.0
        t, ag, rs_ag, touched = 0.0, 0.0, 0.0, set()
        for nb, full, gathered, calls in parts:   # (bytes, full tensors, tp-gathered bytes, calls)
            if nb > 0:
                # the tp gathers run side by side in each holder's group; the sum waits for the slowest
                t += max(cm._gather_time(g, tp, gathered) for _, _, g, tp, _ in holders) if gathered else 0.0
                r, r_ag = rings(holders, nb, full, touched, calls, defer, ratio)
                t += r
                rs_ag += r
                ag += r_ag
        stages_held = frozenset((pi, k) for pi, k, *_ in holders)
        ag_later = ag if defer else 0.0
        later[stages_held] = later.get(stages_held, 0.0) + ag_later
        held[stages_held] = held.get(stages_held, 0.0) + t
        # the part of the sum that waits for the end of the backward: the last bucket (the first
        # layer's, the embedding); under ZeRO also the all-gather after the optimizer (the share q
        # of t: a half, less where it gathers bf16)
        late, total = last_bytes.get(tuple(holders), (0.0, 0.0))
        phi = min(1.0, late / total) if total > 0 else 1.0
        q = (ag / rs_ag if ratio != 1 and rs_ag > 0 else 0.5) if zs >= 1 else 0.0
        tail[stages_held] = tail.get(stages_held, 0.0) + t * (phi * (1 - q) + q)
        bridged[stages_held] = bridged.get(stages_held, False) or across
        for sk in stages_held:
            own[sk] = own.get(sk, 0.0) + t
            own_later[sk] = own_later.get(sk, 0.0) + ag_later
            crossed.setdefault(sk, set()).update(touched)

    def rings(holders, nbytes, full, touched, calls: int = 1, defer: bool = False,
              ratio: float = 1.0) -> tuple[float, float]:
        """(seconds of one sum of ``nbytes`` (as if every tp rank held them whole) over ``holders``,
        of which ZeRO's parameter all-gather): over every holder rank (``full``), else each tp rank
        over one rank per tp group (1/tp of the bytes; the lowest degree's); adds each node's NIC
        load and the nodes crossed to ``touched``.
        ``calls``: collectives the busiest rank runs in a row, each over its share of the bytes
        (a ring's or tree's time is then that of one with ``calls`` x the latency). ``defer``: each
        node's all-gather NIC time can run after the step. ``ratio``: the all-gather's bytes per
        byte of the reduce-scatter's (1; a half where it gathers bf16)."""
        def zero_sum(b, n, bw, lat):   # (reduce-scatter + all-gather, of which the all-gather)
            gather = comm.allgather(b * ratio, n, bw, lat)
            return comm.reduce_scatter(b, n, bw, lat) + gather, gather
        per_group: dict[str, list] = {}   # group -> [ranks in a ring, bytes divisor, stages]
        for pi, k, g, tp, r in holders:
            ranks, split = (r * tp, 1) if full else (r, tp)
            e = per_group.setdefault(g, [0, split, []])
            e[0] += ranks
            e[1] = min(e[1], split)
            e[2].append((pi, k))
        inner, inner_ag = 0.0, 0.0
        for g, (n, tp, stages) in per_group.items():
            if n <= 1:
                continue
            nodes: dict = {}
            for sk in stages:
                for gn, t in stage_nodes[sk].items():
                    if gn[0] == g:
                        nodes[gn] = max(nodes.get(gn, 0), t)
            c = fac[g].communication
            if len(nodes) <= 1:
                link = groups[g].intra_node
                lat = link.latency * calls
                t, t_ag = (zero_sum(nbytes / tp, n, link.bandwidth, lat) if zs >= 1
                           else (comm.allreduce(nbytes / tp, n, link.bandwidth, lat), 0.0))
                if t * c > inner:
                    inner, inner_ag = t * c, t_ag * c
                continue
            link = net.inter_node
            lat = link.latency * calls
            for gn, rings_there in nodes.items():
                b = nbytes / tp * rings_there
                t, t_ag = (zero_sum(b, n, link.bandwidth, lat) if zs >= 1
                           else (comm.allreduce(b, n, link.bandwidth, lat), 0.0))
                t, t_ag = t * c, t_ag * c
                if t > inner:
                    inner, inner_ag = t, t_ag
                node_load[gn] = node_load.get(gn, 0.0) + t
                if defer:
                    node_later[gn] = node_later.get(gn, 0.0) + t_ag
                touched.add(gn)
        cross, cross_ag = 0.0, 0.0
        if len(per_group) > 1:
            link = net.cross_group
            lat = link.latency * calls
            b = nbytes / min(v[1] for v in per_group.values())
            n_groups, gs = len(per_group), list(per_group)
            cross = comm.allreduce(b, n_groups, link.bandwidth, lat)
            # one vendor under ZeRO: one reduce-scatter + all-gather ring, of which the all-gather
            # is a half at the reduce-scatter's bytes (a ring all-reduce's second half)
            cross_ag = (cross / 2 + (comm.allreduce(b * ratio, n_groups, link.bandwidth, lat) - cross) / 2
                        if zs >= 1 else 0.0)
            cross += cross_ag - cross / 2 if zs >= 1 else 0.0
            passes = 1
            if zs >= 1 and len({cm._dev[g].vendor for g in gs}) > 1:
                # hetero.comm's reduce-scatter across vendors is the hierarchical all-reduce (each rank
                # keeps its part), and the updated parameters come back by a hierarchical all-gather:
                # the leaders cross the bridge twice, the second time with the gathered dtype's bytes.
                cross_ag = comm.allgather(b * ratio, n_groups, link.bandwidth, lat)
                cross = comm.allreduce(b, n_groups, link.bandwidth, lat) + cross_ag
                passes = 2
            if any(cm._staged(a, b_) for a in gs for b_ in gs):  # a leader's shard to host and back
                stage_ag = comm.staging_time(b * ratio) if passes == 2 else 0.0
                cross += comm.staging_time(b) + stage_ag
                cross_ag += stage_ag
            f = max(fac[g].communication for g in gs)
            cross, cross_ag = cross * f, cross_ag * f
        total = inner + cross
        if cm.loopback and total > 0:   # CPU processes of this machine: no sum costs less than measured
            total = max(total, cm.loopback["allreduce_s"] * calls * (2 if zs >= 1 else 1))
        return total, inner_ag + cross_ag

    L = cm.model.num_layers
    cuts = {0, L}
    holders_at = []
    firsts, lasts = [], []
    for pi, p in enumerate(plan.pipelines):
        phys = max(1, len(plan.physical_stages(p)))
        V = len(p.stages)
        for vk, s in enumerate(p.stages):
            cuts.add(s.layers[0])
            cuts.add(s.layers[1])
            holders_at.append((s.layers[0], s.layers[1], pi, vk % phys, s.group, s.tp, p.replicas))
        f, la = p.stages[0], p.stages[-1]
        firsts.append((pi, 0, f.group, f.tp, p.replicas))
        lasts.append((pi, (V - 1) % phys, la.group, la.tp, p.replicas))
    cuts = sorted(cuts)
    # One all-reduce per holder set: bytes of every layer range, embedding and head with the same
    # holders are summed before the ring is costed, so a set's latency terms count once. (The
    # runtime, hetero.runtime.grads, cuts a set into buckets of 25 MB that run back to back, each
    # with its own latency; those latencies are left out.)
    bucket_bytes: dict[tuple, tuple[dict, float]] = {}   # holders -> ({split dim size: bytes}, whole)
    layered: dict[tuple, float] = {}   # holders -> bytes of layers and head (finished bucket by bucket)
    at_end: dict[tuple, float] = {}    # holders -> bytes finished when the backward ends (embeddings)

    def add(holders, split=(), whole=0.0, last=False):
        key = tuple(sorted(set(holders)))
        by_size, w0 = bucket_bytes.get(key, ({}, 0.0))
        for size, nb in split:
            by_size[size] = by_size.get(size, 0.0) + nb
        bucket_bytes[key] = (by_size, w0 + whole)
        into = at_end if last else layered
        into[key] = into.get(key, 0.0) + sum(nb for _, nb in split) + whole

    model, e = cm.model, cm.grad_bytes(placement)
    # bytes a parameter that ZeRO's all-gather moves (hetero.runtime.zero: bf16 for a bf16 model)
    low_gather = 2 if placement == "packed" and gathers_in_bf16(cm.dtype, zs) else e
    W = model.tp_replicated_per_layer() * e
    layer_split = [(size, float(n * e)) for size, n in model.tp_split_per_layer().items()]
    for a, b in zip(cuts, cuts[1:]):
        add([(pi, k, g, tp, r) for s0, s1, pi, k, g, tp, r in holders_at if s0 <= a < s1],
            [(size, nb * (b - a)) for size, nb in layer_split], W * (b - a))
    V = model.vocab_size
    words = V * model.hidden_size * e
    copies = [h for h, f in zip(lasts, firsts) if h[1] != f[1]] if model.tie_embeddings else []
    # the last stages' copy of the word embedding joins its sum; learned positions do not
    add(firsts + copies, [(V, words)], last=True)
    if model.position_params():
        add(firsts, whole=model.position_params() * e, last=True)
    norm = model.final_norm_params() * e
    add(lasts, [(V, model.head_params() * e - norm)], whole=norm)
    # per holder set: (bytes the backward finishes last, all its bytes): the embeddings, and of the
    # layers the last bucket the runtime cuts (hetero.runtime.grads.BUCKET_CAP_BYTES of fp32)
    cap = BUCKET_CAP_BYTES * e / 4
    last_bytes = {key: (at_end.get(key, 0.0) + min(cap, layered.get(key, 0.0)),
                        at_end.get(key, 0.0) + layered.get(key, 0.0)) for key in bucket_bytes}
    for holders, nbytes in bucket_bytes.items():
        ring(list(holders), nbytes)
    out, in_step, gathers = {}, {}, {}
    for pi, p in enumerate(plan.pipelines):
        for k in range(max(1, len(plan.physical_stages(p)))):
            sk = (pi, k)
            t, g = own.get(sk, 0.0), own_later.get(sk, 0.0)
            t_in, g_out = t - g, g
            for gn in crossed.get(sk, ()):
                t = max(t, node_load[gn])
                t_in = max(t_in, node_load[gn] - node_later.get(gn, 0.0))
                if g > 0:   # its own gathers share the NICs they cross with the others' there
                    g_out = max(g_out, node_later.get(gn, 0.0))
            out[sk], in_step[sk], gathers[sk] = t, t_in, g_out
    return out, SyncPlan(out, sync_buckets(groups, plan, placement, where, held), tail, bridged,
                         later=later, in_step=in_step, gathers=gathers)


def sync_buckets(groups: dict, plan, placement: str, where: dict, held: dict) -> list[tuple[frozenset, float]]:
    """The gradient all-reduces of a step in the order every rank runs them, as (holder stages,
    seconds), from ``held`` (holder stages -> seconds; all parameters with one holder set, which the
    runtime sums in buckets of 25 MB back to back, :mod:`hetero.runtime.grads`).

    ``packed`` (the hetero runtime): the ranks agree on the order of the holder sets as sorted
    tuples of rank numbers (:func:`hetero.layout.build_layout` numbers ranks group by group in
    cluster order, node by node, blocks in plan order) and run them in rounds of disjoint holders
    (:mod:`hetero.syncorder`), so two ranks meet their common buckets in the same order. ``megatron``: every stage's data-parallel all-reduce first, then the
    all-reduce of the word embedding between the first and last stages (Megatron-LM's
    finalize_model_grads). A bucket held by one stage alone that takes no time is left out.
    """
    tps = {(pi, k): s.tp for pi, p in enumerate(plan.pipelines) for k, s in enumerate(plan.physical_stages(p))}
    offset: dict = {}   # where the next block of a node (megatron: of anywhere) is numbered
    if placement == "megatron":  # pp-major, then the data-parallel rank: one running number
        blocks = sorted(where, key=lambda b: (b[0], b[2], b[1]))
        node = dict.fromkeys(where, 0)
        offset[0] = 0
    else:  # node by node in cluster order, blocks in plan order inside a node
        blocks, node = sorted(where), where
        size: dict = {}
        for (pi, _, k), gn in where.items():
            size[gn] = size.get(gn, 0) + tps[(pi, k)]
        gindex = {name: i for i, name in enumerate(groups)}
        n = 0
        for gn in sorted(size, key=lambda gn: (gindex[gn[0]], gn[1])):
            offset[gn], n = n, n + size[gn]
    lo: dict = {}   # per stage: its lowest rank, and one past its highest (stages hold disjoint ranks)
    hi: dict = {}
    for b in blocks:
        gn, sk = node[b], (b[0], b[2])
        x = offset[gn]
        offset[gn] = end = x + tps[sk]
        if x < lo.get(sk, end):
            lo[sk] = x
        if end > hi.get(sk, 0):
            hi[sk] = end

    megatron = placement == "megatron"
    # per holder set: (the embedding's all-reduce under Megatron's order, one past its highest rank)
    info = {hs: (megatron and len({pi for pi, _ in hs}) < len(hs), max(hi[sk] for sk in hs)) for hs in held}

    def compare(a, b) -> int:
        """Of two holder sets' sorted rank tuples, which comes first: they agree below the lowest
        rank x that only one holds, where that one has x and the other a higher rank (so comes
        later) or nothing more (a prefix, so comes first)."""
        (ea, ha), (eb, hb) = info[a[0]], info[b[0]]
        if ea != eb:
            return 1 if ea else -1
        diff = a[0] ^ b[0]
        if not diff:
            return 0
        s = min(diff, key=lo.__getitem__)
        x = lo[s] + 1
        if s in a[0]:
            return -1 if hb > x else 1
        return 1 if ha > x else -1

    agreed = sorted(held.items(), key=functools.cmp_to_key(compare))
    if not megatron:   # the runtime runs them in rounds (hetero.syncorder), colouring ranks: a stage is
        # expanded to its tp x replicas ranks, so a stage's own all-reduce over its replicas counts
        reps = {(pi, k): p.replicas for pi, p in enumerate(plan.pipelines) for k in range(len(plan.physical_stages(p)))}
        ranks = [{(sk, j) for sk in hs for j in range(tps[sk] * reps[sk])} for hs, _ in agreed]
        agreed = [agreed[i] for i in in_sync_order(ranks)]
    return [(s, t) for s, t in agreed if len(s) > 1 or t > 0]


class SyncPlan:
    """The data-parallel gradient sync of a plan's structure; stages are numbered in (pipeline,
    physical stage) order, the order of :attr:`stages`."""

    __slots__ = ("stages", "buckets", "first", "totals", "tails", "bridged", "later", "in_step", "gathers", "_spans")

    def __init__(self, totals: dict, buckets: list[tuple[frozenset, float]], tails: dict | None = None,
                 bridged: dict | None = None, later: dict | None = None, in_step: dict | None = None,
                 gathers: dict | None = None):
        self.stages = tuple(totals)
        """(pipeline, physical stage) of each stage number."""
        index = {sk: i for i, sk in enumerate(self.stages)}
        self.buckets = tuple((tuple(sorted(index[sk] for sk in hs)), t) for hs, t in buckets)
        """(holder stage numbers, seconds) of each all-reduce, in the order the ranks run them."""
        self.tails = tuple(min(t, (tails or {}).get(hs, t)) for hs, t in buckets)
        """Per bucket: seconds of it that wait for the end of its holders' backward (the last
        bucket the runtime cuts, the embeddings; ZeRO's all-gather): the rest can run under it."""
        self.bridged = tuple(bool((bridged or {}).get(hs, False)) for hs, _ in buckets)
        """Per bucket: whether its sum crosses vendors through the host bridge."""
        first = [-1] * len(self.stages)
        for j, (hs, _) in enumerate(self.buckets):
            for h in hs:
                if first[h] < 0:
                    first[h] = j
        self.first = tuple(first)
        """Per stage: its first bucket, or -1 (nothing to sum with anyone)."""
        self.totals = tuple(totals.values())
        """Per stage: seconds of its own sync (NIC sharing included)."""
        self.later = tuple(min(t, tail, (later or {}).get(hs, 0.0)) for (hs, t), tail in zip(buckets, self.tails))
        """Per bucket: seconds of its ZeRO parameter all-gather (part of its :attr:`tails`) that, with
        overlap, run under the next step's forward instead (:mod:`hetero.runtime.zero`; not across
        vendors)."""
        self.in_step = tuple((in_step or totals)[sk] for sk in self.stages)
        """Per stage: :attr:`totals` less those all-gathers."""
        self.gathers = tuple((gathers or {}).get(sk, 0.0) for sk in self.stages)
        """Per stage: seconds of its deferred parameter all-gathers (NIC sharing included), run one after
        another from the end of the step on, under the next step's first forwards."""
        self._spans: dict = {}   # (ready, hide, sends_after) -> spans: a plan re-scored, or its twins

    def spans(self, ready, hide=None, sends_after=None) -> tuple[list[float], list[float]]:
        """(start, end) of every stage's gradient sync (lists by stage number), the stages done
        with their schedules at ``ready``. Every rank runs its buckets in order, each an all-reduce
        among the bucket's holders that starts when the last of them gets to it; a stage's sync
        also lasts at least its own time (``totals``: NIC sharing) from its first bucket.

        ``hide`` (per stage, seconds; None: no overlap): the backward that runs after the stage's
        first gradients are final (its last backward pass), under which the runtime
        (:mod:`hetero.runtime.overlap`) reduces the buckets it has finished. A bucket may then start
        that long before its holders are done, but its :attr:`tails` part waits for the last of
        them to be done. A bucket across vendors waits for the end of the schedule on a stage that
        still sends a gradient after its last backward (``sends_after``, per stage: not a first
        stage), since the runtime starts it after the rank's last point-to-point operation. With
        ``hide``, ZeRO's parameter all-gathers (:attr:`later`) are left to the next step's forward
        (:attr:`gathers`, which the caller charges to the schedule). Memoised on the inputs (as
        the schedule's simulation is on its stage times); the lists returned are the caller's."""
        key = (tuple(ready), None if hide is None else tuple(hide), None if sends_after is None else tuple(sends_after))
        hit = self._spans.get(key)
        if hit is None:
            if len(self._spans) > 256:
                self._spans.clear()
            hit = self._spans[key] = self._spans_of(ready, hide, sends_after)
        return list(hit[0]), list(hit[1])

    def _spans_of(self, ready, hide, sends_after) -> tuple[tuple, tuple]:
        cur = list(ready) if hide is None else [r - h for r, h in zip(ready, hide)]
        began = []
        overlap = hide is not None
        for (hs, t), tail, bridged, later in zip(self.buckets, self.tails, self.bridged, self.later):
            if overlap and later:
                t, tail = t - later, tail - later
            s = cur[hs[0]]
            done = ready[hs[0]]
            late = bridged and sends_after is not None   # the same for every holder of the bucket
            for h in hs:
                at = ready[h] if late and sends_after[h] and ready[h] > cur[h] else cur[h]
                if at > s:
                    s = at
                if ready[h] > done:
                    done = ready[h]
            began.append(s)
            mid = s + t - tail
            s = (mid if mid > done else done) + tail
            for h in hs:
                cur[h] = s
        starts = [ready[i] if j < 0 else began[j] for i, j in enumerate(self.first)]
        ends = [e if e > s + t else s + t for e, s, t in zip(cur, starts, self.in_step if overlap else self.totals)]
        ends = [e if e > r else r for e, r in zip(ends, ready)]
        return tuple(starts), tuple(ends)


__all__ += ["dp_sync", "sync_buckets", "SyncPlan"]
