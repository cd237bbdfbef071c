"""Measure whole-model training steps of the runtime's own model (hetero.runtime.model) on the local
CUDA GPU: forward (loss included), backward and the AdamW step, each between CUDA events, medians of
REPS steps after WARM warm-up steps, and the peak allocated memory of a step. fp32 with TF32 off (as
the NeuSight records), bf16 under torch.autocast. Writes JSON (argv[1]); benchmarks/bench_h100.py
compares it with hetero predict. Run from the repository root on a machine with a CUDA GPU:
    python benchmarks/gpu/step_cuda.py benchmarks/data/h100/steps.json [MODEL ...]"""
import dataclasses, json, statistics, sys
import torch
import hetero
from hetero.runtime.model import build_stage, loss_fn
from hetero.runtime.grads import make_optimizer

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
out = []
WARM, REPS = 3, 10
CONFIGS = (  # (model, dtype, micro-batches, layers kept: None = all; a 7B model's fp32 Adam state needs ~112 GB)
    ("gpt2-large", "fp32", (1, 2, 4, 8), None), ("gpt2-large", "bf16", (4, 8, 16), None),
    ("gpt3-1.3b", "bf16", (2, 4, 8), None), ("llama2-7b", "bf16", (1, 2, 4), 8))
ONLY = sys.argv[2:]  # model names to measure (default: all)
for model_name, dtype, batches, layers in CONFIGS:
    if ONLY and model_name not in ONLY:
        continue
    spec = dataclasses.replace(hetero.load_model(f"configs/models/{model_name}.yaml"), dtype=dtype)
    if layers:
        spec = dataclasses.replace(spec, num_layers=layers)
    for b in batches:
        torch.cuda.empty_cache()
        m = build_stage(spec, (0, spec.num_layers), True, True, 0).cuda()
        opt = make_optimizer(m.parameters(), 1e-4, 0.0)
        s = spec.seq_length
        tok = torch.randint(0, spec.vocab_size, (b, s + 1), device="cuda")
        ac = torch.autocast("cuda", dtype=torch.bfloat16) if dtype == "bf16" else torch.autocast("cuda", enabled=False)
        f_ms, b_ms, o_ms = [], [], []
        peak = 0
        try:
            for it in range(WARM + REPS):
                opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
                e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                e[0].record()
                with ac:
                    loss = loss_fn(m(tok[:, :-1], 0), tok[:, 1:])
                e[1].record()
                loss.backward()
                e[2].record()
                opt.step()
                e[3].record()
                torch.cuda.synchronize()
                if it >= WARM:
                    f_ms.append(e[0].elapsed_time(e[1])); b_ms.append(e[1].elapsed_time(e[2])); o_ms.append(e[2].elapsed_time(e[3]))
                    peak = max(peak, torch.cuda.max_memory_allocated())
            row = {"model": model_name, "dtype": dtype, "batch": b, "seq": s, "num_layers": spec.num_layers,
                   "forward_ms": statistics.median(f_ms), "backward_ms": statistics.median(b_ms),
                   "optimizer_ms": statistics.median(o_ms), "peak_allocated_bytes": peak,
                   "forward_ms_all": f_ms, "backward_ms_all": b_ms}
        except torch.cuda.OutOfMemoryError:
            row = {"model": model_name, "dtype": dtype, "batch": b, "error": "OOM"}
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
        out.append(row)
        del m, opt
        with open(sys.argv[1], "w") as f:  # after every run, so a later failure keeps what was measured
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": out}, f, indent=1)
