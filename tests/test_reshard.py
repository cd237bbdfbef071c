"""Live resharding (hetero.runtime.reshard): the virtual parameter space, the transition between
two plans, and the rank-to-rank exchange, checked bitwise against loading the same state from the
plan-independent checkpoint into the target plan."""
from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

from _spawn import spawn
from helpers import DictStore, live_run, local_cluster, random_state_checkpoint

# an odd vocabulary, so tp 2 splits the embedding unevenly (255 + 254 rows)
MODEL = {"name": "reshard", "architecture": "gpt", "num_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
         "vocab_size": 509, "seq_length": 16, "dtype": "fp32", "tie_embeddings": True}


def _cluster(fast: int, slow: int = 0) -> dict:
    return local_cluster(devices=(fast, slow), slowdown=None, name="reshard-test")


def _plan(*pipelines, gbs=8, mbs=1) -> dict:
    return {"global_batch_size": gbs, "micro_batch_size": mbs, "pipelines": list(pipelines)}


def _stage(group, a, b, tp=1):
    return {"group": group, "layers": [a, b], "tp": tp}


# ---------------------------------------------------------------------------- the space, pure Python

def test_shard_ranges_are_torch_chunks():
    from hetero.runtime.reshard.space import shard_range

    for n, parts in itertools.product((1, 5, 8, 509, 512), (1, 2, 3, 4, 7)):
        chunks = torch.arange(n).chunk(parts)
        for i in range(parts):
            a, b = shard_range(n, parts, i)
            want = chunks[i] if i < len(chunks) else torch.arange(0)
            assert list(range(a, b)) == want.tolist(), (n, parts, i)


@pytest.mark.parametrize("shape,start,stop", [((4, 5), 3, 17), ((4, 5), 5, 15), ((4, 5), 0, 20), ((4, 5), 6, 8),
                                              ((3, 4, 5), 7, 53), ((9,), 2, 7)])
def test_a_flat_range_is_a_few_boxes_with_exactly_its_elements(shape, start, stop):
    from hetero.runtime.reshard.space import flat_range_boxes

    flat = torch.zeros(shape, dtype=torch.int64)
    boxes = flat_range_boxes(shape, start, stop)
    for box in boxes:
        flat[tuple(slice(a, b) for a, b in box)] += 1
    want = torch.zeros(flat.numel(), dtype=torch.int64)
    want[start:stop] = 1
    assert flat.reshape(-1).tolist() == want.tolist()
    if len(shape) == 2:
        assert len(boxes) <= 3


def _regions(cluster, plan):
    import hetero
    from hetero.layout import build_layout
    from hetero.runtime.reshard.space import ParameterSpace

    c, p = hetero.load_cluster(cluster), hetero.load_plan(plan)
    layout = build_layout(c, p)
    return ParameterSpace(hetero.load_model(MODEL)).layout_regions(p, layout), layout


def _covered_exactly(transition, targets):
    """Every target element arrives exactly once."""
    from hetero.runtime.reshard.space import ParameterSpace, relative
    import hetero

    shapes = ParameterSpace(hetero.load_model(MODEL)).shapes
    for dst, regions in targets.items():
        for name, box in regions.items():
            count = torch.zeros(tuple(b - a for a, b in box), dtype=torch.int64)
            for p in transition.pieces:
                if p.dst == dst and p.name == name:
                    count[relative(p.box, box)] += 1
            assert bool((count == 1).all()), (dst, name, shapes[name])


def test_pp2_dp2_to_tp2_moves_the_intersections_and_keeps_what_each_rank_has():
    from hetero.runtime.reshard.transition import plan_transition

    old, lo = _regions(_cluster(2, 2), _plan({"replicas": 2, "micro_batches": 4,
                                              "stages": [_stage("fast", 0, 2), _stage("slow", 2, 4)]}))
    new, ln = _regions(_cluster(2), _plan({"micro_batches": 8, "stages": [_stage("fast", 0, 4, tp=2)]}))
    del old[3]   # rank 3 (slow) lost; fast ranks 0, 1 stay ranks 0, 1
    t = plan_transition(old, new, {0: "a", 1: "a", 2: "b"})
    _covered_exactly(t, new)
    assert not t.missing
    # layers 2-3 exist only on rank 2 now: it sends both tp halves, nobody else sends anything
    assert {p.src for p in t.moved} == {2}
    # ranks 0 and 1 keep their stage-0 slices: no piece of layers 0-1 moves
    assert not [p for p in t.moved if p.name.startswith(("layers.0.", "layers.1.", "wpe"))]
    assert t.intersection_bytes == sum(t.link_bytes().values())


def test_a_part_of_a_tensor_is_contiguous_when_only_its_first_partial_dimension_is_cut():
    from hetero.runtime.reshard.space import contiguous_within

    whole = ((0, 8), (0, 6))
    assert contiguous_within(((0, 4), (0, 6)), whole)        # tp half along dim 0
    assert not contiguous_within(((0, 8), (0, 3)), whole)    # tp half along dim 1: strided rows
    assert contiguous_within(((2, 3), (1, 4)), whole)        # within one row
    assert contiguous_within(((0, 8),), ((0, 16),)) and contiguous_within((), ())
    assert contiguous_within(((1, 2), (0, 3), (0, 5)), ((0, 4), (0, 6), (0, 5)))
    assert not contiguous_within(((1, 2), (0, 3), (0, 4)), ((0, 4), (0, 6), (0, 5)))


def test_a_whole_stage_becoming_a_tp_half_keeps_its_dim0_halves_without_a_copy():
    """What a rank keeps of its own tensors is taken over (a view, no allocation) where the new box is
    a contiguous part of the old one, and what the launcher reserves for the exchange excludes it."""
    from hetero.runtime.reshard.space import BYTES_PER_ELEMENT, box_numel, contiguous_within
    from hetero.runtime.reshard.transfer import fresh_bytes, kept_names
    from hetero.runtime.reshard.transition import plan_transition

    old, _ = _regions(_cluster(2), _plan({"replicas": 2, "micro_batches": 4, "stages": [_stage("fast", 0, 4)]}))
    new, _ = _regions(_cluster(2), _plan({"micro_batches": 8, "stages": [_stage("fast", 0, 4, tp=2)]}))
    t = plan_transition(old, new, {0: "a", 1: "a"})
    assert not t.moved   # each replica held everything: all local
    for rank in (0, 1):
        kept = kept_names(rank, t, old[rank], new[rank])
        whole = kept_names(rank, t, old[rank], new[rank], views=False)
        assert whole < kept   # replicated tensors (norms) whole; dim-0 halves as views
        for name in kept - whole:
            assert new[rank][name] != old[rank][name] and contiguous_within(new[rank][name], old[rank][name])
        copied = [n for n in new[rank] if n not in kept]
        assert copied and all(not contiguous_within(new[rank][n], old[rank][n]) for n in copied)   # dim-1 halves
        assert fresh_bytes(rank, t, old[rank], new[rank]) == sum(box_numel(new[rank][n]) for n in copied) * \
            BYTES_PER_ELEMENT


def test_sources_prefer_the_destinations_vendor_and_share_the_links():
    from hetero.runtime.reshard.transition import plan_transition

    # two replicas of the whole model on vendor a (ranks 0, 1) and one on vendor b (rank 2); a new rank
    # 3 of vendor a holds everything: it pulls from 0 and 1 only, about half from each
    full, _ = _regions(_cluster(1), _plan({"micro_batches": 8, "stages": [_stage("fast", 0, 4)]}))
    sources = {r: full[0] for r in (0, 1, 2)}
    t = plan_transition(sources, {3: full[0]}, {0: "a", 1: "a", 2: "b", 3: "a"})
    _covered_exactly(t, {3: full[0]})
    links = t.link_bytes()
    assert set(links) == {(0, 3), (1, 3)}
    assert abs(links[(0, 3)] - links[(1, 3)]) / max(links.values()) < 0.05
    # without a same-vendor copy the other vendor serves
    t = plan_transition({2: full[0]}, {3: full[0]}, {2: "b", 3: "a"})
    assert set(t.link_bytes()) == {(2, 3)}


def test_a_region_no_survivor_holds_is_reported_missing():
    from hetero.runtime.reshard.transition import plan_transition

    old, _ = _regions(_cluster(2), _plan({"micro_batches": 8, "stages": [_stage("fast", 0, 2), _stage("fast", 2, 4)]}))
    new, _ = _regions(_cluster(1), _plan({"micro_batches": 8, "stages": [_stage("fast", 0, 4)]}))
    t = plan_transition({0: old[0]}, new)
    missing = {region.name for _, region in t.missing}
    assert "layers.3.attn.wq.weight" in missing and "layers.0.attn.wq.weight" not in missing


# ---------------------------------------------------------------------------- the exchange, bitwise

# name, cluster before, plan before, cluster after, plan after, process -> old rank, process -> new rank
SCENARIOS = [
    ("pp2->tp2", _cluster(2), _plan({"micro_batches": 8, "stages": [_stage("fast", 0, 2), _stage("fast", 2, 4)]}),
     _cluster(2), _plan({"micro_batches": 8, "stages": [_stage("fast", 0, 4, tp=2)]}), {0: 0, 1: 1}, {0: 0, 1: 1}),
    ("dp2->pp2", _cluster(2), _plan({"replicas": 2, "micro_batches": 4, "stages": [_stage("fast", 0, 4)]}),
     _cluster(2), _plan({"micro_batches": 8, "stages": [_stage("fast", 0, 2), _stage("fast", 2, 4)]}),
     {0: 0, 1: 1}, {0: 0, 1: 1}),
    # rank 3 lost; the three devices left run three uneven stages
    ("4->3 ranks", _cluster(2, 2), _plan({"replicas": 2, "micro_batches": 4,
                                          "stages": [_stage("fast", 0, 2), _stage("slow", 2, 4)]}),
     _cluster(2, 1), _plan({"micro_batches": 8, "stages": [_stage("fast", 0, 1), _stage("fast", 1, 3),
                                                           _stage("slow", 3, 4)]}),
     {0: 0, 1: 1, 2: 2}, {0: 0, 1: 1, 2: 2}),
    ("uneven->uneven", _cluster(2, 1), _plan({"micro_batches": 8, "stages": [_stage("fast", 0, 3, tp=2),
                                                                            _stage("slow", 3, 4)]}),
     _cluster(2, 1), _plan({"micro_batches": 8, "stages": [_stage("fast", 0, 1), _stage("fast", 1, 2),
                                                           _stage("slow", 2, 4)]}),
     {0: 0, 1: 1, 2: 2}, {0: 0, 1: 1, 2: 2}),
    # two tp-2 replicas on two vendors; ranks 1 and 3 leave; what is left runs tp 1, one stage per vendor
    ("tp2->tp1 across vendors", _cluster(2, 2),
     _plan({"micro_batches": 4, "stages": [_stage("fast", 0, 4, tp=2)]},
           {"micro_batches": 4, "stages": [_stage("slow", 0, 4, tp=2)]}),
     _cluster(1, 1), _plan({"micro_batches": 8, "stages": [_stage("fast", 0, 2), _stage("slow", 2, 4)]}),
     {0: 0, 1: 1, 2: 2, 3: 3}, {0: 0, 2: 1}),
]


def _stage_from(model, plan, layout, rank, groups, ckpt):
    """Rank ``rank`` of ``layout`` (None: a process without a place there) loaded from ``ckpt``; every
    process calls it (the checkpoint's load is a collective)."""
    from torch.distributed.device_mesh import DeviceMesh

    from hetero.runtime.checkpoint import load_checkpoint
    from hetero.runtime.grads import make_optimizer
    from hetero.runtime.model import apply_tensor_parallel, build_stage

    if rank is None:
        load_checkpoint(ckpt, torch.nn.Module(), None)
        return None, None, None
    info = layout.ranks[rank]
    first, last = info.holds_ends(plan)
    module = build_stage(model, info.layers, first, last, seed=1, chunks=info.chunk_layers(plan))
    mesh = None
    if info.tp_size > 1:
        mesh = DeviceMesh.from_group(groups[tuple(layout.stage_ranks(info.pipeline, info.replica, info.stage))], "cpu")
        apply_tensor_parallel(module, mesh)
    optimizer = make_optimizer(module.parameters(), 1e-3, 0.0)
    load_checkpoint(ckpt, module, optimizer)
    return module, optimizer, mesh


def _tp_groups(layout, proc_of_rank):
    """A process group for every tp group of ``layout`` (new_group: every process, same order)."""
    import torch.distributed as dist

    out = {}
    for info in layout.ranks:
        key = tuple(layout.stage_ranks(info.pipeline, info.replica, info.stage))
        if len(key) > 1 and key not in out and all(r in proc_of_rank for r in key):
            out[key] = dist.new_group([proc_of_rank[r] for r in key])
    return out


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _reshard_worker(rank, world, ckpt, max_bytes, same_host=False):
    import torch.distributed as dist

    import hetero
    from hetero.layout import build_layout
    from hetero.runtime.grads import local_part
    from hetero.runtime.reshard.space import ParameterSpace
    from hetero.runtime.reshard.transfer import exchange, fresh_bytes, live_state, rebuild_stage
    from hetero.runtime.reshard.transition import plan_transition

    dist.init_process_group("gloo")
    model = hetero.load_model(MODEL)
    space = ParameterSpace(model)
    out = {}
    for name, c0, p0, c1, p1, old_of, new_of in SCENARIOS:
        plans = [hetero.load_plan(p0), hetero.load_plan(p1)]
        layouts = [build_layout(hetero.load_cluster(c0), plans[0]), build_layout(hetero.load_cluster(c1), plans[1])]
        procs = [{r: p for p, r in old_of.items()}, {r: p for p, r in new_of.items()}]
        for p in set(old_of) & set(new_of):   # a process keeps its device: the same vendor in both plans
            assert layouts[0].ranks[old_of[p]].vendor == layouts[1].ranks[new_of[p]].vendor, name
        groups = [_tp_groups(layouts[0], procs[0]), _tp_groups(layouts[1], procs[1])]
        regions = [space.layout_regions(plans[i], layouts[i]) for i in (0, 1)]
        sources = {p: regions[0][r] for p, r in old_of.items()}
        targets = {p: regions[1][r] for p, r in new_of.items()}
        vendors = {p: layouts[0].ranks[r].vendor for p, r in old_of.items()}
        vendors.update({p: layouts[1].ranks[r].vendor for p, r in new_of.items()})
        transition = plan_transition(sources, targets, vendors)
        old_module, old_opt, _ = _stage_from(model, plans[0], layouts[0], old_of.get(rank), groups[0], ckpt)
        live = live_state(old_module, old_opt, sources[rank]) if rank in old_of else {}
        # same host: the receivers read the senders' memory (the store of this world, every process's id)
        host = None
        if same_host:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"pid/{name}/{rank}", str(os.getpid()))
            pids = {r: int(store.get(f"pid/{name}/{r}")) for r in range(world)}
            host = (store, f"same-host/{name}", pids, 60.0)
        state, stats = exchange(rank, transition, live, targets.get(rank, {}), max_bytes=max_bytes,
                                chunk_bytes=max_bytes // 2, same_host=host)
        # what the exchange allocated (its tensors that are not the old state's), against what the
        # launcher tells a rank to reserve for it
        old_storages = {t.untyped_storage().data_ptr() for st in live.values() for t in st.tensors.values()}
        allocated = sum(t.nbytes for st in state.values() for t in st.tensors.values()
                        if t.untyped_storage().data_ptr() not in old_storages)
        # kept without a copy as a part of an old tensor (a tp half along dim 0 of a whole one)
        views = sum(1 for n, st in state.items() if n in live and st.box != live[n].box
                    and st.tensors["param"].untyped_storage().data_ptr() in old_storages)
        expected = fresh_bytes(rank, transition, {n: st.box for n, st in live.items()}, targets.get(rank, {}))
        ref, ref_opt, mesh = _stage_from(model, plans[1], layouts[1], new_of.get(rank), groups[1], ckpt)
        bad = []
        if rank in new_of:
            info = layouts[1].ranks[new_of[rank]]
            module, optimizer = rebuild_stage(model, plans[1], info, state, mesh=mesh)
            got, want = dict(module.named_parameters()), dict(ref.named_parameters())
            assert sorted(got) == sorted(want)
            for n in want:
                if not _bitwise(local_part(got[n].detach()), local_part(want[n].detach())):
                    bad.append(f"{n} param")
                a, b = optimizer.state[got[n]], ref_opt.state[want[n]]
                for k in ("exp_avg", "exp_avg_sq", "step"):
                    if not _bitwise(torch.as_tensor(local_part(a[k])), torch.as_tensor(local_part(b[k]))):
                        bad.append(f"{n} {k}")
            # the rebuilt stage computes what the loaded one does (tp ranks: both run it, in step)
            g = torch.Generator().manual_seed(7)
            x = (torch.randint(0, model.vocab_size, (2, model.seq_length), generator=g) if info.layers[0] == 0
                 else torch.randn(2, model.seq_length, model.hidden_size, generator=g))
            with torch.no_grad():
                if not _bitwise(local_part(module(x)), local_part(ref(x))):
                    bad.append("forward")
        out[name] = {"bad": bad, "sent": stats.bytes_sent, "received": stats.bytes_received,
                     "peak": stats.peak_in_flight, "intersection": transition.intersection_bytes,
                     "allocated": allocated, "fresh_bytes": expected, "views": views,
                     "cross_vendor": sum(p.nbytes for p in transition.moved if vendors[p.src] != vendors[p.dst])}
        dist.barrier()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("same_host", [False, True], ids=["point-to-point", "same host"])
def test_a_live_reshard_equals_loading_the_checkpoint_into_the_target_plan(tmp_path, same_host):
    from hetero.runtime.reshard import cma

    if same_host and not cma.usable():
        pytest.skip("this machine does not let a process read another's memory (process_vm_readv)")
    ckpt = str(tmp_path / "ckpt")
    random_state_checkpoint(ckpt, MODEL)
    max_bytes = 64 << 10   # small, so the bigger pieces travel as several messages
    results = spawn(_reshard_worker, 4, args=(ckpt, max_bytes, same_host), timeout=240)
    for name, *_ in SCENARIOS:
        per_rank = [r[name] for r in results]
        bad = {rank: r["bad"] for rank, r in enumerate(per_rank) if r["bad"]}
        assert not bad, f"{name}: not bitwise equal: {bad}"
        sent, received = sum(r["sent"] for r in per_rank), sum(r["received"] for r in per_rank)
        assert sent == received == per_rank[0]["intersection"], name
        # both data-parallel ranks hold the whole model: each keeps its stage, nothing moves
        assert (sent == 0) == (name == "dp2->pp2"), name
        assert max(r["peak"] for r in per_rank) <= max_bytes, name
        assert [r["allocated"] for r in per_rank] == [r["fresh_bytes"] for r in per_rank], name
        assert not sent or any(r["allocated"] for r in per_rank), name   # what a rank receives is new
    # a whole stage becoming a tp half: the dim-0 halves are kept as views of the old tensors
    assert all(r["pp2->tp2"]["views"] > 0 for r in results[:2])
    # each tp-1 rank has a same-vendor tp peer that held the other half: nothing crosses the bridge
    assert results[0]["tp2->tp1 across vendors"]["cross_vendor"] == 0


# ---------------------------------------------------------------------------- in-process, after a failure

LOST = SCENARIOS[2]   # 4 -> 3 ranks: rank 3 lost


def _survivor_worker(rank, world, ckpt, port, second_failure):
    import os
    import time

    import torch.distributed as dist

    import hetero
    from hetero.layout import build_layout
    from hetero.runtime.grads import local_part
    from hetero.runtime.reshard import live as L
    from hetero.runtime.reshard.sockets import break_connections
    from hetero.runtime.reshard.space import ParameterSpace
    from hetero.runtime.reshard.transfer import live_state, rebuild_stage

    _, c0, p0, c1, p1, _, _ = LOST
    store = L.connect(port)
    L.regroup(store, 0, rank, world, timeout_s=20)
    model, plan = hetero.load_model(MODEL), hetero.load_plan(p0)
    layout = build_layout(hetero.load_cluster(c0), plan)
    module, optimizer, _ = _stage_from(model, plan, layout, rank, {}, ckpt)
    pid = os.getpid()
    if rank == 3:
        os._exit(1)   # the lost device: gone without a word
    t = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1))
        raise AssertionError("an all-reduce with a dead peer succeeded")
    except RuntimeError:
        detect_s = time.perf_counter() - t
    # as a survivor leaving the broken world does: the peers still blocked in the all-reduce on this
    # rank fail at once instead of at the group's timeout (20 s)
    break_connections({port})
    live = live_state(module, optimizer, ParameterSpace(model).rank_regions(plan, layout.ranks[rank]))
    if second_failure and rank == 1:   # lost again, after joining the new world, before the exchange
        L.report_alive(store, 1, rank)
        L.await_decision(store, 1, 30)
        L.regroup(store, 1, 1, 3, 10)
        # after the others formed the world too: Gloo connects a full mesh, and a peer that exits while
        # another still connects fails that one's join (a loss before joining) instead of its exchange
        time.sleep(2.0)
        os._exit(1)
    try:
        place = L.reconfigure(store, 1, rank, live, timeout_s=30, max_bytes=1 << 20)
    except L.ReconfigurationError as e:
        return {"error": str(e), "pid": os.getpid()}
    if second_failure:   # the lost rank is the next generation's failure (the reference load needs it)
        return {"pid": os.getpid()}
    new_module, new_optimizer = rebuild_stage(model, place.plan, place.info, place.state, mesh=place.mesh)
    ref, ref_opt, _ = _stage_from(model, place.plan, place.layout, place.rank, {}, ckpt)
    bad = [n for n, p in new_module.named_parameters()
           if not _bitwise(local_part(p.detach()), local_part(dict(ref.named_parameters())[n].detach()))]
    bad += [n for n, p in new_module.named_parameters()
            if not _bitwise(new_optimizer.state[p]["exp_avg_sq"], ref_opt.state[dict(ref.named_parameters())[n]]
                            ["exp_avg_sq"])]
    return {"pid_before": pid, "pid": os.getpid(), "rank": place.rank, "bad": bad, "detect_s": detect_s,
            "sent": place.stats.bytes_sent, "intersection": place.transition.intersection_bytes, **place.timings}


def _coordinate(coordinator, survivors, transport):
    from hetero.runtime.reshard.live import decision_for

    got = coordinator.await_survivors(1, survivors, timeout_s=60)
    members = {r: i for i, r in enumerate(sorted(got))}
    _, c0, p0, c1, p1, _, _ = LOST
    coordinator.publish(1, members, decision_for(MODEL, (c0, p0), (c1, p1), sorted(got), step=3, transport=transport))


@pytest.mark.slow
@pytest.mark.parametrize("second_failure, transport", [(False, "p2p"), (True, "p2p"), (True, "same-host")],
                         ids=["one failure", "a second failure in the reshard", "a second failure, same host"])
def test_survivors_reshard_in_process_and_a_second_failure_is_named(tmp_path, second_failure, transport):
    # (one failure over the same-host transport: tests/test_elastic.py's lost rank, through the launcher)
    import threading

    from hetero.runtime.reshard import cma
    from hetero.runtime.reshard.live import Coordinator

    if transport == "same-host" and not cma.usable():
        pytest.skip("this machine does not let a process read another's memory (process_vm_readv)")

    ckpt = str(tmp_path / "ckpt")
    random_state_checkpoint(ckpt, MODEL)
    coordinator = Coordinator()
    # the coordinator knows rank 3's process exited (the launcher watches its workers' pids)
    threading.Thread(target=_coordinate, args=(coordinator, [0, 1, 2], transport), daemon=True).start()
    try:
        results = spawn(_survivor_worker, 4, args=(ckpt, coordinator.port, second_failure), timeout=120,
                        may_die=(1, 3) if second_failure else (3,))
    finally:
        coordinator.close()
    if second_failure:
        # rank 2 (slow) takes the tied embedding from ranks 0 and 1 and sends layer 2 to rank 1
        assert "error" in results[2] and "rank 1 (rank 1 before) was lost during the exchange" in results[2]["error"]
        return
    assert results[3] is None
    for r in (0, 1, 2):
        got = results[r]
        assert got.get("bad") == [], (r, got)
        assert got["pid"] == got["pid_before"] and got["rank"] == r
    assert sum(results[r]["sent"] for r in (0, 1, 2)) == results[0]["intersection"] > 0


def test_a_worker_resolves_ahead_the_transition_each_single_loss_would_need(tmp_path):
    """The launcher publishes its decision for each single loss as it plans them; a worker works out
    the plans, regions and transition at a step boundary, and the decision a loss brings (its step,
    process ids, transport) finds them made: the launcher's own transition, nothing computed then."""
    from hetero.runtime.reshard import live as L
    from hetero.runtime.elastic.reconfig import LiveReconfig

    run, cluster, model, plan, _ = live_run(tmp_path)
    try:
        run._plan_ahead()   # what start() runs beside the workers
        published = run.coordinator.store.get(L.ahead_key(0))
    finally:
        run.coordinator.close()
    L._RESOLVED.clear()
    worker = LiveReconfig.__new__(LiveReconfig)
    worker.store, worker.gen, worker.rank, worker.space = DictStore(), 0, 0, None
    worker.resolve_ahead()   # nothing published yet: nothing made, and asked again later
    assert not L._RESOLVED and worker.resolved is None
    worker.store[L.ahead_key(0)] = published
    worker.resolve_ahead()
    assert len(L._RESOLVED) == 3   # the losses rank 0 survives (every layer has a replica)
    ahead = run._ahead[frozenset([3])]
    d = L.decision_for(model.to_dict(), (cluster.to_dict(), plan.to_dict()),
                       (ahead.cluster.to_dict(), ahead.result.plan.to_dict()), list(ahead.survivors), 3,
                       transport="same-host", pids={r: 1000 + r for r in ahead.survivors})
    d["members"] = dict(ahead.members)   # as await_decision gives them: int keys
    got = L.resolve(d)
    assert len(L._RESOLVED) == 3 and got.transition.pieces == ahead.transition.pieces
    L._RESOLVED.clear()


def test_after_a_reshard_the_launcher_plans_ahead_once_every_rank_is_ready(tmp_path):
    """Planning for the next losses takes a core: it starts once the new plan's ranks all reported
    ready, not while they exchange their state."""
    import threading
    from types import SimpleNamespace

    from hetero.runtime.elastic.protocol import timing_key

    run, *_ = live_run(tmp_path)
    started = threading.Event()
    run._plan_ahead = started.set
    try:
        ahead = run._replan({3})
        survivors = [0, 1, 2]
        members = {r: r for r in range(len(ahead.layout.ranks))}
        run.now.procs = {r: SimpleNamespace(pid=1000 + r, poll=lambda: 0) for r in range(4)}
        rc = {"_failed_at": 1.0, "_launched_at": 2.0, "predicted_downtime_s": 0.1}
        run.switch(rc, 1, survivors, members, {3}, ahead)
        run._collect_timings()
        assert not started.wait(0.2)   # the ranks have not reported yet
        for r in survivors:
            run.coordinator.store.set(timing_key(1, r), json.dumps(
                {"detected_at": 1.1, "leave_s": 0.0, "agree_replan_s": 0.0, "regroup_s": 0.0, "transfer_s": 0.1,
                 "rebuild_s": 0.1, "bytes_sent": 0, "bytes_received": 0, "pid": 1000 + r, "ready_at": 2.5}))
        run._collect_timings()
        assert started.wait(5) and rc["pids_kept"] is True
    finally:
        run.coordinator.close()


def test_the_predicted_transfer_is_the_busiest_ranks_bytes_over_its_links():
    import hetero
    from hetero.runtime.reshard.predict import predict_transfer_s
    from hetero.runtime.reshard.transition import plan_transition

    c0, p0, c1, p1 = LOST[1:5]
    old, lo = _regions(c0, p0)
    new, ln = _regions(c1, p1)
    del old[3]
    t = plan_transition(old, new, {0: "emu-a", 1: "emu-a", 2: "emu-b"})
    cluster = hetero.load_cluster({**c1, "network": {"cross_group": {"bandwidth": "1 GB/s", "latency": "0 us"}},
                                   "groups": [{**g, "intra_node": {"bandwidth": "4 GB/s", "latency": "0 us"}}
                                              for g in c1["groups"]]})
    got = predict_transfer_s(t, cluster, {i.rank: i for i in ln.ranks})
    # rank 2 (the other group) talks over the 1 GB/s bridge, ranks 0 and 1 with each other at 4 GB/s
    links = t.link_bytes()
    assert any(2 in link for link in links)
    bw = lambda s, d: 1e9 if 2 in (s, d) else 4e9   # noqa: E731
    for r in (0, 1, 2):
        out = sum(b / bw(s, d) for (s, d), b in links.items() if s == r)
        into = sum(b / bw(s, d) for (s, d), b in links.items() if d == r)
        assert got["per_rank_s"].get(r, 0.0) == pytest.approx(max(out, into))
    assert got["transfer_s"] == max(got["per_rank_s"].values())


@pytest.mark.parametrize("with_checkpoint", [True, False], ids=["--save checkpoint", "none"])
def test_a_region_no_survivor_holds_comes_from_the_last_checkpoint_or_ends_the_run(tmp_path, capsys,
                                                                                   with_checkpoint):
    import torch.distributed as dist

    import hetero
    from hetero.layout import build_layout
    from hetero.runtime.grads import local_part
    from hetero.runtime.reshard import live as L
    from hetero.runtime.reshard.space import ParameterSpace
    from hetero.runtime.reshard.transfer import live_state, rebuild_stage

    ckpt = str(tmp_path / "ckpt")
    random_state_checkpoint(ckpt, MODEL)
    # two stages, no replica; rank 1 (layers 2-3) lost: this process is the one survivor
    c0, p0 = _cluster(2), _plan({"micro_batches": 8, "stages": [_stage("fast", 0, 2), _stage("fast", 2, 4)]})
    c1, p1 = _cluster(1), _plan({"micro_batches": 8, "stages": [_stage("fast", 0, 4)]})
    model, plan = hetero.load_model(MODEL), hetero.load_plan(p0)
    layout = build_layout(hetero.load_cluster(c0), plan)
    coordinator = L.Coordinator()
    try:
        store = L.connect(coordinator.port)
        L.regroup(store, 0, 0, 1, 20)
        module, optimizer, _ = _stage_from(model, plan, layout, 0, {}, ckpt)
        live = live_state(module, optimizer, ParameterSpace(model).rank_regions(plan, layout.ranks[0]))
        coordinator.publish(1, {0: 0}, L.decision_for(MODEL, (c0, p0), (c1, p1), [0], step=5,
                                                      checkpoint=ckpt if with_checkpoint else None))
        if not with_checkpoint:
            with pytest.raises(L.ReconfigurationError, match="no survivor holds final_norm.bias .and 33 more regions.: the live state cannot be rebuilt"):
                L.reconfigure(store, 1, 0, live, timeout_s=20)
            return
        place = L.reconfigure(store, 1, 0, live, timeout_s=20)
        assert place.fallback == ckpt and place.step == 3
        assert "steps 4-5 are lost" in capsys.readouterr().out
        new, _ = rebuild_stage(model, place.plan, place.info, place.state)
        ref, _, _ = _stage_from(model, place.plan, place.layout, 0, {}, ckpt)
        want = dict(ref.named_parameters())
        assert all(_bitwise(local_part(p.detach()), want[n].detach()) for n, p in new.named_parameters())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        coordinator.close()


# ---------------------------------------------------------------------------- the same-host transport

def test_same_host_reads_strided_slices_into_strided_views_and_names_a_peer_that_is_gone():
    """A tp slice (every row's middle columns) is read as its rows straight into a strided
    destination; reading from a process that ended fails with its rank named, at once."""
    import subprocess
    import sys

    from hetero.runtime.reshard import cma

    if not cma.usable():
        pytest.skip("this machine does not let a process read another's memory (process_vm_readv)")
    src = torch.arange(6 * 10, dtype=torch.float32).reshape(6, 10)
    part = src[:, 3:7]
    assert cma.runs(part)[0].numel() == 6 and cma.runs(src)[0].numel() == 1
    into = torch.zeros(6, 8)
    view = into[:, 2:6]
    cma._read(os.getpid(), *cma.pair(cma.runs(view), cma.runs(part)))
    assert torch.equal(view, part) and into[:, :2].abs().sum() == 0 and into[:, 6:].abs().sum() == 0
    # the same piece cut at other boundaries on each side still lines up element for element
    flat = torch.empty(24)
    cma._read(os.getpid(), *cma.pair(cma.runs(flat), cma.runs(part)))
    assert torch.equal(flat, part.reshape(-1))
    cube = torch.arange(4 * 5 * 6, dtype=torch.float32).reshape(4, 5, 6)[1:3, :, 2:5]   # rows of a 3-D slice
    out = torch.empty(2, 5, 3)
    cma._read(os.getpid(), *cma.pair(cma.runs(out), cma.runs(cube)))
    assert torch.equal(out, cube)

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()

    store = DictStore()
    store["x/src/1"] = json.dumps({"pid": gone.pid, "pieces": {"0": {"parts": [[part.data_ptr(), [6, 4], [10, 1]]],
                                                                      "step": None}}})
    ex = cma.Exchange(store, "x", 0, {1: gone.pid}, timeout_s=5)
    with pytest.raises(cma.PeerGone) as e:
        ex.receive([(0, 1, [torch.empty(6, 4)])])
    assert e.value.rank == 1
    with pytest.raises(cma.PeerGone, match="process ended"):   # a receiver gone before it read
        cma.Exchange(store, "x", 1, {0: gone.pid}, timeout_s=5).serve({0})


@pytest.mark.parametrize("iov_max,call_bytes", [(1024, 1 << 30), (3, 64)], ids=["as Linux takes", "tiny calls"])
def test_same_host_reads_of_several_parts_go_out_together_in_calls_the_kernel_takes(monkeypatch, iov_max, call_bytes):
    """The parts read from one process (contiguous tensors and strided slices) are gathered into one
    set of ranges and read in as few calls as the kernel takes: with at most ``iov_max`` ranges and
    ``call_bytes`` per call (a range longer than that cut), every byte still lands where it belongs."""
    from hetero.runtime.reshard import cma

    if not cma.usable():
        pytest.skip("this machine does not let a process read another's memory (process_vm_readv)")
    monkeypatch.setattr(cma, "IOV_MAX", iov_max)
    monkeypatch.setattr(cma, "MAX_CALL_BYTES", call_bytes)
    calls, real = [], cma._libc()

    def counted(pid, liov, lcount, riov, rcount, flags):
        got = real(pid, liov, lcount, riov, rcount, flags)
        calls.append((lcount, got))
        return got
    monkeypatch.setattr(cma, "_libc", lambda: counted)
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(100, generator=g)              # one 400-byte range
    table = torch.randn(8, 12, generator=g)
    half = table[:, 6:]                                # a tp slice along dim 1: 8 rows
    empty = torch.empty(0)
    into_whole, into_half, into_empty = torch.zeros(100), torch.zeros(8, 6), torch.zeros(0)
    wide = torch.zeros(8, 10)
    into_strided = wide[:, 2:8]                        # a strided destination for the same slice
    segments = cma.Segments()
    for view, src in ((into_whole, whole), (into_half, half), (into_empty, empty), (into_strided, half)):
        segments.add(view, src.data_ptr(), list(src.shape), list(src.stride()))
    local, remote, lengths = segments.arrays()
    assert int(lengths.sum()) == (100 + 2 * 48) * 4
    assert cma._read(os.getpid(), local, remote, lengths) == (100 + 2 * 48) * 4
    assert all(count <= iov_max and got <= call_bytes for count, got in calls)
    # all four parts in one call; or with tiny calls: ``whole`` cut into six 64-byte pieces, its 16-byte
    # tail with two 24-byte rows, then the other 14 rows two to a call
    assert len(calls) == (1 if iov_max == 1024 else 6 + 1 + 7)
    assert torch.equal(into_whole, whole) and torch.equal(into_half, half) and torch.equal(into_strided, half)
    assert wide[:, :2].abs().sum() == 0 and wide[:, 8:].abs().sum() == 0


IMPORTS_IN_A_REBUILD = r"""
import json, sys
from hetero.runtime.elastic.reconfig import import_training_modules
import_training_modules()
from hetero.runtime.collectives import Collectives
from hetero.runtime.engine import NativeEngine, RunContext
from hetero.runtime.spec import RunSpec
import hetero
spec = RunSpec.load(sys.argv[1])
hetero.load_cluster(spec.cluster)   # as a joining process has, working out its regions
before = set(sys.modules)
ctx = RunContext(spec, 0)   # what LiveReconfig.adopt builds for a rank of the new plan
comm = Collectives.init(0, 1, 30.0, vendors=[r.vendor for r in ctx.layout.ranks], device=ctx.device,
                        device_types=ctx.device_types)
ctx.parallel.create_groups(comm)
NativeEngine(ctx, comm)
print(json.dumps(sorted(m for m in set(sys.modules) - before if m.startswith("hetero"))))
"""


@pytest.mark.timeout(120)
def test_a_rebuild_imports_nothing_that_was_not_imported_ahead(tmp_path):
    """A process joining a run, or a survivor, imports ahead what its rebuild under the new plan uses
    (:func:`~hetero.runtime.elastic.reconfig.import_training_modules`): a module first imported in the
    rebuild (the unified communicator, the memory model) is downtime (docs/elastic.md)."""
    import subprocess
    import sys
    from pathlib import Path

    import hetero
    from _spawn import free_port
    from hetero.runtime import launcher
    from hetero.runtime.spec import RunOptions

    cluster = hetero.load_cluster(local_cluster([1, 0]))
    model = hetero.load_model(str(Path(__file__).resolve().parents[1] / "configs/models/tiny.yaml"))
    plan = hetero.load_plan({"global_batch_size": 4, "micro_batch_size": 1, "schedule": "1f1b",
                             "pipelines": [{"micro_batches": 4, "stages": [{"group": "fast", "layers": [0, model.num_layers]}]}]},
                            cluster, model)
    prepared = launcher.prepare(cluster, model, plan, RunOptions(), run_dir=str(tmp_path / "run"))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", IMPORTS_IN_A_REBUILD, prepared.spec_path], capture_output=True,
                         text=True, timeout=100, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def _blocked_receiver_worker(rank, world, port, group_timeout_s):
    import datetime
    import signal
    import threading
    import time

    import torch.distributed as dist

    from hetero.runtime.elastic.protocol import PEER_LOST_SIGNAL, RECONFIG_ENV
    from hetero.runtime.elastic.reconfig import LiveReconfig

    os.environ[RECONFIG_ENV] = str(port)
    live = LiveReconfig.from_env(rank, world, group_timeout_s)
    live.first_world()
    if rank == 1:   # alive, holding its world: it never sends and never closes its connections
        live.store.wait(["test/done"], datetime.timedelta(seconds=3 * group_timeout_s))
        return None
    # the launcher's signal arrives while the main thread is blocked in Gloo (no Python handler runs)
    threading.Timer(0.5, os.kill, (os.getpid(), getattr(signal, PEER_LOST_SIGNAL))).start()
    t0 = time.monotonic()
    try:
        dist.recv(torch.empty(4), src=1)
        outcome = "received"
    except Exception as e:  # noqa: BLE001 - what ended the wait is the result
        outcome = str(e)
    waited = time.monotonic() - t0
    live.store.set("test/done", "1")   # the coordinator's store is still reachable
    return {"waited": waited, "outcome": outcome, "aborted": live.aborted}


@pytest.mark.slow
def test_a_survivor_blocked_on_a_live_peer_wakes_at_the_launchers_signal():
    """Gloo's abort does not end a receive blocked in C++, and a peer that keeps its groups never
    closes the connection: the waker breaks this rank's connections instead, so the receive fails
    within the grace, not at the group's timeout (the rare survivor that used to check in only at
    the launcher's --timeout)."""
    from hetero.runtime.reshard.live import Coordinator

    coordinator = Coordinator()
    try:
        results = spawn(_blocked_receiver_worker, 2, args=(coordinator.port, 30.0), timeout=120)
    finally:
        coordinator.close()
    got = results[0]
    assert got["outcome"] != "received" and got["aborted"], got
    assert got["waited"] < 5.0, f"the blocked receive waited {got['waited']:.1f} s (the group timeout is 30 s)"
