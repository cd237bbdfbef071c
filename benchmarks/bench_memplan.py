"""Fragmentation of the shipped example plans' stages: PyTorch's caching allocator vs a planned arena.

    python benchmarks/bench_memplan.py [--quick]

Method: for every example in configs/examples.yaml (``--quick``: the local CPU ones only), the first
and the last physical stage of pipeline 0 are recorded for two training steps on fake tensors
(hetero.memplan.record: the runtime's stage model, schedule order, autocast and AdamW), then the
trace's lower bound (most bytes live at once), the caching allocator's replayed reservation and
the greedy-by-size arena are computed (hetero.memplan.memory_plan). Printed: per stage the events,
the lower bound, both fragmentations (1 - lower bound / bytes held), the reduction, and the seconds
spent recording and planning (one run each: these are the tool's own costs, not a measured speed).
Writes benchmarks/results/memplan.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

import hetero  # noqa: E402
from hetero.memplan import memory_plan  # noqa: E402
from hetero.memplan.record import record_stage  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the examples on local CPU clusters")
    args = ap.parse_args()
    examples = yaml.safe_load((ROOT / "configs/examples.yaml").read_text())["examples"]
    if args.quick:
        examples = [e for e in examples if e["cluster"].startswith("local-cpu")]
    rows = []
    print(f"{'plan':<32} {'stage':>5} {'events':>8} {'lower bound':>12} {'caching frag':>12} {'planned frag':>12} "
          f"{'reduction':>9} {'record s':>8} {'plan s':>7}")
    for e in examples:
        model = hetero.load_model(ROOT / f"configs/models/{e['model']}.yaml")
        plan = hetero.load_plan(ROOT / f"configs/plans/{e['plan']}.yaml")
        stages = len(plan.physical_stages(plan.pipelines[0]))
        for stage in sorted({0, stages - 1}):
            t0 = time.perf_counter()
            trace = record_stage(model, plan, 0, stage)
            t1 = time.perf_counter()
            report = memory_plan(trace)
            t2 = time.perf_counter()
            c, p = report["caching_allocator"], report["planned"]
            rows.append({"plan": e["plan"], "pipeline": 0, "stage": stage, **report,
                         "record_s": t1 - t0, "plan_s": t2 - t1})
            print(f"{e['plan']:<32} {stage:>5} {report['events']:>8,} {report['lower_bound_bytes'] / 2**30:>10.3f}G "
                  f"{c['fragmentation']:>12.1%} {p['fragmentation']:>12.2%} {report['fragmentation_reduction']:>9.1%} "
                  f"{t1 - t0:>8.1f} {t2 - t1:>7.1f}", flush=True)
    out = ROOT / "benchmarks/results" / ("memplan_quick.json" if args.quick else "memplan.json")
    out.write_text(json.dumps(rows, indent=2))
    worse = [r for r in rows if r["planned"]["arena_bytes"] > r["caching_allocator"]["reserved_bytes"]]
    print(f"planned arena above the caching allocator's reservation: {len(worse)} of {len(rows)} stages")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
