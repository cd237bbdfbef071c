"""Launch start-up benchmark: workers forked from their node launcher against fresh interpreters.

A one-step ``hetero launch`` of configs/models/tiny.yaml is nearly all start-up and shut-down, the
cost every short run, every test launch and every restart pays. Two plans on
configs/clusters/local-cpu.yaml:

- ``1 slot``: two replicas of the whole model on the ``fast`` group (one node launcher, 2 workers);
- ``2 slots``: a two-stage pipeline over ``fast`` and ``slow`` (two node launchers, one per vendor).

Each plan is launched with ``HETERO_WORKER_START=fork`` (the default for emulated devices: the node
launcher imports torch and the runtime once and forks its workers) and ``=spawn`` (each worker a
fresh ``python -m hetero.runtime.worker``), alternating, ``--rounds`` times each; the wall time of
the ``hetero launch`` process and the CPU time of all its processes (user + system, from the
children's rusage). Reports medians and the fork / spawn ratio of the medians; writes
benchmarks/results/launch_start.json.

    .venv/bin/python benchmarks/bench_launch_start.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANS = {
    "1 slot": {"global_batch_size": 4, "micro_batch_size": 1,
               "pipelines": [{"replicas": 2, "micro_batches": 2, "stages": [{"group": "fast", "layers": [0, 4]}]}]},
    "2 slots": {"global_batch_size": 4, "micro_batch_size": 1,
                "pipelines": [{"micro_batches": 4, "stages": [{"group": "fast", "layers": [0, 2]},
                                                              {"group": "slow", "layers": [2, 4]}]}]},
}


def one_launch(tmp: Path, plan_path: Path, start: str) -> tuple[float, float]:
    """(wall s, CPU s of every process of the launch) of one one-step launch."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hetero", "launch", "--cluster",
                           str(ROOT / "configs/clusters/local-cpu.yaml"), "--model", str(ROOT / "configs/models/tiny.yaml"),
                           "--plan", str(plan_path), "--steps", "1", "--quiet"],
                          capture_output=True, text=True, cwd=tmp, timeout=300,
                          env={**os.environ, "HETERO_WORKER_START": start})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"launch ({start}) failed:\n{proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    import yaml

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for name, plan in PLANS.items():
            path = tmp / f"{name.replace(' ', '-')}.yaml"
            path.write_text(yaml.safe_dump(plan))
            one_launch(tmp, path, "fork")   # warm the page cache; not counted
            runs = {"fork": [], "spawn": []}
            for _ in range(args.rounds):
                for start in runs:
                    runs[start].append(one_launch(tmp, path, start))
            med = {s: {"wall_s": statistics.median(w for w, _ in r), "cpu_s": statistics.median(c for _, c in r)}
                   for s, r in runs.items()}
            rows[name] = {"runs": {s: [{"wall_s": w, "cpu_s": c} for w, c in r] for s, r in runs.items()},
                          "medians": med, "fork_over_spawn_wall": med["fork"]["wall_s"] / med["spawn"]["wall_s"]}
            print(f"{name:8s} fork {med['fork']['wall_s']:.2f} s wall ({med['fork']['cpu_s']:.1f} s CPU), "
                  f"spawn {med['spawn']['wall_s']:.2f} s wall ({med['spawn']['cpu_s']:.1f} s CPU): "
                  f"fork / spawn {rows[name]['fork_over_spawn_wall']:.2f}", flush=True)
    out = {"method": __doc__.strip(), "rounds": args.rounds, "plans": PLANS, "results": rows,
           "machine": f"{os.cpu_count()} cores", "load_average_after": os.getloadavg()}
    path = ROOT / "benchmarks/results/launch_start.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
