"""RL step time: ``hetero rl`` (collocated and disaggregated, on the emulated two-vendor cluster) against
a plain single-process PyTorch GRPO loop of the same sizes.

Job: the shipped example (configs/rl/grpo-collocated.yaml / grpo-disaggregated.yaml: a 2-layer byte
Llama, 8 prompts x 8 completions a step, 4 new tokens, the actor a 2-stage pipeline on `fast`,
disaggregated rollout on the two `slow` devices), ``--steps`` steps, from ``--load`` when given.

The plain loop is what one would write without the runtime: the whole model in one process (with one
torch thread, as each worker has, and with as many as the machine has cores), each step generating every group with the same generation code
(:func:`hetero.rl.generate.generate`, the same seeds), rewards called in-process, the same GRPO loss
(:mod:`hetero.rl.grpo`) on the whole batch in one forward and backward, AdamW. Its first step uses
the same weights, prompts and seeds as the runtime's, so its step-0 mean reward must equal theirs
(printed as a check). Times are medians over the steps after the first; the ratio is the runtime's
median step over the plain loop's (the faster of its two thread counts), measured in one run of this
script. Everything shares the
machine's cores: on 2 cores the runtime's four processes take turns, which the ratio includes.

TRL's GRPOTrainer is compared only where ``trl`` imports (it does not on this machine's environment:
the script says so).

    .venv/bin/python benchmarks/bench_rl.py [--steps 8] [--load CKPT]

Writes benchmarks/results/rl.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLUSTER = ROOT / "configs" / "clusters" / "local-cpu.yaml"


def runtime_steps(mode: str, steps: int, load: str | None) -> dict:
    import hetero
    from hetero.rl.job import load_rl_job
    from hetero.rl.run import run_rl

    cluster = hetero.load_cluster(str(CLUSTER))
    job = load_rl_job(str(ROOT / "configs" / "rl" / f"grpo-{mode}.yaml"), cluster=cluster)
    t0 = time.perf_counter()
    summary = run_rl(job, cluster, types.SimpleNamespace(steps=steps, load=load, quiet=True))
    wall = time.perf_counter() - t0
    rows = summary["rl_steps"]
    med = {k: statistics.median(r[k] for r in rows[1:]) for k in ("step_s", "rollout_s", "train_s", "sync_s")}
    return {"median": med, "wall_s": wall, "reward_step0": rows[0]["reward_mean"],
            "rewards": [r["reward_mean"] for r in rows], "weight_sync": summary["weight_sync"]}


def plain_steps(steps: int, load: str | None, threads: int) -> dict:
    """The single-process loop (see the module docstring) with ``threads`` torch threads."""
    import torch

    import hetero
    from hetero.rl.generate import generate
    from hetero.rl.grpo import grpo_loss, group_advantages, token_logprobs
    from hetero.rl.job import load_rl_job
    from hetero.rl.rewards import RewardPool
    from hetero.rl.rollout import step_prompts
    from hetero.runtime.model import build_stage
    from hetero.tokenizer import load_text_tokenizer

    torch.set_num_threads(threads)
    cluster = hetero.load_cluster(str(CLUSTER))
    job = load_rl_job(str(ROOT / "configs" / "rl" / "grpo-collocated.yaml"), cluster=cluster)
    spec = job.model_spec
    model = build_stage(spec, (0, spec.num_layers), True, True, job.seed)
    if load:
        from hetero.runtime.checkpoint import load_checkpoint

        load_checkpoint(load, model, None, num_layers=spec.num_layers)
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr, weight_decay=0.0)
    tok = load_text_tokenizer(job.tokenizer, spec.vocab_size)
    P, G, T = job.prompts_per_step, job.group_size, spec.seq_length
    records = job.prompt_records
    times, rewards_mean = [], []
    with RewardPool(job.reward_ref, workers=0) as pool:
        for t in range(steps):
            t0 = time.perf_counter()
            model.eval()
            seqs, masks, advs, rewards = [], [], [], []
            for g, index in enumerate(step_prompts(job.seed, t, P, len(records))):
                rec = records[index]
                ids = tok.encode(rec.prompt, special=True)
                done = generate(model, [ids], max_new_tokens=job.max_new_tokens, temperature=job.temperature,
                                seed=job.seed, step=t, samples=G, prompt_indices=[g], stop=job.stop, tokenizer=tok,
                                batch_rows=G)
                r = pool.score([rec] * G, [c.text for c in done])
                rewards += r
                advs.append(group_advantages(torch.tensor(r, dtype=torch.float64), G))
                for c in done:
                    seq = torch.zeros(T + 1, dtype=torch.int64)
                    seq[:len(ids) + len(c.tokens)] = torch.tensor(ids + c.tokens)
                    mask = torch.zeros(T)
                    mask[len(ids) - 1:len(ids) + len(c.tokens) - 1] = 1.0
                    seqs.append(seq)
                    masks.append(mask)
            model.train()
            seq, mask = torch.stack(seqs), torch.stack(masks)
            logp = token_logprobs(model(seq[:, :-1]), seq[:, 1:], job.temperature)
            loss = grpo_loss(logp, torch.cat(advs), mask, job.clip)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            times.append(time.perf_counter() - t0)
            rewards_mean.append(sum(rewards) / len(rewards))
    return {"median": {"step_s": statistics.median(times[1:])}, "reward_step0": rewards_mean[0],
            "rewards": rewards_mean}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--load", help="a --save checkpoint of configs/rl/model.yaml (the SFT warm start)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "rl.json"))
    args = ap.parse_args()
    import os

    plains = {n: plain_steps(args.steps, args.load, n) for n in sorted({1, os.cpu_count() or 1})}
    plain = min(plains.values(), key=lambda p: p["median"]["step_s"])
    results = {"steps": args.steps, "load": args.load, "plain": plain,
               "plain_by_threads": {str(n): p["median"]["step_s"] for n, p in plains.items()}}
    for mode in ("collocated", "disaggregated"):
        results[mode] = runtime_steps(mode, args.steps, args.load)
    base = plain["median"]["step_s"]
    print(f"median step over steps 2..{args.steps} (s), method: medians of the steps after the first, one run")
    for n, p in plains.items():
        print(f"  plain single-process loop, {n} thread(s)  {p['median']['step_s']:.4f}")
    for mode in ("collocated", "disaggregated"):
        m = results[mode]["median"]
        results[mode]["ratio_to_plain"] = m["step_s"] / base
        print(f"  hetero rl {mode:<30}  {m['step_s']:.4f}  ({m['step_s'] / base:.2f}x plain; rollout "
              f"{m['rollout_s']:.4f}, train {m['train_s']:.4f}, sync {m['sync_s']:.4f})")
    same = all(results[m]["reward_step0"] == plain["reward_step0"] for m in ("collocated", "disaggregated"))
    print(f"step-0 mean reward: plain {plain['reward_step0']:.4f}, collocated {results['collocated']['reward_step0']:.4f}, "
          f"disaggregated {results['disaggregated']['reward_step0']:.4f} ({'equal' if same else 'DIFFERENT'})")
    try:
        import trl  # noqa: F401
        print("trl imports: the TRL comparison is not written yet")
    except ImportError:
        print("TRL: not installed here (pip install trl); no TRL comparison")
    results["load_average_1min"] = os.getloadavg()[0]   # other jobs on the cores show in every figure
    print(f"load average (1 min) at the end: {results['load_average_1min']:.1f} on {os.cpu_count()} cores")
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
