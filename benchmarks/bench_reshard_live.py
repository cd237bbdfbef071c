"""Live reshard benchmark: a 109M-parameter GPT loses rank 3 and the survivors reshard in-process.

Model: GPT, 8 layers, hidden 1024, 16 heads, vocab 8192, seq 64, tied embeddings (109M parameters;
1.3 GB of fp32 parameters + AdamW moments per replica). Cluster configs/clusters/local-cpu.yaml
(two emulated vendors, 2 + 2 CPU processes), plan: two replicas of a two-stage pipeline (layers
0-3 on ``fast``, 4-7 on ``slow``). Each round:

1. four worker processes build their stage and take one AdamW step (so every parameter has its
   moments and step), all in one Gloo world on this process's store;
2. rank 3 exits without a word (the lost device; its time of death is put in the store);
3. each survivor's pending receive from rank 3 fails (detect_s: death -> error; a receive, since on
   Gloo a rank blocked in a ring all-reduce behind a survivor is not woken), it checks in under the next
   generation, and this process (the coordinator: no tensor) replans on the three devices left with
   the planner (hetero.runtime.elastic.policy.replan; made for every possible single loss before the failure,
   while the workers set up), publishes the members and the plan (agree_replan_s: a survivor's
   check-in -> decision received), the survivors build the new world in-process (regroup_s),
   exchange exactly the intersections (transfer_s; on this one machine the receivers read the
   senders' memory, hetero.runtime.reshard.cma, unless HETERO_RESHARD_TRANSPORT=p2p) and rebuild
   their stage and AdamW (rebuild_s);
   downtime = death -> last survivor's stage rebuilt (ready for its first step);
4. the same transition through torch.distributed.checkpoint: the three survivors dcp.save their old
   state to /dev/shm and each new rank dcp.loads its stage (dcp_s = save + load, in the same world).

Both paths run with the host allocator of the runtime's workers on a CPU device
(hetero.runtime.host_memory: large tensors in transparent huge pages, freed memory stays mapped;
/dev/shm's files take whatever the kernel's shmem huge-page setting gives them) and write into
mapped memory: before the failure each worker writes and frees as much as its exchange would allocate after any single loss
(what the runtime's launcher tells its ranks to reserve), and before DCP as much as its load targets
take. dcp_save_s times the save alone.

Reports medians over the rounds, the bytes moved against the transition's intersection volume, the
predicted transfer time (hetero.runtime.reshard.predict, from local-cpu.yaml's 1.5 GB/s links), the
coordinator's peak RSS (this process), and that the survivors kept their process ids.
"""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"name": "gpt-109m", "architecture": "gpt", "num_layers": 8, "hidden_size": 1024, "num_attention_heads": 16,
         "vocab_size": 8192, "seq_length": 64, "dtype": "fp32", "tie_embeddings": True}
PLAN = {"global_batch_size": 8, "micro_batch_size": 1, "schedule": "1f1b", "recompute": "none", "zero_stage": 0,
        "pipelines": [{"replicas": 2, "micro_batches": 4, "stages": [{"group": "fast", "layers": [0, 4]},
                                                                     {"group": "slow", "layers": [4, 8]}]}]}
LOST = 3
TIMES = ("detect_s", "agree_replan_s", "regroup_s", "transfer_s", "rebuild_s", "downtime_s", "dcp_s", "dcp_save_s")


def _worker(rank: int, port: int, cluster: dict, out: str, shm: str, reserve: int, model_d: dict = MODEL,
            plan_d: dict = PLAN, lost: tuple[int, ...] = (LOST,)) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import hetero
    from hetero.layout import build_layout
    from hetero.runtime.grads import make_optimizer
    from hetero.runtime.host_memory import keep_freed_host_memory
    from hetero.runtime.model import build_stage
    from hetero.runtime.reshard import live as L
    from hetero.runtime.reshard.space import ParameterSpace
    from hetero.runtime.reshard.transfer import live_state, rebuild_stage

    torch.set_num_threads(1)
    keep_freed_host_memory()   # as the runtime's workers on a CPU device: for both paths below alike
    store = L.connect(port, 120)
    model, plan = hetero.load_model(model_d), hetero.load_plan(plan_d)
    layout = build_layout(hetero.load_cluster(cluster), plan)
    L.regroup(store, 0, rank, layout.world_size, 120)
    info = layout.ranks[rank]
    module = build_stage(model, info.layers, *info.holds_ends(plan), seed=0, chunks=info.chunk_layers(plan))
    optimizer = make_optimizer(module.parameters(), 1e-3, 0.0)
    for name, p in module.named_parameters():   # one step: the same "gradient" on every replica
        g = torch.Generator().manual_seed(hash(name) % (2 ** 31))
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    pid = os.getpid()
    # what the runtime's worker does at a step boundary (LiveReconfig.reserve_ahead): as much host
    # memory as its exchange would allocate after any single loss, written once and freed, so the
    # exchange writes into mapped memory
    torch.empty(reserve, dtype=torch.uint8).fill_(0)
    dist.barrier()
    if rank in lost:
        if rank == lost[0]:
            store.set("died_at", repr(time.time()))
        os._exit(1)
    try:   # the survivors' next message from the lost rank never comes: its connection closes
        dist.recv(torch.empty(1), src=lost[0])
    except RuntimeError:
        pass
    t_detect = time.time()
    live = live_state(module, optimizer, ParameterSpace(model).rank_regions(plan, info))
    place = L.reconfigure(store, 1, rank, live, timeout_s=120, applied_step=3)
    t0 = time.perf_counter()
    if place.member:   # a survivor the new plan leaves out served its state and is done
        new_module, new_optimizer = rebuild_stage(model, place.plan, place.info, place.state, mesh=place.mesh)
        del new_module, new_optimizer
    rebuild_s = time.perf_counter() - t0
    t_ready = time.time()
    del place.state
    # the same transition through torch.distributed.checkpoint and /dev/shm, in the same world; its
    # load writes into mapped memory, as the live exchange does (the runtime reserves that memory
    # ahead, LiveReconfig.reserve_ahead): as much as its targets take is written once and freed first
    space = ParameterSpace(model)
    shapes = space.rank_regions(place.plan, place.info) if place.member else {}
    torch.empty(sum(math.prod(b - a for a, b in box) for box in shapes.values()) * 12, dtype=torch.uint8).fill_(0)
    dist.barrier()
    t0 = time.perf_counter()
    saved = {}
    for name, st in live.items():
        for k, v in st.tensors.items():
            saved[f"{k}/{name}"] = v
    dcp.save(saved, checkpoint_id=shm)
    dist.barrier()
    dcp_save_s = time.perf_counter() - t0

    def target(name, box):   # a tp slice is a DTensor shard, which dcp reads out of the full tensor
        local = torch.empty(tuple(b - a for a, b in box))
        dim, full = space.split_dim[name], space.shapes[name]
        if place.info.tp_size == 1 or dim is None:
            return local
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(local, place.mesh, [Shard(dim)], run_check=False, shape=torch.Size(full),
                                  stride=torch.empty(full, device="meta").stride())
    wanted = {f"{k}/{name}": target(name, box) for name, box in shapes.items()
              for k in ("param", "exp_avg", "exp_avg_sq")}
    dcp.load(wanted, checkpoint_id=shm)
    dist.barrier()
    dcp_s = time.perf_counter() - t0
    died_at = float(store.get("died_at"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "new_rank": place.rank, "member": place.member, "pid_before": pid, "pid_after": os.getpid(),
                   "detect_s": t_detect - died_at, **place.timings, "rebuild_s": rebuild_s,
                   "ready_after_s": t_ready - died_at, "dcp_s": dcp_s, "dcp_save_s": dcp_save_s, "bytes_sent": place.stats.bytes_sent,
                   "bytes_received": place.stats.bytes_received, "bytes_local": place.stats.bytes_local,
                   "messages": place.stats.messages, "intersection_bytes": place.transition.intersection_bytes},
                  f)
    dist.barrier()
    os._exit(0)


def _reserves(cluster, layout, model, plan, ahead: dict) -> dict[int, int]:
    """Old rank -> the most state its exchange allocates after any loss planned ``ahead`` (the lost
    ranks, a frozenset -> the cluster left and its plan; what the runtime's launcher publishes for its
    ranks to reserve)."""
    from hetero.layout import build_layout
    from hetero.runtime.elastic.plans import assign_ranks
    from hetero.runtime.reshard.live import exchange_ranks, transition_between
    from hetero.runtime.reshard.space import ParameterSpace
    from hetero.runtime.reshard.transfer import reserve_bytes

    space = ParameterSpace(model)
    losses = []
    for lost, (left, result) in ahead.items():
        new_layout = build_layout(left, result.plan)
        survivors = [r for r in range(len(layout.ranks)) if r not in lost]
        members = assign_ranks(layout, new_layout, survivors)
        transition = transition_between(space, plan, layout, space.layout_regions(result.plan, new_layout),
                                        exchange_ranks(members, survivors), new_layout)
        if not transition.missing:
            losses.append((members, transition, result.plan, new_layout))
    return reserve_bytes(space, space.layout_regions(plan, layout), losses)


def one_round(i: int, tmp: Path, cluster_d: dict | None = None, model_d: dict = MODEL, plan_d: dict = PLAN,
              lost: tuple[int, ...] = (LOST,)) -> dict:
    """One round of the module docstring's steps; by default local-cpu.yaml and :data:`PLAN` losing rank
    :data:`LOST`; ``cluster_d``, ``model_d``, ``plan_d``: another cluster, model and plan (dicts),
    ``lost``: the ranks lost at once (the first one's death times the detection)."""
    import yaml

    import hetero
    from hetero.layout import build_layout
    from hetero.runtime.elastic.plans import assign_ranks
    from hetero.runtime.elastic.policy import replan
    from hetero.runtime.host_memory import huge_pages_env
    from hetero.runtime.reshard.live import Coordinator, choose_transport, decision_for, exchange_ranks
    from hetero.runtime.reshard.predict import predict_transfer_s
    from hetero.runtime.reshard.space import ParameterSpace
    from hetero.runtime.reshard.transition import plan_transition
    from hetero.specs.cluster import without_devices

    if cluster_d is None:
        cluster_d = yaml.safe_load((ROOT / "configs/clusters/local-cpu.yaml").read_text())
    cluster, model, plan = hetero.load_cluster(cluster_d), hetero.load_model(model_d), hetero.load_plan(plan_d)
    layout = build_layout(cluster, plan)
    world_size = layout.world_size
    out, shm = tmp / f"round{i}", f"/dev/shm/hetero-bench-reshard-{os.getpid()}-{i}"
    out.mkdir()
    # the plan for each single loss (and for ``lost``), made while the workers set up and train (the
    # coordinator's replan after a failure is then a look-up)
    t0 = time.perf_counter()
    ahead = {}
    for gone in {*(frozenset([r]) for r in range(world_size)), frozenset(lost)}:
        left = without_devices(cluster, [layout.ranks[r] for r in sorted(gone)])
        ahead[gone] = (left, replan(left, model, plan))
    plan_ahead_s = time.perf_counter() - t0
    reserve = _reserves(cluster, layout, model, plan, ahead)
    coordinator = Coordinator(timeout_s=120)
    ctx = mp.get_context("spawn")
    # the workers start with the environment the runtime's launcher gives a CPU device's (huge pages)
    os.environ.update(huge_pages_env())
    procs = [ctx.Process(target=_worker, args=(r, coordinator.port, cluster_d, str(out), shm, reserve.get(r, 0),
                                               model_d, plan_d, tuple(lost)), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        while any(procs[r].is_alive() for r in lost):   # the launcher sees the lost workers' processes end
            time.sleep(0.002)
        alive = [r for r in range(world_size) if procs[r].is_alive()]
        got = coordinator.await_survivors(1, alive, timeout_s=60)
        t0 = time.perf_counter()
        left, result = ahead[frozenset(lost)]
        new_layout = build_layout(left, result.plan)
        members = assign_ranks(layout, new_layout, sorted(got))
        coordinator.publish(1, members, decision_for(model_d, (cluster_d, plan_d), (left.to_dict(), result.plan.to_dict()),
                                                     sorted(got), step=3, transport=choose_transport(got)))
        replan_s = time.perf_counter() - t0
        # the same transition as the workers compute it, for the prediction (survivors the plan leaves
        # out take the ranks after its world)
        world = exchange_ranks(members, sorted(got))
        space = ParameterSpace(model)
        transition = plan_transition({world[r]: space.rank_regions(plan, layout.ranks[r]) for r in world},
                                     space.layout_regions(result.plan, new_layout),
                                     {world[r]: layout.ranks[r].vendor for r in world})
        predicted = predict_transfer_s(transition, cluster, {world[r]: layout.ranks[r] for r in world})["transfer_s"]
        for p in procs:
            p.join(600)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        shutil.rmtree(shm, ignore_errors=True)
        coordinator.close()
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in sorted(got)]
    row = {"round": i, "new_plan": result.plan.to_dict(), "members": members, "coordinator_replan_s": replan_s,
           "transport": choose_transport(got),
           "plans_made_ahead_s": plan_ahead_s,
           "predicted_transfer_s": predicted,
           **{k: max(r[k] for r in ranks) for k in ("detect_s", "agree_replan_s", "regroup_s", "transfer_s",
                                                    "rebuild_s", "dcp_s", "dcp_save_s")},
           "downtime_s": max(r["ready_after_s"] for r in ranks),
           "bytes_moved": sum(r["bytes_sent"] for r in ranks), "bytes_received": sum(r["bytes_received"] for r in ranks),
           "intersection_bytes": ranks[0]["intersection_bytes"], "bytes_kept_local": sum(r["bytes_local"] for r in ranks),
           "pids_kept": all(r["pid_before"] == r["pid_after"] for r in ranks)}
    print(f"round {i}: {world_size} -> {len(members)} ranks, downtime {row['downtime_s']:.2f} s (detect {row['detect_s']:.3f}, "
          f"agree+replan {row['agree_replan_s']:.2f}, regroup {row['regroup_s']:.2f}, transfer {row['transfer_s']:.2f} "
          f"[predicted {predicted:.2f}], rebuild {row['rebuild_s']:.2f}); {row['bytes_moved'] / 1e6:.0f} MB moved "
          f"(intersection {row['intersection_bytes'] / 1e6:.0f} MB, kept {row['bytes_kept_local'] / 1e6:.0f} MB); "
          f"dcp via /dev/shm {row['dcp_s']:.2f} s (save {row['dcp_save_s']:.2f}); pids kept {row['pids_kept']}", flush=True)
    return row


def run(rounds: int, tmp: Path) -> dict:
    rows = [one_round(i, tmp) for i in range(rounds)]
    med = {k: statistics.median(r[k] for r in rows) for k in (*TIMES, "predicted_transfer_s")}
    med["dcp_over_transfer"] = statistics.median(r["dcp_s"] / r["transfer_s"] for r in rows)
    med["dcp_over_downtime"] = statistics.median(r["dcp_s"] / r["downtime_s"] for r in rows)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    sizes = sorted({len(r["members"]) for r in rows})
    print(f"\nlive reshard, medians over {rounds} rounds (109M GPT, rank {LOST} lost, 4 -> "
          f"{'/'.join(map(str, sizes))} ranks in the new plan):")
    for k, v in med.items():
        print(f"    {k:22s} {v:10.3f}")
    print(f"    coordinator peak RSS   {rss_mb:10.0f} MB")
    exact = all(r["bytes_moved"] == r["bytes_received"] == r["intersection_bytes"] for r in rows)
    print(f"    bytes moved == intersection volume in every round: {exact}; survivors kept their pids: "
          f"{all(r['pids_kept'] for r in rows)}")
    return {"method": __doc__.strip(), "model": MODEL, "plan": PLAN, "lost_rank": LOST, "rounds": rows,
            "medians": med, "coordinator_peak_rss_mb": rss_mb, "bytes_exact": exact,
            "machine": f"{os.cpu_count()} cores, shared with other jobs while measured"}


if __name__ == "__main__":
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as t:
        result = run(args.rounds, Path(t))
    path = ROOT / "benchmarks/results/elastic_live.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    sys.exit(0 if result["bytes_exact"] else 1)
