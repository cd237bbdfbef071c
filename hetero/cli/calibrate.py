"""``hetero calibrate``: fit the predictor's per-device factors to measured runs (a run-log CSV)."""
from __future__ import annotations


SHORT = {"communication": "comm", "layer_overhead_s": "layer s", "iteration_overhead_s": "iter s",
         "op_floor_s": "kernel s"}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate", help="fit the predictor to measured runs",
        description="Fit per-device-type calibration factors (compute, communication, overheads, kernel floor, "
                    "network, matrix-kernel speed) to measured iteration times of homogeneous Megatron-style runs (run log CSV, "
                    "docs/formats.md), print them with the in-sample error table and write them as JSON.")
    p.add_argument("--cluster", required=True, help="cluster file the runs were measured on")
    p.add_argument("--runs", required=True, help="run log CSV")
    p.add_argument("-o", "--output", required=True, metavar="CAL", help="calibration JSON to write")
    p.add_argument("--json", action="store_true", help="print the calibration JSON instead of tables")
    p.add_argument("--max-rows", type=int, default=40, help="rows of the error table to show (worst first)")
    p.set_defaults(func=run,  # the files read and written: check_outputs_apart
                   inputs={"--cluster": "cluster", "--runs": "runs"}, outputs={"-o": "output"})


def run(args) -> int:
    import dataclasses

    from hetero.predictor.calibration import ALL, CV_FOLDS, calibrate, read_runs
    from hetero.specs.cluster import load_cluster

    from ._common import check_output, console, print_json, write_output

    cluster = load_cluster(args.cluster)
    check_output(args.output, "-o")
    runs = read_runs(args.runs)
    cal = calibrate(cluster, runs)
    cal.meta["runs_file"] = args.runs
    for table in (cal.factors, cal.standard):
        for name, f in list(table.items()):
            table[name] = dataclasses.replace(f, source=f"calibration ({cal.meta['fit'][name]['runs']} runs of {args.runs})")
    write_output(args.output, "-o", cal.save)
    if args.json:
        print_json(cal.to_dict())
        return 0
    from rich.table import Table

    out = console()
    ft = Table(title=f"Calibration factors ({len(runs)} runs, cluster '{cluster.name}')")
    ft.add_column("device")
    for k in ALL:   # short headers: the table must fit a terminal; the JSON has the full names
        ft.add_column(SHORT.get(k, k), justify="right")
    ft.add_column("op model")
    ft.add_column("MAPE before", justify="right")
    ft.add_column("MAPE after", justify="right")
    ft.add_column("MAPE held-out", justify="right")
    for name in cal.factors:
        theta = cal.theta(name)
        fit = cal.meta["fit"][name]
        ft.add_row(name, *(f"{v:.4g}" for v in theta), fit.get("op_model", ""), f"{fit['mape_uncalibrated']:.1%}",
                   f"{fit['mape']:.1%}", "-" if fit.get("held_out_mape") is None else f"{fit['held_out_mape']:.1%}")
    out.print(ft)
    out.print("layer s / iter s: overhead per layer and micro-batch / per iteration; kernel s: host dispatch per kernel.")
    out.print(f"MAPE held-out: each run predicted by a fit on the other runs ({CV_FOLDS}-fold, refitted on the "
              "predictor linearised at the full fit); what to expect on runs like these that were not measured.")
    rows = sorted(cal.runs, key=lambda d: -abs(d["calibrated_ms"] / d["measured_ms"] - 1))
    et = Table(title="In-sample error per run" + (f" (worst {args.max_rows} of {len(rows)})"
                                                  if len(rows) > args.max_rows else ""))
    for col in ("row", "run", "measured ms", "uncalibrated ms", "calibrated ms", "error"):
        et.add_column(col, justify="left" if col == "run" else "right")
    for d in rows[: args.max_rows]:
        err = d["calibrated_ms"] / d["measured_ms"] - 1
        et.add_row(str(d["row"]), d["run"], f"{d['measured_ms']:.1f}", f"{d['uncalibrated_ms']:.1f}",
                   f"{d['calibrated_ms']:.1f}", f"{err:+.1%}")
    out.print(et)
    out.print(f"wrote {args.output}")
    return 0
