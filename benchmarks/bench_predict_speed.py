"""Plan predictions per second for an 80-layer model (Llama-2-70B shape) with 4 pipelines.

One StageCostModel (the planner's situation): a set of varied plans (random uneven layer splits
over mixed groups, different micro-batch counts per pipeline) is scored once to warm the caches,
then re-scored several times; the median rate is reported. The cold rate (first scoring of
each plan, cost model already built) is printed too.

    python benchmarks/bench_predict_speed.py [--plans 300] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

CLUSTER = {
    "name": "bench-mixed",
    "groups": [
        {"name": "h100", "device": "H100-SXM5-80GB", "nodes": 8, "devices_per_node": 8,
         "intra_node": {"bandwidth": "450 GB/s", "latency": "3 us"}},
        {"name": "a100", "device": "A100-SXM4-80GB", "nodes": 8, "devices_per_node": 8,
         "intra_node": {"bandwidth": "300 GB/s", "latency": "5 us"}},
        {"name": "mi250", "device": "MI250X", "nodes": 4, "devices_per_node": 8,
         "intra_node": {"bandwidth": "100 GB/s", "latency": "5 us"}},
    ],
    "network": {"inter_node": {"bandwidth": "50 GB/s", "latency": "10 us"},
                "cross_group": {"bandwidth": "25 GB/s", "latency": "20 us"}},
}
MODEL = {"name": "llama2-70b", "architecture": "llama", "num_layers": 80, "hidden_size": 8192,
         "num_attention_heads": 64, "num_kv_heads": 8, "ffn_hidden_size": 28672, "vocab_size": 32000,
         "seq_length": 4096, "dtype": "bf16"}
# Four pipeline shapes, 4 stages each (groups per stage); tp 8 everywhere fits the groups.
SHAPES = [["h100"] * 4, ["a100"] * 4, ["h100", "h100", "a100", "a100"], ["a100", "a100", "mi250", "mi250"]]
GLOBAL_BATCH = 256


def random_plan(rng: random.Random) -> dict:
    splits = []
    for shape in SHAPES:
        cuts = sorted(rng.sample(range(1, 80), len(shape) - 1))
        bounds = [0] + cuts + [80]
        splits.append([{"group": g, "tp": 8, "layers": [bounds[i], bounds[i + 1]]} for i, g in enumerate(shape)])
    m = [rng.randint(16, 112) for _ in range(3)]
    while sum(m) >= GLOBAL_BATCH - 8:
        m = [rng.randint(16, 80) for _ in range(3)]
    m.append(GLOBAL_BATCH - sum(m))
    return {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 1,
            "schedule": rng.choice(["1f1b", "1f1b", "gpipe"]), "recompute": rng.choice(["none", "selective", "full"]),
            "zero_stage": rng.choice([0, 1]),
            "pipelines": [{"replicas": 1, "micro_batches": mi, "stages": st} for mi, st in zip(m, splits)]}


def setup(n_plans: int, seed: int = 0):
    import hetero
    from hetero.predictor import StageCostModel

    cluster = hetero.load_cluster(CLUSTER)
    model = hetero.load_model(MODEL)
    rng = random.Random(seed)
    plans = [hetero.load_plan(random_plan(rng)) for _ in range(n_plans)]
    return cluster, model, plans, StageCostModel(cluster, model)


def rate(cluster, model, plans, cm) -> float:
    from hetero.predictor import predict

    t = time.perf_counter()
    for plan in plans:
        predict(cluster, model, plan, cost_model=cm)
    return len(plans) / (time.perf_counter() - t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    cluster, model, plans, cm = setup(args.plans)
    cold = rate(cluster, model, plans, cm)
    warm = [rate(cluster, model, plans, cm) for _ in range(args.repeats)]
    med = statistics.median(warm)
    print(f"model {model.name}: {model.num_layers} layers, 4 pipelines x 4 stages, {args.plans} varied plans")
    print(f"cold (first scoring, cost model built): {cold:,.0f} plans/s")
    print(f"warm re-scoring, median of {args.repeats}: {med:,.0f} plans/s  (runs: {', '.join(f'{r:,.0f}' for r in warm)})")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "predict_speed.json"), "w") as f:
        json.dump({"plans": args.plans, "cold_plans_per_s": cold, "warm_plans_per_s": warm,
                   "warm_median_plans_per_s": med}, f, indent=2)
    return 0 if med >= 2000 else 1   # the planner needs >= 2,000 plans/s


if __name__ == "__main__":
    sys.exit(main())
