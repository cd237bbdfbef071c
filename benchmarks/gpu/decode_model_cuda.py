"""Decode tokens/s against batch size and context length on one accelerator, beside the predictor's
decode model (hetero.predictor.generation.decode_step); the model is checked and its two free figures fitted.

Model: Llama-2-7B cut to 8 layers, bf16 weights (what a rollout copy reads each token), random
values. For each batch B and context C: B prompts of C random tokens, hetero.rl.generate.generate at
temperature 1 (the rollout's sampling, one random stream per row) with NEW and with 1 new tokens;
one decode step = (wall(NEW) - wall(1)) / (NEW - 1), median of REPS runs after WARM, the device
synchronised around each call. Its context is C + NEW / 2 on average, and that is what is predicted.

Check: the shipped decode model (the catalog entry of this GPU, --catalog) against every point:
relative error, target within 15% (exit 1 when a point misses). Fit: the host's launch seconds per
kernel (KERNEL_LAUNCH_S) and the memory efficiency (MEMORY_EFFICIENCY) that minimise the largest
relative error over the points (a grid), printed with that error, to carry into generation.py.

    python benchmarks/gpu/decode_model_cuda.py benchmarks/data/h200/decode_model.json [--catalog H200]
Without CUDA it says so and exits 0. ``--device cpu --quick`` runs a tiny model on the CPU against
the catalog's ``cpu`` device (a check that the script works, not a measurement to keep)."""
import dataclasses
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import hetero  # noqa: E402
from hetero.predictor import generation as gen  # noqa: E402
from hetero.rl.generate import generate  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_cuda import build, quick_spec, start  # noqa: E402  (the same model, command line and timer)
from generate_cuda import timed as wall  # noqa: E402

FULL = {"layers": 8, "batches": (1, 4, 16, 64, 256), "contexts": (128, 1024, 3072), "new": 64, "warm": 2, "reps": 5}
QUICK = {"layers": 2, "batches": (1, 8), "contexts": (16, 48), "new": 8, "warm": 1, "reps": 3}
TARGET = 0.15
CATALOG_BY_NAME = (("H200", "H200"), ("H100", "H100-SXM5-80GB"), ("A100", "A100-SXM4-80GB"), ("MI300X", "MI300X"))


@torch.no_grad()
def measure(m, spec, device, batch, context, cfg):
    g = torch.Generator().manual_seed(batch * 100003 + context)
    rows = torch.randint(0, spec.vocab_size, (batch, context), generator=g).tolist()

    def call(n):
        return lambda: generate(m, rows, max_new_tokens=n, temperature=1.0, seed=0, batch_rows=batch)

    one = wall(call(1), device, cfg["warm"], cfg["reps"])
    many = wall(call(cfg["new"]), device, cfg["warm"], cfg["reps"])
    step = (many - one) / (cfg["new"] - 1)
    return {"batch": batch, "context": context, "first_call_s": one, "decode_step_s": step,
            "decode_tokens_per_s": batch / step}


def one_group_cluster(catalog_name: str):
    return hetero.load_cluster({"name": "decode-check", "groups": [
        {"name": "g", "device": catalog_name, "nodes": 1, "devices_per_node": 1}]})


def predicted(cluster, spec, points, new):
    return [gen.decode_step(cluster, "g", spec, p["batch"], p["context"] + new // 2).seconds for p in points]


def worst(points, preds):
    return max(abs(q - p["decode_step_s"]) / p["decode_step_s"] for p, q in zip(points, preds))


def fit(cluster, spec, points, new):
    """(launch seconds per kernel, memory efficiency, largest relative error) minimising that error."""
    keep = (gen.KERNEL_LAUNCH_S, gen.MEMORY_EFFICIENCY)
    best = None
    try:
        for launch_us in [x / 2 for x in range(2, 81)]:
            for eff in [x / 100 for x in range(40, 100, 2)]:
                gen.KERNEL_LAUNCH_S, gen.MEMORY_EFFICIENCY = launch_us * 1e-6, eff
                err = worst(points, predicted(cluster, spec, points, new))
                if best is None or err < best[2]:
                    best = (launch_us * 1e-6, eff, err)
    finally:
        gen.KERNEL_LAUNCH_S, gen.MEMORY_EFFICIENCY = keep
    return best


def main() -> int:
    started = start("decode_model_cuda", __doc__.split("\n\n")[0], FULL, QUICK, lambda ap: ap.add_argument(
        "--catalog", help="the catalog device this GPU is (default: from its name)"))
    if started is None:
        return 0
    args, device, cfg = started
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    catalog = args.catalog or ("cpu" if device.type == "cpu" else
                               next((c for key, c in CATALOG_BY_NAME if key in name), None))
    if catalog is None:
        print(f"decode_model_cuda: {name} is not a known catalog device (fix: --catalog NAME from configs/devices.yaml)")
        return 1
    if args.quick:
        spec = quick_spec("fp32")   # a CPU has no fast bf16 matrix products
    else:
        spec = hetero.load_model(str(REPO / "configs" / "models" / "llama2-7b.yaml"))
        spec = dataclasses.replace(spec, num_layers=cfg["layers"], dtype="bf16",
                                   seq_length=max(spec.seq_length, max(cfg["contexts"]) + cfg["new"]))
    torch.manual_seed(0)
    if device.type == "cpu":
        torch.set_num_threads(1)   # as the rollout ranks run, and as CPU_DISPATCH was measured
    m = build(spec, device)
    cluster = one_group_cluster(catalog)
    result = {"device": name, "catalog": catalog, "torch": torch.__version__, "model": spec.name,
              "layers": spec.num_layers, "config": cfg, "method": __doc__.split("\n\n")[1:3], "points": []}
    points = []
    for context in cfg["contexts"]:
        for batch in cfg["batches"]:
            if context + cfg["new"] > spec.seq_length:
                continue
            p = measure(m, spec, device, batch, context, cfg)
            p["predicted_s"] = predicted(cluster, spec, [p], cfg["new"])[0]
            p["error"] = (p["predicted_s"] - p["decode_step_s"]) / p["decode_step_s"]
            step = gen.decode_step(cluster, "g", spec, batch, context + cfg["new"] // 2)
            p["predicted_bound"] = step.bound
            points.append(p)
            print(f"batch {batch:4d} context {context:5d}: measured {p['decode_step_s'] * 1e3:8.3f} ms/step "
                  f"({p['decode_tokens_per_s']:9.1f} tokens/s), predicted {p['predicted_s'] * 1e3:8.3f} ms "
                  f"({step.bound}-bound), error {p['error']:+.1%}", flush=True)
            result["points"] = points
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    shipped = worst(points, [p["predicted_s"] for p in points])
    launch, eff, err = fit(cluster, spec, points, cfg["new"])
    result["check"] = {"largest_error": shipped, "target": TARGET, "within_target": shipped <= TARGET,
                       "kernel_launch_s": gen.KERNEL_LAUNCH_S, "memory_efficiency": gen.MEMORY_EFFICIENCY}
    result["fit"] = {"kernel_launch_s": launch, "memory_efficiency": eff, "largest_error": err}
    print(f"shipped decode model: largest error {shipped:.1%} (target {TARGET:.0%})")
    print(f"fitted: KERNEL_LAUNCH_S = {launch * 1e6:.1f} us, memory efficiency {eff:.2f}: largest error {err:.1%}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if shipped <= TARGET or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
