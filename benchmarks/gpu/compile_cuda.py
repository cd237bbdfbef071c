"""`hetero launch` with compiled stages against the compiled bare step, on the local CUDA GPU, in one run.

For each configuration (GPT-2-large bf16, micro-batch 8 x 1024; Llama-2-7B cut to 8 layers, bf16,
micro-batch 2 x 4096), one micro-batch per step:

- bare: the runtime's stage model (hetero.runtime.model) with every block under torch.compile
  (compile_blocks, what `hetero launch --compile` does), bf16 autocast over fp32 weights, fused
  AdamW; forward + backward + optimizer between CUDA synchronisations, median of REPS steps after
  WARM warm-up steps (compilation included in the warm-up);
- launch: `hetero launch` on one rank of this GPU (compiled by default on CUDA), STEPS steps, the
  summary's median of the steady steps, and the step the run predicted for itself
  (``predicted_iteration_time_s``: the catalog's specs, a fresh machine has no profile);

then tokens/s of each, launch / bare (the target: >= 0.95) and predicted / measured (target:
within 15%). Writes JSON (argv[1]) after every configuration, so a later failure keeps what was
measured. Run from the repository root on a machine with a CUDA GPU:
    python benchmarks/gpu/compile_cuda.py benchmarks/data/h100/compile.json"""
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_h100 import launch_summary  # noqa: E402  (one builder of the H100 runs)

import hetero  # noqa: E402
from hetero.runtime.grads import make_optimizer  # noqa: E402
from hetero.runtime.model import build_stage, compile_blocks, loss_fn  # noqa: E402

WARM, REPS, STEPS = 5, 10, 10
CONFIGS = (("gpt2-large", "bf16", 8, None), ("llama2-7b", "bf16", 2, 8))  # (model, dtype, micro-batch, layers kept)


def bare_step(model: str, dtype: str, batch: int, layers) -> dict:
    spec = dataclasses.replace(hetero.load_model(str(REPO / "configs" / "models" / f"{model}.yaml")), dtype=dtype)
    if layers:
        spec = dataclasses.replace(spec, num_layers=layers)
    torch.cuda.empty_cache()
    m = build_stage(spec, (0, spec.num_layers), True, True, 0).cuda()
    compile_blocks(m)
    opt = make_optimizer(m.parameters(), 1e-4, 0.0)
    tok = torch.randint(0, spec.vocab_size, (batch, spec.seq_length + 1), device="cuda")
    times = []
    t_compile = time.perf_counter()
    for it in range(WARM + REPS):
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = m(tok[:, :-1])
        loss_fn(logits, tok[:, 1:]).backward()
        opt.step()
        torch.cuda.synchronize()
        if it == 0:
            t_compile = time.perf_counter() - t_compile
        if it >= WARM:
            times.append(time.perf_counter() - t0)
    del m, opt
    step = statistics.median(times)
    return {"bare_step_s": step, "bare_tokens_per_s": batch * spec.seq_length / step,
            "bare_first_step_s": t_compile}


def launch_step(model: str, dtype: str, batch: int, layers) -> dict:
    run = {"model": model, "dtype": dtype, "batch": batch, "micro_batches": 1, "num_layers": layers}
    s, error = launch_summary(run, STEPS)
    if s is None:
        return {"launch_error": error}
    step = s["median_iteration_time_s"]
    return {"launch_step_s": step, "launch_tokens_per_s": batch * s["seq_length"] / step,
            "launch_iteration_times_s": s["iteration_times_s"], "compiled_blocks": s.get("compiled_blocks"),
            "predicted_iteration_time_s": s["predicted_iteration_time_s"]}


out = []
for model, dtype, batch, layers in CONFIGS:
    row = {"model": model, "dtype": dtype, "micro_batch": batch, "num_layers": layers}
    row.update(bare_step(model, dtype, batch, layers))
    row.update(launch_step(model, dtype, batch, layers))
    if "launch_step_s" in row:
        row["launch_over_bare"] = row["launch_tokens_per_s"] / row["bare_tokens_per_s"]
        if row["predicted_iteration_time_s"]:
            row["predicted_over_measured"] = row["predicted_iteration_time_s"] / row["launch_step_s"]
    print(json.dumps({k: v for k, v in row.items() if k != "launch_iteration_times_s"}), flush=True)
    out.append(row)
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "warm": WARM, "reps": REPS,
                   "steps": STEPS, "method": __doc__.split("\n\n")[1], "runs": out}, f, indent=1)
