"""Elastic benchmark: what losing a device, or taking one in, costs, and whether training goes on unchanged.

Model configs/models/tiny.yaml. Each round launches four runs of ``--steps N`` with the same seed:

- failure, clean: configs/clusters/local-cpu.yaml (two emulated vendors, 2 + 2 CPU processes) and
  configs/plans/tiny-local-cpu-replicated.yaml (two replicas of a two-stage pipeline), no failure;
- failure, elastic: the same with ``--elastic --inject-failure K:R`` (rank R, a ``slow`` stage-1 rank,
  dies at step K). The survivors hand off their live state, the planner replans on the 3 devices
  left, and the new plan trains steps K..N;
- join, clean: local-cpu.yaml cut to one ``fast`` device, the whole model on it;
- join, elastic: the same with ``--elastic``; once the worker trains, the cluster file is rewritten
  to the whole local-cpu.yaml (3 devices join). The launcher plans for it while training goes on,
  the rank pauses at the next step boundary and hands off, and the new plan trains the rest.

It prints, per scenario and as medians over the rounds, the downtime split as the summary's
``reconfigurations`` give it (failure: handoff = failure -> every survivor's state written, then
replan; join: replan while training goes on, then handoff = pause request -> state written, which
includes finishing the step under way; restart: new launch -> last rank's state loaded;
reshard_time_s: failure or change -> first step under the new plan), the tokens/s before and after,
and the largest relative difference between the elastic and the clean run's losses
(floating-point reduction order only, when the handoff is exact). Exits 1 when a loss differs by
more than 1e-4 relative. Writes benchmarks/results/elastic.json.

    .venv/bin/python benchmarks/bench_elastic.py [--rounds 3] [--steps 8] [--fail-at 4] [--join-steps 300]

With ``--live``: the in-process path instead (benchmarks/bench_reshard_live.py: a 109M GPT loses a
rank and the survivors reshard rank to rank, against the same transition through
torch.distributed.checkpoint and /dev/shm); writes benchmarks/results/elastic_live.json.

    .venv/bin/python benchmarks/bench_elastic.py --live [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "configs/clusters/local-cpu.yaml"
MODEL = ROOT / "configs/models/tiny.yaml"
PLAN = ROOT / "configs/plans/tiny-local-cpu-replicated.yaml"
FAILED_RANK = 3
TOLERANCE = 1e-4


def _cmd(cluster: Path, plan: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hetero", "launch", "--cluster", str(cluster), "--model", str(MODEL),
            "--plan", str(plan), "--steps", str(steps), "--lr", "3e-3", "--seed", "0", "--timeout", "20",
            "--quiet", "--summary", str(out), *extra]


def launch(out: Path, steps: int, *extra: str, cluster: Path = CLUSTER, plan: Path = PLAN) -> dict:
    proc = subprocess.run(_cmd(cluster, plan, out, steps, *extra), capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    if proc.returncode:
        sys.exit(f"launch failed ({' '.join(extra) or 'clean'}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def launch_and_join(tmp: Path, out: Path, steps: int, start: Path, plan: Path) -> dict:
    """An elastic launch on ``start`` (a copy of local-cpu.yaml cut to one device); once its rank
    trains, the copy becomes the whole local-cpu.yaml."""
    run_dir = tmp / f"run-{out.stem}"
    proc = subprocess.Popen(_cmd(start, plan, out, steps, "--elastic", "--run-dir", str(run_dir)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        marker = run_dir / "attempt0" / "rank0.training"
        deadline = time.time() + 120
        while not marker.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.5)   # a few steps in: the pause then waits for a step under way, as it would
        start.write_text(CLUSTER.read_text())
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if proc.returncode:
        sys.exit(f"launch failed (join):\n{err[-3000:]}")
    return json.loads(out.read_text())


def one_device(tmp: Path) -> tuple[Path, Path]:
    """local-cpu.yaml cut to one ``fast`` device, and a plan with the whole model on it."""
    cluster = yaml.safe_load(CLUSTER.read_text())
    cluster["groups"] = [{**cluster["groups"][0], "devices_per_node": 1}]
    plan = yaml.safe_load(PLAN.read_text())
    plan["pipelines"] = [{"micro_batches": plan["global_batch_size"] // plan["micro_batch_size"],
                          "stages": [{"group": "fast", "layers": [0, 4]}]}]
    (tmp / "one.yaml").write_text(yaml.safe_dump(cluster))
    (tmp / "one-plan.yaml").write_text(yaml.safe_dump(plan))
    return tmp / "one.yaml", tmp / "one-plan.yaml"


TIMES = ("handoff_time_s", "replan_time_s", "restart_time_s", "reshard_time_s")


def row(i: int, clean: dict, elastic: dict, before: str) -> dict:
    (rc,) = elastic["reconfigurations"]
    diffs = [abs(a - b) / abs(b) for a, b in zip(elastic["losses"], clean["losses"])]
    first = rc["step"] - 1          # the steps before the reconfiguration: the old plan's
    out = {"round": i, "max_rel_loss_diff": max(diffs), "steps": elastic["steps"],
           **{k: rc[k] for k in ("step", "world_size_before", "world_size_after", *TIMES)},
           "new_plan_predicted_tokens_per_s": rc["predicted_tokens_per_s"],
           "tokens_per_s_after": elastic["tokens_per_s"], "tokens_per_s_clean": clean["tokens_per_s"]}
    print(f"round {i} {before}: losses max rel diff {out['max_rel_loss_diff']:.1e}, reconfigured before step "
          f"{rc['step']} (after {first} steps), reshard {rc['reshard_time_s']:.2f} s (handoff "
          f"{rc['handoff_time_s']:.2f}, replan {rc['replan_time_s']:.2f}, restart {rc['restart_time_s']:.2f}), "
          f"world {rc['world_size_before']} -> {rc['world_size_after']}")
    return out


def medians(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in (*TIMES, "tokens_per_s_after", "tokens_per_s_clean")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fail-at", type=int, default=4)
    ap.add_argument("--join-steps", type=int, default=300,
                    help="steps of the join runs: enough that the change lands mid-run (default 300)")
    ap.add_argument("--live", action="store_true",
                    help="the in-process reshard of a 109M GPT instead (benchmarks/bench_reshard_live.py)")
    args = ap.parse_args()
    if args.live:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import bench_reshard_live

        with tempfile.TemporaryDirectory() as tmp_name:
            live = bench_reshard_live.run(args.rounds, Path(tmp_name))
        out = ROOT / "benchmarks/results/elastic_live.json"
        out.write_text(json.dumps(live, indent=2) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")
        return 0 if live["bytes_exact"] else 1
    failure, join = [], []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for i in range(args.rounds):
            clean = launch(tmp / f"clean{i}.json", args.steps)
            elastic = launch(tmp / f"elastic{i}.json", args.steps, "--elastic",
                             "--inject-failure", f"{args.fail_at}:{FAILED_RANK}")
            failure.append(row(i, clean, elastic, "failure"))
            start, plan = one_device(tmp)
            clean = launch(tmp / f"join-clean{i}.json", args.join_steps, cluster=start, plan=plan)
            elastic = launch_and_join(tmp, tmp / f"join{i}.json", args.join_steps, start, plan)
            join.append(row(i, clean, elastic, "join"))
    worst = max(r["max_rel_loss_diff"] for r in failure + join)
    result = {"method": __doc__.strip().splitlines()[0], "steps": args.steps, "fail_at": args.fail_at,
              "failed_rank": FAILED_RANK, "join_steps": args.join_steps, "rounds": failure, "join_rounds": join,
              "medians": medians(failure), "join_medians": medians(join), "max_rel_loss_diff": worst}
    print(f"\nmedians over {args.rounds} rounds")
    print(f"  failure: rank {FAILED_RANK} lost at step {args.fail_at} of {args.steps}, 4 -> 3 devices")
    for k, v in result["medians"].items():
        print(f"    {k:22s} {v:10.2f}")
    print(f"  join: 1 -> 4 devices (the cluster file rewritten mid-run), {args.join_steps} steps")
    for k, v in result["join_medians"].items():
        print(f"    {k:22s} {v:10.2f}")
    print(f"  largest relative loss difference vs the clean runs: {worst:.1e} (limit {TOLERANCE:g})")
    out = ROOT / "benchmarks/results/elastic.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
