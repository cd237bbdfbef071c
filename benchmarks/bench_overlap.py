"""Gradient reduction overlapped with the backward vs after it, on a data-parallel CPU plan.

Plan: one pipeline of one stage, two replicas (two worker processes, one core each), a GPT of
8 layers, hidden 512, vocabulary 8192 (untied head), fp32: 134 MB of gradients, cut into six
buckets of at most 25 MB and summed over Gloo on this machine. Two micro-batches of 1 x 32
tokens per replica keep the compute of a step short enough that the sync matters.

Device: an emulated accelerator (``slowdown`` 2: each forward and backward really computes, then
waits as long again), so the host core is free for half of the device time, as it is beside a
GPU; the all-reduces run on Gloo's threads on the same two cores either way. The emulation's wait
comes after the whole backward of a micro-batch, so every bucket is final by its middle, earlier
than on a real device (where the embedding's gradient is the last one done): ``--slowdown 1``
measures plain CPU compute instead, where compute and all-reduces share the two cores.

Runs ``hetero launch --trace`` alternately with and without ``--no-overlap`` (``--repeats`` each,
in one run of this script), and from each trace, per rank and step after the first:

- exposed sync: from the end of the rank's last backward to the completion of its last bucket;
- hidden: the part of the buckets' collectives that ran before the last backward ended;

and the summary's step times. Figures are medians over steps, ranks and repeats. Prints the
table and writes benchmarks/results/overlap.json.

    .venv/bin/python benchmarks/bench_overlap.py [--steps 6] [--repeats 3] [--slowdown 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

CLUSTER = {"name": "overlap-bench", "devices": {"emu-gpu": {"base": "cpu", "vendor": "emu-a", "slowdown": 2.0}},
           "groups": [{"name": "dp", "device": "emu-gpu", "nodes": 1, "devices_per_node": 2}]}
MODEL = {"name": "gpt-8x512", "architecture": "gpt", "num_layers": 8, "hidden_size": 512, "num_attention_heads": 8,
         "vocab_size": 8192, "seq_length": 32, "dtype": "fp32", "tie_embeddings": False}
PLAN = {"global_batch_size": 4, "micro_batch_size": 1, "schedule": "1f1b",
        "pipelines": [{"replicas": 2, "micro_batches": 2, "stages": [{"group": "dp", "layers": [0, 8]}]}]}


def per_rank_steps(trace: dict) -> list[dict]:
    """Per (rank, step > 1): exposed and hidden sync seconds, from a --trace file."""
    rows: dict = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") == "forward":
            continue
        key = (e["pid"], e["args"]["step"])
        rows.setdefault(key, {"B": [], "R": []})["R" if e["cat"] == "dp" else "B"].append(
            (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
    out = []
    for (rank, step), v in sorted(rows.items()):
        if step == 1 or not v["R"] or not v["B"]:
            continue
        end_b = max(e for _, e in v["B"])
        end_r = max(e for _, e in v["R"])
        hidden = sum(max(0.0, min(e, end_b) - s) for s, e in v["R"])
        out.append({"rank": rank, "step": step, "exposed_s": max(0.0, end_r - end_b), "hidden_s": hidden,
                    "buckets": len(v["R"]), "started_in_backward": sum(s < end_b for s, _ in v["R"])})
    return out


def launch(tmp: Path, overlap: bool, steps: int) -> dict:
    files = {}
    for name, data in (("cluster", CLUSTER), ("model", MODEL), ("plan", PLAN)):
        files[name] = tmp / f"{name}.yaml"
        files[name].write_text(yaml.safe_dump(data))
    trace, summary = tmp / "trace.json", tmp / "summary.json"
    cmd = [sys.executable, "-m", "hetero", "launch", "--cluster", str(files["cluster"]), "--model",
           str(files["model"]), "--plan", str(files["plan"]), "--steps", str(steps), "--quiet",
           "--trace", str(trace), "--summary", str(summary), "--timeout", "120"] + ([] if overlap else ["--no-overlap"])
    load = os.getloadavg()[0]
    subprocess.run(cmd, check=True, cwd=ROOT)
    s = json.loads(summary.read_text())
    return {"overlap": overlap, "load_avg_1min": load, "steps": per_rank_steps(json.loads(trace.read_text())),
            "iteration_times_s": s["iteration_times_s"][1:],
            "grad_sync_time_s": [r["grad_sync_time_s"] for r in s["ranks"]]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slowdown", type=float, default=2.0,
                    help="the emulated device's slowdown (1: plain CPU compute, which the all-reduces then share "
                         "the two cores with)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/overlap.json (slowdown 2), else "
                                                "overlap_slowdown<S>.json")
    args = ap.parse_args()
    CLUSTER["devices"]["emu-gpu"]["slowdown"] = args.slowdown
    if args.out is None:
        name = "overlap.json" if args.slowdown == 2.0 else f"overlap_slowdown{args.slowdown:g}.json"
        args.out = str(ROOT / "benchmarks" / "results" / name)
    runs = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.repeats):
            for overlap in (True, False):   # alternated, so a change in the machine's load hits both
                tmp = Path(d) / f"{i}-{overlap}"
                tmp.mkdir()
                runs.append(launch(tmp, overlap, args.steps))
    result = {"method": __doc__, "slowdown": args.slowdown, "cluster": CLUSTER, "model": MODEL, "plan": PLAN,
              "steps": args.steps, "repeats": args.repeats, "cpu_count": os.cpu_count(),
              "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": runs}
    med = {}
    for overlap in (True, False):
        rows = [r for run in runs if run["overlap"] is overlap for r in run["steps"]]
        med[overlap] = {"exposed_sync_s": statistics.median(r["exposed_s"] for r in rows),
                        "hidden_sync_s": statistics.median(r["hidden_s"] for r in rows),
                        "buckets_started_in_backward": statistics.median(r["started_in_backward"] for r in rows),
                        "buckets": statistics.median(r["buckets"] for r in rows),
                        "step_s": statistics.median(t for run in runs if run["overlap"] is overlap
                                                    for t in run["iteration_times_s"]),
                        "load_avg_1min": statistics.median(run["load_avg_1min"] for run in runs
                                                           if run["overlap"] is overlap)}
    result["medians"] = {"overlap": med[True], "no_overlap": med[False]}
    cut = 1 - med[True]["exposed_sync_s"] / med[False]["exposed_sync_s"] if med[False]["exposed_sync_s"] else 0.0
    result["exposed_sync_reduction"] = cut
    print(f"{'':12} {'exposed sync':>13} {'hidden sync':>12} {'buckets in bwd':>15} {'step':>8} {'load':>6}")
    for name, m in (("overlap", med[True]), ("--no-overlap", med[False])):
        print(f"{name:12} {m['exposed_sync_s']:12.3f}s {m['hidden_sync_s']:11.3f}s "
              f"{m['buckets_started_in_backward']:>8g} of {m['buckets']:g} {m['step_s']:7.3f}s {m['load_avg_1min']:6.1f}")
    print(f"exposed sync {100 * cut:.0f}% lower with overlap (medians over steps 2..{args.steps}, both ranks, "
          f"{args.repeats} alternated runs each; load average: see table)")
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
