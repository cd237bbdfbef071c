"""Pipeline schedules, predicted vs measured: GPipe, 1F1B and interleaved 1F1B on the emulated pair.

Cluster: configs/clusters/local-cpu-pair.yaml (one `fast` CPU process, one 2x slower `slow`
process; one core each). Model: configs/models/small-gpt.yaml (6 layers). Global batch 16 in
micro-batches of 2 (8 per step), so the pipeline bubble is a visible share of the step.

- gpipe / 1f1b: two stages, layers 4 | 2 (the split proportional to speed);
- interleaved: the same devices with two model chunks each, layers 2 | 1 | 2 | 1 (virtual stage k
  on device k mod 2); the runtime executes the order the predictor simulates.

Each plan is launched ``--rounds`` times (plans alternated, so background load spreads over all);
measured = median of the pooled steady steps (first step of each launch dropped). Predicted =
``hetero.predict`` with this machine's CPU profile (as bench_runtime.py). The schedule's effect is
compared as ratios within this run: each schedule's step time over 1F1B's, predicted and
measured. Prints a table and writes benchmarks/results/schedules.json.

Seen when this was written (an Intel 2-core machine, 2 rounds): interleaving predicted to save 4%
and measured to save nothing. The per-rank summaries showed why: on the slow device the compute of
one micro-batch (both chunks) was 7% more than 1F1B's one call over the same layers (fast device:
2%), while a one-block stage timed alone has no fixed per-call cost (1 and 4 blocks: a negative
intercept); the alternation between chunks cost time the operator-based prediction does not see.
On a later machine (AMD EPYC, 2 cores) interleaving measured 0.965 (3 rounds) and 0.977 (5 rounds)
of 1F1B's step against 0.958 predicted, with GPipe at 0.950 / 0.979 against 1.000: run to run, the
ratios move by 2-5% here, as much as the effect measured.

    .venv/bin/python benchmarks/bench_schedules.py [--steps 6] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_runtime import GBS, MBS, MODEL, bench_cluster, ensure_profile, launch  # noqa: E402

TWO_STAGES = [{"group": "fast", "layers": [0, 4]}, {"group": "slow", "layers": [4, 6]}]
INTERLEAVED = [{"group": "fast", "layers": [0, 2]}, {"group": "slow", "layers": [2, 3]},
               {"group": "fast", "layers": [3, 5]}, {"group": "slow", "layers": [5, 6]}]


def plans() -> dict[str, dict]:
    base = {"global_batch_size": GBS, "micro_batch_size": MBS}
    pipe = lambda stages: [{"micro_batches": GBS // MBS, "stages": stages}]  # noqa: E731
    return {"gpipe": {**base, "schedule": "gpipe", "pipelines": pipe(TWO_STAGES)},
            "1f1b": {**base, "schedule": "1f1b", "pipelines": pipe(TWO_STAGES)},
            "interleaved": {**base, "schedule": "interleaved", "interleave": 2, "pipelines": pipe(INTERLEAVED)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/schedules.json"))
    args = ap.parse_args(argv)
    import hetero
    from rich.console import Console
    from rich.table import Table

    t0 = time.time()
    profile = ensure_profile()
    cluster_d = bench_cluster()
    cluster, model = hetero.load_cluster(cluster_d), hetero.load_model(MODEL)
    runs: dict[str, list[dict]] = {name: [] for name in plans()}
    with tempfile.TemporaryDirectory(prefix="bench-schedules-") as tmp:
        for r in range(args.rounds):
            for name, plan in plans().items():
                runs[name].append(launch(Path(tmp), f"{name}{r}", cluster_d, plan, args.steps))
    rows = {}
    for name, plan in plans().items():
        steps = [t for s in runs[name] for t in s["iteration_times_s"][1:]]
        pred = hetero.predict(cluster, model, hetero.load_plan(plan))
        rows[name] = {"measured_s": statistics.median(steps), "steps": steps,
                      "predicted_s": pred.iteration_time_s, "losses": runs[name][0]["losses"]}
    ref = rows["1f1b"]
    for r in rows.values():
        r["measured_vs_1f1b"] = r["measured_s"] / ref["measured_s"]
        r["predicted_vs_1f1b"] = r["predicted_s"] / ref["predicted_s"]
        r["prediction_error"] = r["predicted_s"] / r["measured_s"] - 1
    out = Console(highlight=False)
    table = Table(title=f"schedules on {cluster_d['name']} ({MODEL['name']}, gbs {GBS}, mbs {MBS}, "
                        f"{args.rounds} x {args.steps} steps)")
    for col in ("schedule", "measured ms", "predicted ms", "error", "measured / 1f1b", "predicted / 1f1b"):
        table.add_column(col, justify="right")
    for name, r in rows.items():
        table.add_row(name, f"{r['measured_s'] * 1e3:.1f}", f"{r['predicted_s'] * 1e3:.1f}",
                      f"{r['prediction_error']:+.1%}", f"{r['measured_vs_1f1b']:.3f}", f"{r['predicted_vs_1f1b']:.3f}")
    out.print(table)
    result = {"method": __doc__, "cluster": cluster_d["name"], "model": MODEL, "plans": plans(), "rows": rows,
              "profile": profile, "wall_s": time.time() - t0}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    out.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
