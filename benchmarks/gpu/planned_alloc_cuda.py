"""The planned allocator on a CUDA GPU against PyTorch's caching allocator: fragmentation, step time,
and a step that fits only with the planned arena. Not run in CI (needs a GPU). Run from the
repository root:
    python benchmarks/gpu/planned_alloc_cuda.py benchmarks/data/h100/planned_alloc.json [MODEL ...]

Method. Every measurement runs in a fresh process (the pluggable allocator must be installed before
the process's first CUDA allocation): the runtime's whole-model stage (hetero.runtime.model, selective
recomputation, AdamW) trains STEPS steps at one micro-batch size, with the planned allocator marking
steps and the gradient-norm phase as the runtime does (steps 1-2 recorded, served from step 3).
- fragmentation: caching 1 - max_memory_allocated / max_memory_reserved (torch.cuda); planned
  1 - peak_live / reserved (the allocator's counters: arena + fallback pool). Reduction: 1 - planned /
  caching (the issue's target: >= 80%).
- step time: the median of the served steps (3..STEPS), CUDA-synchronised wall time, both allocators
  at the same micro-batch size (target: within 2%).
- fits only with the arena: a ballast tensor takes the device's memory down to what the planned run
  used at its peak (torch.cuda.mem_get_info, sampled after every step) plus MARGIN; then both
  allocators run the same step again under that ballast: "ran" or "OOM" for each.
Writes JSON (argv[1]) after every configuration, so a later failure keeps what was measured.
"""
import dataclasses
import json
import statistics
import subprocess
import sys
import time

STEPS = 8
MARGIN = 256 << 20
CONFIGS = (("gpt2-large", "bf16", 8, None), ("gpt3-1.3b", "bf16", 4, None), ("llama2-7b", "bf16", 2, 8))


def child(kind: str, model_name: str, dtype: str, mbs: int, layers, ballast: int) -> dict:
    import torch

    alloc = None
    if kind == "planned":
        from hetero.memplan.serve import PlannedAllocator

        alloc = PlannedAllocator("cuda")
        if not alloc.install():
            return {"kind": kind, "error": f"install failed: {alloc.failure}"}
    import hetero
    from hetero.runtime.grads import make_optimizer
    from hetero.runtime.model import build_stage, loss_fn

    keep = torch.empty(ballast, dtype=torch.uint8, device="cuda") if ballast else None
    spec = dataclasses.replace(hetero.load_model(f"configs/models/{model_name}.yaml"), dtype=dtype)
    if layers:
        spec = dataclasses.replace(spec, num_layers=layers)
    total = torch.cuda.mem_get_info()[1]
    times, used = [], 0
    try:
        m = build_stage(spec, (0, spec.num_layers), True, True, 0).cuda()
        m.set_recompute("selective")
        opt = make_optimizer(m.parameters(), 1e-4, 0.0)
        tok = torch.randint(0, spec.vocab_size, (mbs, spec.seq_length + 1), device="cuda")
        ac = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16")
        for step in range(1, STEPS + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if alloc:
                alloc.begin_step(step)
            opt.zero_grad(set_to_none=True)
            with ac:
                loss = loss_fn(m(tok[:, :-1], 0), tok[:, 1:])
            loss.backward()
            if alloc:
                alloc.set_phase(1)
            opt.step()
            torch.cuda.synchronize()
            if alloc:
                alloc.end_step(step)
            times.append(time.perf_counter() - t0)
            used = max(used, total - torch.cuda.mem_get_info()[0])
    except torch.cuda.OutOfMemoryError:
        return {"kind": kind, "result": "OOM"}
    except RuntimeError as e:   # the pluggable allocator's failed cudaMalloc surfaces as a RuntimeError
        if "out of memory" not in str(e).lower():
            raise
        return {"kind": kind, "result": "OOM"}
    del keep
    row = {"kind": kind, "result": "ran", "step_s": statistics.median(times[2:]), "step_s_all": times,
           "device_used_bytes": used, "device_total_bytes": total, "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__}
    if alloc:
        row.update(alloc.stats())
        row["fragmentation"] = 1 - row["peak_live_bytes"] / row["reserved_bytes"]
    else:
        row.update(reserved_bytes=torch.cuda.max_memory_reserved(), peak_live_bytes=torch.cuda.max_memory_allocated())
        row["fragmentation"] = 1 - row["peak_live_bytes"] / row["reserved_bytes"]
    return row


def run_child(*args) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], capture_output=True, text=True,
                          timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"kind": args[0], "error": (proc.stderr or proc.stdout)[-1500:]}
    return json.loads(lines[-1])


def main() -> int:
    if sys.argv[1] == "--child":
        print(json.dumps(child(*json.loads(sys.argv[2]))), flush=True)
        return 0
    only = sys.argv[2:]   # no CUDA in this process: each child has the device to itself
    out = []
    for model_name, dtype, mbs, layers in CONFIGS:
        if only and model_name not in only:
            continue
        row = {"model": model_name, "dtype": dtype, "micro_batch_size": mbs, "num_layers": layers}
        row["caching"] = run_child("caching", model_name, dtype, mbs, layers, 0)
        row["planned"] = run_child("planned", model_name, dtype, mbs, layers, 0)
        c, p = row["caching"], row["planned"]
        if c.get("result") == "ran" and p.get("result") == "ran":
            row["fragmentation_reduction"] = 1 - p["fragmentation"] / c["fragmentation"] if c["fragmentation"] else 0.0
            row["step_time_ratio"] = p["step_s"] / c["step_s"]
            free = p["device_total_bytes"] - p["device_used_bytes"] - MARGIN
            # the ballast leaves the planned run's peak plus MARGIN: does each allocator fit there?
            row["ballast_bytes"] = max(0, free)
            row["under_ballast"] = {k: run_child(k, model_name, dtype, mbs, layers, row["ballast_bytes"]).get("result")
                                    for k in ("caching", "planned")}
        print(json.dumps({k: v for k, v in row.items() if k not in ("caching", "planned")}), flush=True)
        out.append(row)
        with open(sys.argv[1], "w") as f:
            json.dump({"device": p.get("device"), "torch": p.get("torch"), "steps": STEPS,
                       "margin_bytes": MARGIN, "runs": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
