"""Planner search time vs cluster size: four device types (A100, H100, MI250X, Ascend-910B), llama2-70b.

    python benchmarks/bench_planner_scale.py [--sizes 64 128 ... 4096] [--rounds 3] [--one-process 1024]

The whole ``hetero.search`` is timed (shape enumeration, combination, predict() scoring, refinement
and the per-group searches of the upper bound), each size ``--rounds`` times after one untimed
search (imports, the operator model's first load): the median is reported with the spread. For the sizes given to ``--one-process``, the same search with
``workers=1`` (enumeration and predictions in the search's own process) is timed in the same rounds,
alternating with the default, and the ratio of the medians printed. Target: 1024 devices in < 30 s
on a 2-core machine. Writes benchmarks/results/planner_scale.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hetero  # noqa: E402

TYPES = [("a100", "A100-SXM4-80GB"), ("h100", "H100-SXM5-80GB"), ("mi250x", "MI250X-GCD"), ("ascend", "Ascend-910B")]


def four_type_cluster(devices: int):
    per = devices // len(TYPES)
    return hetero.load_cluster({
        "name": f"four-type-{devices}",
        "groups": [{"name": n, "device": d, "nodes": max(1, per // 8), "devices_per_node": 8} for n, d in TYPES],
        "network": {"inter_node": {"bandwidth": "100 GB/s", "latency": "10 us"},
                    "cross_group": {"bandwidth": "25 GB/s", "latency": "20 us"}}})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--model", default="llama2-70b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one-process", type=int, nargs="*", default=[1024],
                    help="sizes also searched with workers=1, alternating with the default")
    ap.add_argument("-o", default=str(ROOT / "benchmarks" / "results" / "planner_scale.json"))
    args = ap.parse_args(argv)
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    model = hetero.load_model(ROOT / "configs" / "models" / f"{args.model}.yaml")
    # one untimed search first: imports, the operator model's first load and compile belong to no size
    hetero.search(four_type_cluster(64), model, global_batch_size=512, top_k=1, upper_bound=False)
    rows = []
    for n in args.sizes:
        cluster = four_type_cluster(n)
        B = max(512, 2 * n)
        times, serial = [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            results = hetero.search(cluster, model, global_batch_size=B, top_k=3)
            times.append(time.perf_counter() - t0)
            if n in args.one_process:
                t0 = time.perf_counter()
                alone = hetero.search(cluster, model, global_batch_size=B, top_k=3, workers=1)
                serial.append(time.perf_counter() - t0)
                assert alone[0].plan.to_dict() == results[0].plan.to_dict(), "workers=1 planned otherwise"
        best = results[0]
        ub = results.upper_bound_tokens_per_s
        row = {"devices": cluster.num_devices, "global_batch_size": B, "search_s": statistics.median(times),
               "search_s_rounds": times,
               "best_tokens_per_s": best.prediction.tokens_per_s, "upper_bound_tokens_per_s": ub,
               "fraction_of_upper_bound": best.prediction.tokens_per_s / ub if ub else None,
               "best_plan": best.one_line, "stats": results.stats}
        if serial:
            row.update(one_process_s=statistics.median(serial), one_process_s_rounds=serial,
                       speedup_vs_one_process=statistics.median(serial) / statistics.median(times))
        rows.append(row)
    table = Table(title=f"planner search time, four device types, {model.name} ({os.cpu_count()} cores; "
                        f"median of {args.rounds})", title_justify="left")
    for col in ("devices", "B", "search s", "range s", "workers=1 s", "% bound", "shapes", "predict calls",
                "best plan"):
        table.add_column(col, justify="left" if col == "best plan" else "right")
    for r in rows:
        frac = r["fraction_of_upper_bound"]
        one = (f"{r['one_process_s']:.1f} ({r['speedup_vs_one_process']:.2f}x)" if "one_process_s" in r else "-")
        table.add_row(str(r["devices"]), str(r["global_batch_size"]), f"{r['search_s']:.1f}",
                      f"{min(r['search_s_rounds']):.1f}-{max(r['search_s_rounds']):.1f}", one,
                      f"{frac * 100:.1f}%" if frac else "-",
                      str(r["stats"].get("shapes")), str(r["stats"].get("predict_calls")), escape(r["best_plan"]))
    Console(width=220).print(table)
    t1024 = next((r["search_s"] for r in rows if r["devices"] == 1024), None)
    ok = t1024 is None or t1024 < 30
    out = Path(args.o)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model.name, "cores": os.cpu_count(), "rounds": args.rounds, "rows": rows,
                               "method": "median of --rounds whole hetero.search calls per size in one interpreter "
                                         "after one untimed warm-up search; workers=1 alternating in the same rounds",
                               "target": "1024 devices < 30 s", "pass": ok}, indent=2))
    print(f"wrote {out}; 1024 devices: {t1024:.1f} s ({'ok' if ok else 'FAIL'})" if t1024 else f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
