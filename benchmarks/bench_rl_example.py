"""Does the shipped RL example learn? SFT warm start, then GRPO, then the random-reward control, per seed.

For each seed, from configs/rl/ on configs/clusters/local-cpu.yaml, as a user would run it:

1. ``hetero launch --model model.yaml --plan sft-plan.yaml --data sft.jsonl --steps 200 --lr 3e-3
   --seed S --save SFT`` (the prompt/completion warm start);
2. ``hetero rl grpo-<mode>.yaml --load SFT --save RL`` with the job's seed set to S (``--steps``
   overrides the job's 100);
3. the same with grpo-random-reward.yaml (a reward that ignores the completion) into RAND;
4. held-out accuracy of SFT, RL and RAND: ``hetero generate --prompts eval.jsonl --json`` (greedy,
   4 new tokens), a completion counting when its text up to the first newline is the answer.

Everything runs as separate processes sharing this machine's cores; wall times are of the whole
command. The random-reward job is the control: a run that learns the task from a reward, not from
taking steps, gains over SFT there and not here.

    .venv/bin/python benchmarks/bench_rl_example.py [--seeds 0 1 2] [--steps 100] [--mode collocated]

Writes benchmarks/results/rl_example.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "configs" / "rl"
CLUSTER = ROOT / "configs" / "clusters" / "local-cpu.yaml"


def hetero(*args: str, timeout: float = 900) -> tuple[str, float]:
    """Run ``hetero ARGS`` in configs/rl; returns (stdout, wall seconds); a failure ends the script."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "hetero", *args], cwd=EXAMPLE, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode:
        sys.exit(f"hetero {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout, time.perf_counter() - t0


def accuracy(checkpoint: str) -> float:
    """Exact-match share of greedy completions of eval.jsonl."""
    out, _ = hetero("generate", "--model", "model.yaml", "--load", checkpoint, "--prompts", "eval.jsonl",
                    "--max-new-tokens", "4", "--json")
    rows = [json.loads(line) for line in (EXAMPLE / "eval.jsonl").read_text().splitlines() if line.strip()]
    got = json.loads(out)["completions"]
    return sum(g["completion"].split("\n")[0].strip() == r["answer"] for g, r in zip(got, rows)) / len(rows)


def job_with_seed(job: str, seed: int, folder: Path) -> str:
    """A copy of the example job ``job`` with ``seed: S``, beside the example's files (its paths are
    relative to its folder, so the copy names them absolutely)."""
    import yaml

    data = yaml.safe_load((EXAMPLE / job).read_text())
    data["seed"] = seed
    for key in ("model", "prompts", "eval_prompts"):
        data[key] = str(EXAMPLE / data[key])
    data["reward"] = str(EXAMPLE / data["reward"])
    data["placement"]["actor"]["plan"] = str(EXAMPLE / data["placement"]["actor"]["plan"])
    path = folder / f"seed{seed}-{job}"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def one_seed(seed: int, steps: int, mode: str, folder: Path) -> dict:
    sft, rl, rand = (str(folder / f"{name}{seed}") for name in ("sft", "rl", "rand"))
    _, sft_s = hetero("launch", "--cluster", str(CLUSTER), "--model", "model.yaml", "--plan", "sft-plan.yaml",
                      "--data", "sft.jsonl", "--steps", "200", "--lr", "3e-3", "--seed", str(seed), "--save", sft,
                      "--quiet")
    runs = {}
    for name, job, out in (("grpo", f"grpo-{mode}.yaml", rl), ("random_reward", "grpo-random-reward.yaml", rand)):
        summary = folder / f"{name}{seed}.json"
        _, wall = hetero("rl", job_with_seed(job, seed, folder), "--cluster", str(CLUSTER), "--load", sft,
                         "--save", out, "--steps", str(steps), "--summary", str(summary), "--quiet")
        s = json.loads(summary.read_text())
        runs[name] = {"accuracy": accuracy(out), "wall_s": wall, "eval_reward": s["eval"],
                      "rewards": [r["reward_mean"] for r in s["rl_steps"]]}
    return {"seed": seed, "sft_accuracy": accuracy(sft), "sft_wall_s": sft_s, **runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--mode", choices=("collocated", "disaggregated"), default="collocated")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "rl_example.json"))
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-rl-example-") as tmp:
        for seed in args.seeds:
            r = one_seed(seed, args.steps, args.mode, Path(tmp))
            results.append(r)
            print(f"seed {seed}: held-out accuracy after SFT {r['sft_accuracy']:.3f} ({r['sft_wall_s']:.0f} s); "
                  f"GRPO {args.steps} steps {r['grpo']['accuracy']:.3f} ({r['grpo']['wall_s']:.0f} s); "
                  f"random reward {r['random_reward']['accuracy']:.3f}", flush=True)
    out = {"mode": args.mode, "steps": args.steps, "seeds": results}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
