"""One MoE layer's forward and backward on the local CUDA GPU: grouped GEMM against the loop over
experts, uniform and Zipf routing, Mixtral-shaped and Qwen3-30B-A3B-shaped, against the predictor.

Shapes (hetero.runtime.moe.MoEMLP, SwiGLU experts, bf16 autocast over fp32 weights as training runs):
- mixtral: hidden 4096, 8 experts of width 14336, top-2;
- qwen3-30b-a3b: hidden 2048, 128 experts of width 768, top-8.
Tokens per micro-batch: 8192 (4 x 2048). Routing is imposed (the router's own top-k replaced) so
both paths see the same assignments: ``uniform`` (each token's k experts drawn without replacement,
all equally likely) and ``zipf`` (drawn with probability proportional to 1 / rank^1.2 of a fixed
expert order: the busiest expert takes several times the mean). For each (shape, routing, path):
forward + backward of the layer (the router, the expert compute, the combine) between CUDA
synchronisations, median of REPS after WARM warm-ups; the expert load's max / mean; and, for the
loop, the predictor's expert time (predictor.moe.expert_times on the catalog H200: an even share of
the assignments per expert, one expert after another, forward + backward), predicted / measured.
grouped / loop is the speed-up of the grouped GEMM (torch._grouped_mm, Hopper, bf16).

Writes JSON (argv[1]) after every point, so a later failure keeps what was measured. Run from the
repository root on a machine with a CUDA GPU:
    python benchmarks/gpu/moe_cuda.py benchmarks/data/h200/moe.json
Without CUDA it says so and exits 0. ``--device cpu --quick`` runs tiny shapes on the CPU (a check
that the script works; grouped there is torch's CPU fallback, not a measurement to keep)."""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import hetero  # noqa: E402
from hetero.runtime.model import MLP  # noqa: E402
from hetero.runtime.moe import MoEMLP  # noqa: E402

SHAPES = {"mixtral": (4096, 8, 14336, 2), "qwen3-30b-a3b": (2048, 128, 768, 8)}   # hidden, experts, width, top-k
QUICK_SHAPES = {"tiny-8x2": (64, 8, 128, 2), "tiny-32x4": (64, 32, 32, 4)}
FULL = {"tokens": 8192, "warm": 3, "reps": 10}
QUICK = {"tokens": 256, "warm": 1, "reps": 3}
ZIPF_S = 1.2


def spec_of(name: str, hidden: int, experts: int, width: int, top_k: int):
    return hetero.load_model({"name": name, "architecture": "llama", "num_layers": 1, "hidden_size": hidden,
                              "num_attention_heads": max(1, hidden // 128), "vocab_size": 32000, "seq_length": 2048,
                              "dtype": "bf16", "moe": {"num_experts": experts, "top_k": top_k,
                                                       "expert_ffn_hidden_size": width, "balance": "none"}})


def routing(kind: str, tokens: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Expert indices (tokens, top_k), distinct per token."""
    if kind == "uniform":
        p = torch.ones(experts)
    else:
        p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** ZIPF_S
    return torch.multinomial(p.float().expand(tokens, experts), top_k, replacement=False, generator=gen)


class ImposedRouting(MoEMLP):
    """The MoE MLP with its top-k choice replaced by ``self.index`` (the router still runs: its scores
    give the gate weights of the imposed experts)."""

    index: torch.Tensor

    def route(self, x):
        _, _, probs = super().route(x)
        weights = probs.gather(1, self.index)
        return self.index, weights / weights.sum(-1, keepdim=True), probs


def measure(layer, x, device, warm: int, reps: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(warm + reps):
        layer.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = layer(xi)
        out.float().square().mean().backward()
        sync()
        if i >= warm:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def predicted_loop_s(spec, assignments: float) -> float | None:
    """The predictor's forward + backward seconds of the routed experts on one catalog H200."""
    try:
        from predictor.api import cost_model_for
        from predictor.moe import expert_times

        cluster = hetero.load_cluster({"name": "one-h200", "groups": [{"name": "g", "device": "H200", "nodes": 1,
                                                                        "devices_per_node": 1}]})
        fwd, bwd = expert_times(cost_model_for(cluster, spec), "g", 1, assignments, spec.moe.num_experts)
        return fwd + bwd
    except Exception as e:  # noqa: BLE001 - the measurement stands without the prediction
        print(f"  (no prediction: {type(e).__name__}: {e})", flush=True)
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=None, help="JSON file for the results")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a check of the script)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 0
    cfg, shapes = (QUICK, QUICK_SHAPES) if args.quick else (FULL, SHAPES)
    results = {"method": __doc__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "tokens": cfg["tokens"], "points": []}
    for name, (hidden, experts, width, top_k) in shapes.items():
        spec = spec_of(name, hidden, experts, width, top_k)
        torch.manual_seed(0)
        layer = ImposedRouting(spec, MLP).to(device)
        x = torch.randn(cfg["tokens"], hidden, device=device)
        for kind in ("uniform", "zipf"):
            index = routing(kind, cfg["tokens"], experts, top_k, torch.Generator().manual_seed(1))
            layer.index = index.to(device)
            load = torch.bincount(index.reshape(-1), minlength=experts).float()
            point = {"shape": name, "routing": kind, "hidden": hidden, "experts": experts, "width": width,
                     "top_k": top_k, "max_over_mean_load": float(load.max() / load.mean())}
            for path in ("loop", "grouped"):
                layer.expert_compute = path
                try:
                    point[f"{path}_s"] = measure(layer, x, device, cfg["warm"], cfg["reps"])
                except Exception as e:  # noqa: BLE001 - keep the other path's figure
                    point[f"{path}_error"] = f"{type(e).__name__}: {e}"
            if "loop_s" in point and "grouped_s" in point:
                point["grouped_over_loop_speedup"] = point["loop_s"] / point["grouped_s"]
            predicted = predicted_loop_s(spec, cfg["tokens"] * top_k) if device.type == "cuda" else None
            if predicted is not None and "loop_s" in point:
                point["predicted_loop_s"] = predicted
                point["predicted_over_measured"] = predicted / point["loop_s"]
            results["points"].append(point)
            print(json.dumps(point), flush=True)
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
