"""Elastic benchmark: what losing a device costs, and whether training goes on unchanged.

Cluster configs/clusters/local-cpu.yaml (two emulated vendors, 2 + 2 CPU processes), model
configs/models/tiny.yaml, plan configs/plans/tiny-local-cpu-replicated.yaml (two replicas of a
two-stage pipeline). Each round launches two runs of ``--steps N`` with the same seed:

- clean: no failure;
- elastic: ``--elastic --inject-failure K:R`` (rank R, a ``slow`` stage-1 rank, dies at step K). The
  survivors hand off their live state, the planner replans on the 3 devices left, and the new plan
  trains steps K..N.

It prints, as medians over the rounds, the downtime split as the summary's ``reconfigurations``
give it (handoff: failure -> every survivor's state written; replan; restart: new launch -> last
rank's state loaded; reshard_time_s: the sum, failure -> first step under the new plan), and the
largest relative difference between the two runs' losses (floating-point reduction order only,
when the handoff is exact). Exits 1 when a loss differs by more than 1e-4 relative. Writes
benchmarks/results/elastic.json.

    .venv/bin/python benchmarks/bench_elastic.py [--rounds 3] [--steps 8] [--fail-at 4]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "configs/clusters/local-cpu.yaml"
MODEL = ROOT / "configs/models/tiny.yaml"
PLAN = ROOT / "configs/plans/tiny-local-cpu-replicated.yaml"
FAILED_RANK = 3
TOLERANCE = 1e-4


def launch(out: Path, steps: int, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "hetero", "launch", "--cluster", str(CLUSTER), "--model", str(MODEL),
           "--plan", str(PLAN), "--steps", str(steps), "--lr", "3e-3", "--seed", "0", "--timeout", "20",
           "--quiet", "--summary", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    if proc.returncode:
        sys.exit(f"launch failed ({' '.join(extra) or 'clean'}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fail-at", type=int, default=4)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            clean = launch(Path(tmp) / f"clean{i}.json", args.steps)
            elastic = launch(Path(tmp) / f"elastic{i}.json", args.steps, "--elastic",
                             "--inject-failure", f"{args.fail_at}:{FAILED_RANK}")
            (rc,) = elastic["reconfigurations"]
            diffs = [abs(a - b) / abs(b) for a, b in zip(elastic["losses"], clean["losses"])]
            rows.append({"round": i, "max_rel_loss_diff": max(diffs), "steps": elastic["steps"],
                         **{k: rc[k] for k in ("step", "world_size_before", "world_size_after", "handoff_time_s",
                                               "replan_time_s", "restart_time_s", "reshard_time_s")},
                         "new_plan_predicted_tokens_per_s": rc["predicted_tokens_per_s"],
                         "tokens_per_s_after": elastic["tokens_per_s"], "tokens_per_s_clean": clean["tokens_per_s"]})
            print(f"round {i}: losses max rel diff {rows[-1]['max_rel_loss_diff']:.1e}, reshard "
                  f"{rc['reshard_time_s']:.2f} s (handoff {rc['handoff_time_s']:.2f}, replan {rc['replan_time_s']:.2f}, "
                  f"restart {rc['restart_time_s']:.2f}), world {rc['world_size_before']} -> {rc['world_size_after']}")
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("handoff_time_s", "replan_time_s", "restart_time_s", "reshard_time_s",
                     "tokens_per_s_after", "tokens_per_s_clean")}
    worst = max(r["max_rel_loss_diff"] for r in rows)
    print(f"\nmedians over {args.rounds} rounds: failure at step {args.fail_at} of {args.steps} (rank {FAILED_RANK})")
    for k, v in med.items():
        print(f"  {k:22s} {v:10.2f}")
    print(f"  largest relative loss difference vs the clean run: {worst:.1e} (limit {TOLERANCE:g})")
    out = ROOT / "benchmarks/results/elastic.json"
    out.write_text(json.dumps({"method": __doc__.strip().splitlines()[0], "steps": args.steps,
                               "fail_at": args.fail_at, "failed_rank": FAILED_RANK, "rounds": rows,
                               "medians": med, "max_rel_loss_diff": worst}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
