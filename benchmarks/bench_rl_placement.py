"""Predicted against measured RL steps on this machine, and whether ``placement.mode: auto`` chooses well.

Job: a 4-layer GPT (configs/models/tiny.yaml) over UTF-8 bytes, the RL example's prompts and reward,
4 prompts x 4 completions of up to 8 tokens a step, staleness 1. Cluster: two emulated vendors of one
CPU device each, the second 3x slower (written here). Placements, each run by ``hetero rl`` as a user
runs it (a subprocess, --steps STEPS, --summary):

  collocated        actor and rollout on fast
  fast->slow        disaggregated: actor on fast, rollout on slow
  slow->fast        disaggregated: actor on slow, rollout on fast

Measured: the median ``step_s`` of the summary's steps after the first WARM (start-up and first
syncs left out). Predicted: ``hetero rl JOB --predict --json``'s step_s. Each must be within 25% of
the other (|predicted - measured| / measured). Then the same job with ``mode: auto``: the placement its
``--predict`` chooses must be measured within 10% of the best measured (if it is none of the three,
it is run too). Exits 1 when any of these misses. Writes benchmarks/results/rl_placement.json.

    python benchmarks/bench_rl_placement.py [--steps 10] [--out benchmarks/results/rl_placement.json]
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

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
WARM = 2
STEP_TOLERANCE = 0.25
AUTO_TOLERANCE = 0.10

CLUSTER = {
    "name": "rl-bench-pair",
    "devices": {"cpu-emu-a": {"base": "cpu", "vendor": "emu-a"},
                "cpu-emu-b": {"base": "cpu", "vendor": "emu-b", "slowdown": 3.0}},
    "groups": [{"name": g, "device": d, "nodes": 1, "devices_per_node": 1, "hosts": ["localhost"],
                "intra_node": {"bandwidth": "1.5 GB/s", "latency": "50 us"}}
               for g, d in (("fast", "cpu-emu-a"), ("slow", "cpu-emu-b"))],
    "network": {"inter_node": {"bandwidth": "1.5 GB/s", "latency": "50 us"},
                "cross_group": {"bandwidth": "1.5 GB/s", "latency": "50 us"}},
}
PROMPTS, GROUP = 4, 4


def job_dict(placement: dict) -> dict:
    return {"algorithm": "grpo", "model": str(CONFIGS / "models" / "tiny.yaml"), "tokenizer": "bytes",
            "prompts": str(CONFIGS / "rl" / "prompts.jsonl"), "reward": str(CONFIGS / "rl" / "rewards.py") + ":exact",
            "steps": 10, "prompts_per_step": PROMPTS, "group_size": GROUP, "max_new_tokens": 8, "stop": "\n",
            "temperature": 1.0, "lr": 1.0e-4, "staleness": 1, "seed": 0, "placement": placement}


def plan_dict(group: str) -> dict:
    """The whole 4-layer model on one device of ``group``: 16 samples a step in 4 micro-batches."""
    return {"global_batch_size": PROMPTS * GROUP, "micro_batch_size": 4,
            "pipelines": [{"micro_batches": 4, "stages": [{"group": group, "layers": [0, 4]}]}], "schedule": "1f1b"}


def cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "hetero", *args], capture_output=True, text=True, cwd=REPO,
                         timeout=timeout, start_new_session=True)
    if out.returncode != 0:
        raise SystemExit(f"hetero {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return out


def write(folder: Path, name: str, data: dict) -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def predicted(job: Path, cluster: Path) -> dict:
    return json.loads(cli("rl", str(job), "--cluster", str(cluster), "--predict", "--json", timeout=300).stdout)


def measure(job: Path, cluster: Path, folder: Path, steps: int) -> dict:
    summary = folder / (job.stem + "-summary.json")
    t0 = time.perf_counter()
    cli("rl", str(job), "--cluster", str(cluster), "--steps", str(steps), "--summary", str(summary), "--quiet",
        timeout=900)
    wall = time.perf_counter() - t0
    rows = json.loads(summary.read_text())["rl_steps"][WARM:]
    return {key: statistics.median(r[key] for r in rows) for key in ("step_s", "rollout_s", "train_s", "sync_s")} | \
        {"steps_measured": len(rows), "wall_s": wall}


def placement_of(mode: str, actor: str, rollout: str | None, folder: Path, name: str) -> dict:
    plan = write(folder, f"{name}-plan.yaml", plan_dict(actor))
    out = {"mode": mode, "actor": {"plan": str(plan)}}
    if rollout:
        out["rollout"] = {"groups": [rollout]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "rl_placement.json"))
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="bench-rl-placement-"))
    cluster = write(folder, "cluster.yaml", CLUSTER)
    cases = {"collocated": ("collocated", "fast", None), "fast->slow": ("disaggregated", "fast", "slow"),
             "slow->fast": ("disaggregated", "slow", "fast")}
    results, misses = {}, []
    print(f"load average before: {os.getloadavg()[0]:.2f}; method: median step_s of steps {WARM + 1}..{args.steps}",
          flush=True)
    for name, (mode, actor, rollout) in cases.items():
        job = write(folder, f"{name.replace('->', '-to-')}.yaml",
                    job_dict(placement_of(mode, actor, rollout, folder, name.replace("->", "-to-"))))
        pred = predicted(job, cluster)["placements"][0]["predicted"]
        meas = measure(job, cluster, folder, args.steps)
        err = (pred["step_s"] - meas["step_s"]) / meas["step_s"]
        results[name] = {"predicted": pred, "measured": meas, "step_error": err}
        ok = abs(err) <= STEP_TOLERANCE
        if not ok:
            misses.append(f"{name}: predicted step {pred['step_s']:.4f} s, measured {meas['step_s']:.4f} s ({err:+.1%})")
        print(f"{name:12s} predicted step {pred['step_s']:.4f} s (rollout {pred['rollout_s']:.4f}, train "
              f"{pred['train_s']:.4f}, sync {pred['sync_s']:.4f})  measured {meas['step_s']:.4f} s (rollout "
              f"{meas['rollout_s']:.4f}, train {meas['train_s']:.4f}, sync {meas['sync_s']:.4f})  {err:+.1%} "
              f"{'ok' if ok else 'MISS'}", flush=True)
    auto = write(folder, "auto.yaml", job_dict({"mode": "auto", "actor": {"groups": ["fast"]},
                                                "rollout": {"groups": ["slow"]}}))
    report = predicted(auto, cluster)
    choice = report["placements"][report["chosen"]]
    actor, rollout = choice["actor"]["groups"], choice["rollout"]["groups"]
    name = next((n for n, (m, a, r) in cases.items() if m == choice["mode"] and [a] == actor
                 and (r is None or [r] == rollout)), None)
    if name is None:   # a placement none of the three is: run it as well
        name = f"{choice['mode']} {'+'.join(actor)} / {'+'.join(rollout)}"
        plan = write(folder, "auto-plan.yaml", choice["actor"]["plan"])
        placement = {"mode": choice["mode"], "actor": {"plan": str(plan)}, "rollout": {"groups": rollout}}
        job = write(folder, "auto-chosen.yaml", job_dict(placement))
        results[name] = {"predicted": choice["predicted"], "measured": measure(job, cluster, folder, args.steps)}
    best = min(results, key=lambda n: results[n]["measured"]["step_s"])
    ratio = results[name]["measured"]["step_s"] / results[best]["measured"]["step_s"]
    print(f"auto chooses {name}: measured {results[name]['measured']['step_s']:.4f} s, {ratio:.3f}x the best "
          f"measured ({best}, {results[best]['measured']['step_s']:.4f} s)")
    if ratio > 1 + AUTO_TOLERANCE:
        misses.append(f"auto chose {name}, measured {ratio:.3f}x the best ({best})")
    out = {"method": __doc__.split("\n\n")[1:3], "steps": args.steps, "warm_steps_left_out": WARM,
           "load_average_after": os.getloadavg()[0], "placements": results,
           "auto": {"chosen": name, "best_measured": best, "ratio_to_best": ratio}, "misses": misses}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    for m in misses:
        print("MISS:", m)
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
