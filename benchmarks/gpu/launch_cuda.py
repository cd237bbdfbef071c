"""Whole training steps through `hetero launch` on the local CUDA GPU: the native engine placing one
stage on the GPU (one rank, one pipeline), so the figure is the runtime's own step (schedule,
gradient-norm all-reduce, fused AdamW with the clip factor, metrics), not an isolated model call.
For each configuration: STEPS steps, the summary's median of the steady steps (the first is
warm-up), per-micro-batch forward / backward and the optimizer time of the rank, and the
prediction the run made for itself (catalog specs: a fresh machine has no cached profile).
Writes JSON (argv[1]); benchmarks/bench_h100.py compares it with hetero predict. Run from the
repository root on a machine with a CUDA GPU:
    python benchmarks/gpu/launch_cuda.py benchmarks/data/h100/launch.json"""
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_h100 import launch_summary  # noqa: E402  (one builder of the H100 runs)

STEPS = 8
CONFIGS = (  # (model, dtype, micro-batch size, micro-batches, layers kept: None = all)
    ("gpt2-large", "fp32", 4, 2, None), ("gpt2-large", "bf16", 8, 2, None), ("gpt3-1.3b", "bf16", 4, 2, None),
    ("llama2-7b", "bf16", 2, 2, 8))
out = []
for model, dtype, batch, m, layers in CONFIGS:
    run = {"model": model, "dtype": dtype, "batch": batch, "micro_batches": m, "num_layers": layers}
    s, error = launch_summary(run, STEPS)
    if s is None:
        row = {**run, "error": error}
    else:
        r = s["ranks"][0]
        row = {**run, "device": r["device"], "steps": s["steps"], "losses": s["losses"],
               "iteration_times_s": s["iteration_times_s"], "median_iteration_time_s": s["median_iteration_time_s"],
               "forward_time_s": r["forward_time_s"], "backward_time_s": r["backward_time_s"],
               "optimizer_time_s": r["optimizer_time_s"], "grad_sync_time_s": r["grad_sync_time_s"],
               "predicted_iteration_time_s": s["predicted_iteration_time_s"]}
    print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "iteration_times_s")}), flush=True)
    out.append(row)
    with open(sys.argv[1], "w") as f:  # after every run, so a later failure keeps what was measured
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": STEPS,
                   "runs": out}, f, indent=1)
