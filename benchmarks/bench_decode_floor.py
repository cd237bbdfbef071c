"""The host's dispatch floor of generation on this CPU: what one decode step of
:func:`hetero.rl.generate.generate` costs when the model is too small for its arithmetic to matter.

Method (:mod:`hetero.measure.decode_floor`, which ``hetero profile`` runs on a smaller set of cases):
tiny models (gpt and llama, 1-8 layers, hidden 64), rows 1-16, temperature 1.0 with a stop
string (as the RL rollout samples). One decode step's seconds = (generate with N new tokens - generate
with 1) / (N - 1), median of ``--repeats`` runs, one thread. A least-squares fit of
``step = per_step + per_layer[architecture] x layers + per_row x rows`` over all cases gives the floor
the predictor uses (:data:`hetero.predictor.generation.CPU_DISPATCH`: a llama layer issues more kernels
than a gpt one: RoPE, the gated MLP, the grouped keys and values); the first call (prefill and the
first token) of the same calls gets its own figures the same way. Also the weight sync's checksum rate
(a host copy and CRC32 of every piece, on both sides of every sync).

    python benchmarks/bench_decode_floor.py [--repeats 5] [--out benchmarks/results/decode_floor_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def checksum_rate(repeats: int) -> dict:
    """Bytes per second of the weight sync's per-piece checksum (:func:`hetero.rl.sync.crc`: a host
    copy and CRC32) on a 64 MiB fp32 tensor, the best of ``repeats`` (one core's rate)."""
    import torch

    from hetero.rl.sync import crc

    t = torch.randn(16 * 2**20)
    best = min(_time_once(lambda: crc(t)) for _ in range(repeats))
    return {"bytes": t.numel() * 4, "best_s": best, "bytes_per_s": t.numel() * 4 / best}


def whole_copy_rate(repeats: int) -> dict:
    """Seconds per parameter tensor of building a temporary whole copy (:func:`hetero.rl.sync.whole_model`,
    what a collocated rank makes each step) of the 4-layer tiny GPT, the best of ``repeats``."""
    import torch

    import hetero
    from hetero.rl.sync import whole_model

    spec = hetero.load_model(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                                          "models", "tiny.yaml"))
    tensors = len(whole_model(spec, torch.device("cpu"))[1])
    best = min(_time_once(lambda: whole_model(spec, torch.device("cpu"))) for _ in range(repeats))
    return {"model": "tiny", "tensors": tensors, "best_s": best, "per_tensor_s": best / tensors}


def _time_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new", type=int, default=16, help="new tokens of the long call")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "decode_floor_cpu.json"))
    ap.add_argument("--checksum-only", action="store_true",
                    help="measure the sync's checksum rate alone and update it in --out")
    args = ap.parse_args(argv)
    if args.checksum_only:
        with open(args.out) as f:
            out = json.load(f)
        out["sync_checksum"] = checksum_rate(args.repeats)
        out["sync_checksum"]["load_avg_1min"] = os.getloadavg()[0]
        out["whole_copy"] = whole_copy_rate(4 * args.repeats)
        print(f"checksum: {out['sync_checksum']['bytes_per_s'] / 1e9:.2f} GB/s; whole copy: "
              f"{out['whole_copy']['per_tensor_s'] * 1e6:.1f} us per tensor")
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        return 0
    import torch

    from hetero.measure.decode_floor import fit, measure_cases

    rows = measure_cases((1, 2, 4, 8), (1, 4, 8, 16), repeats=args.repeats, new=args.new)
    for r in rows:
        print(f"{r['arch']:5s} layers {r['layers']}  rows {r['rows']:2d}: prefill+first {r['first_call_s'] * 1e3:7.3f} ms  "
              f"decode step {r['decode_step_s'] * 1e3:7.3f} ms", flush=True)
    dec, dec_err = fit(rows, "decode_step_s")
    pre, pre_err = fit(rows, "first_call_s")
    for name, c, err in (("decode step", dec, dec_err), ("prefill + first token", pre, pre_err)):
        print(f"{name} = {c[0] * 1e6:.1f} us + {c[1] * 1e6:.1f} us/gpt layer ({c[2] * 1e6:.1f} us/llama layer) "
              f"+ {c[3] * 1e6:.1f} us/row (largest residual {err:.1%})")
    out = {"method": "median of %d runs, one thread; decode step = (N=%d new tokens - 1) / (N - 1); "
                     "least squares over the cases" % (args.repeats, args.new),
           "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                       "torch": torch.__version__, "load_avg_1min": os.getloadavg()[0]},
           "decode_step_fit_s": {"per_step": dec[0], "per_layer": {"gpt": dec[1], "llama": dec[2]},
                                 "per_row": dec[3], "largest_residual": dec_err},
           "first_call_fit_s": {"per_step": pre[0], "per_layer": {"gpt": pre[1], "llama": pre[2]},
                                "per_row": pre[3], "largest_residual": pre_err},
           "cases": rows, "sync_checksum": checksum_rate(args.repeats), "whole_copy": whole_copy_rate(4 * args.repeats)}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
