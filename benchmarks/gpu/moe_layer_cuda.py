"""One MoE layer's forward and backward on one accelerator: grouped GEMM against the loop over experts,
uniform and Zipf routing, Mixtral-shaped and Qwen3-30B-A3B-shaped, beside the predictor's expert time.

Layer: hetero.runtime.moe.MoEMLP (router, top-k, routed SwiGLU experts) in bf16 with random weights.
The routing is fixed per point so that both expert computes see the same assignments: ``uniform``
draws each token's top-k experts uniformly without replacement, ``zipf`` with probability
proportional to 1 / (rank + 1)^1.2 over a random order of the experts (a skewed router: the busiest
expert takes several times the mean load, printed as max/mean). A point: TOKENS tokens through the
layer, forward then backward of the output's sum, median of REPS runs after WARM, the device
synchronised around each call; ``grouped`` runs torch._grouped_mm (where the backend says the device
has it: Hopper CUDA, bf16), ``loop`` one MLP per expert. The ratio loop / grouped is measured in the same run.

Predicted: the predictor's routed-expert forward + backward seconds (predictor.moe.expert_times over
predictor.moe.received_assignments at the point's measured max/mean load: the loop over experts its op
model describes) for the catalog device, printed beside the measured layer (which adds the router,
the sorting and the gather / scatter of rows); recorded, not judged.

    python benchmarks/gpu/moe_layer_cuda.py benchmarks/data/h200/moe_layer.json [--catalog H200]
Without CUDA it says so and exits 0. ``--device cpu --quick`` runs tiny shapes on the CPU in fp32,
loop only (a check that the script works, not a measurement to keep)."""
import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import hetero  # noqa: E402
from hetero.runtime.model import MLP  # noqa: E402
from hetero.runtime.moe import MoEMLP, uses_grouped_gemm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_model_cuda import CATALOG_BY_NAME  # noqa: E402
from generate_cuda import timed  # noqa: E402  (the same synchronised median timer)

SHAPES = {   # hidden, expert width, experts, top-k (the models' published configs)
    "mixtral-8x7b": {"hidden_size": 4096, "expert_ffn_hidden_size": 14336, "num_experts": 8, "top_k": 2},
    "qwen3-30b-a3b": {"hidden_size": 2048, "expert_ffn_hidden_size": 768, "num_experts": 128, "top_k": 8},
}
QUICK_SHAPES = {
    "mixtral-like": {"hidden_size": 64, "expert_ffn_hidden_size": 224, "num_experts": 8, "top_k": 2},
    "qwen3-like": {"hidden_size": 32, "expert_ffn_hidden_size": 16, "num_experts": 32, "top_k": 4},
}
FULL = {"tokens": (4096, 16384), "warm": 3, "reps": 10, "dtype": "bf16"}
QUICK = {"tokens": (256,), "warm": 1, "reps": 3, "dtype": "fp32"}
ZIPF_S = 1.2


def spec_for(shape: dict, dtype: str):
    h = shape["hidden_size"]
    return hetero.load_model({"name": "moe-layer", "architecture": "llama", "num_layers": 1, "hidden_size": h,
                              "num_attention_heads": max(1, h // 128), "vocab_size": 128, "seq_length": 128,
                              "dtype": dtype, "moe": {k: shape[k] for k in ("num_experts", "top_k",
                                                                            "expert_ffn_hidden_size")}})


def routing(n: int, experts: int, k: int, kind: str, seed: int) -> torch.Tensor:
    """Each token's k distinct experts (n x k), uniform or Zipf over a random order of the experts."""
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        weights = torch.ones(experts)
    else:
        weights = torch.empty(experts)
        weights[torch.randperm(experts, generator=g)] = 1.0 / (torch.arange(experts) + 1.0) ** ZIPF_S
    return torch.multinomial(weights.expand(n, experts), k, replacement=False, generator=g)


def measure(layer: MoEMLP, index: torch.Tensor, x: torch.Tensor, compute: str, cfg: dict) -> float:
    n, k = index.shape
    weights = torch.full((n, k), 1.0 / k, device=x.device)
    probs = torch.full((n, layer.num_experts), 1.0 / layer.num_experts, device=x.device)
    layer.route = lambda _x: (index, weights, probs)   # the point's routing, the same for both computes
    layer.expert_compute = compute

    def step():
        layer.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        layer(xi).float().sum().backward()

    return timed(step, x.device, cfg["warm"], cfg["reps"])


def predicted_experts_s(catalog: str, spec, tokens: int, imbalance: float) -> float | None:
    """The predictor's routed-expert forward + backward seconds for this layer on ``catalog`` (one device)."""
    try:
        from predictor.costs import StageCostModel
        from predictor.moe import expert_times, received_assignments
    except ImportError:
        return None
    try:
        cluster = hetero.load_cluster({"name": "one", "groups": [
            {"name": "g", "device": catalog, "nodes": 1, "devices_per_node": 1}]})
        cm = StageCostModel(cluster, spec)
    except Exception as e:  # noqa: BLE001 - the comparison is informative; say why it is missing
        print(f"  (no prediction: {str(e).splitlines()[0]})")
        return None
    got = received_assignments(spec, tokens, 1, spec.moe.num_experts, imbalance)
    f, b = expert_times(cm, "g", 1, got, spec.moe.num_experts)
    return f + b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", help="JSON file to write (default: print only)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--catalog", help="the catalog device this GPU is (default: from its name)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, fp32, loop only (checks the script)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("moe_layer_cuda: no CUDA device here; nothing measured (--device cpu --quick checks the script)")
        return 0
    device = torch.device(args.device)
    cfg = QUICK if args.quick else FULL
    shapes = QUICK_SHAPES if args.quick else SHAPES
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    catalog = args.catalog or ("cpu" if device.type == "cpu" else
                               next((c for key, c in CATALOG_BY_NAME if key in name), None))
    dtype = torch.bfloat16 if cfg["dtype"] == "bf16" else torch.float32
    result = {"device": name, "catalog": catalog, "torch": torch.__version__, "config": cfg, "zipf_s": ZIPF_S,
              "method": __doc__.split("\n\n")[1:3], "points": []}
    for shape_name, shape in shapes.items():
        spec = spec_for(shape, cfg["dtype"])
        torch.manual_seed(0)
        with torch.device(device):
            layer = MoEMLP(spec, MLP).to(dtype)
        grouped_ok = uses_grouped_gemm(device, dtype) if not args.quick else False
        computes = ["loop"] + (["grouped"] if grouped_ok else [])
        for tokens in cfg["tokens"]:
            x = torch.randn(tokens, shape["hidden_size"], device=device, dtype=dtype)
            for kind in ("uniform", "zipf"):
                index = routing(tokens, shape["num_experts"], shape["top_k"], kind, seed=tokens).to(device)
                load = torch.bincount(index.reshape(-1), minlength=shape["num_experts"]).float()
                imbalance = float(load.max() / load.mean())
                point = {"shape": shape_name, **shape, "tokens": tokens, "routing": kind,
                         "max_over_mean_load": imbalance}
                for compute in computes:
                    point[f"{compute}_s"] = measure(layer, index, x, compute, cfg)
                if "grouped_s" in point:
                    point["loop_over_grouped"] = point["loop_s"] / point["grouped_s"]
                point["predicted_experts_s"] = (predicted_experts_s(catalog, spec, tokens, imbalance)
                                                if catalog else None)
                result["points"].append(point)
                text = " ".join(f"{c} {point[c + '_s'] * 1e3:9.3f} ms" for c in computes)
                extra = f" loop/grouped {point['loop_over_grouped']:.2f}x" if "grouped_s" in point else ""
                pred = point["predicted_experts_s"]
                pred_text = f" predicted experts {pred * 1e3:9.3f} ms" if pred else ""
                print(f"{shape_name:14s} tokens {tokens:6d} {kind:7s} (max/mean load {imbalance:4.2f}): "
                      f"{text}{extra}{pred_text}", flush=True)
                if args.out:
                    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if not any("grouped_s" in p for p in result["points"]):
        print("grouped GEMM: not run (the device's backend has none, or --quick)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
