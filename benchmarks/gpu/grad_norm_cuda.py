"""The squared gradient norm of a step on the local CUDA GPU, three ways, for GPT-2-large's 774 M
fp32 gradients (random; the runtime's own stage, every layer): (a) one dot product per tensor, each
read back (one wait per tensor), (b) one dot product per tensor, summed on the device and read back
once, (c) torch's multi-tensor norm (hetero.runtime.grads.sum_of_squares on a GPU), read back once;
and (d) the runtime's whole gradient step on one rank (hetero.runtime.grads.sync_gradients, then
weighted_squares: every tensor held by this rank alone, so only the norm). Wall time with the device waited for, median of
20 after 3 warm-ups. Run from the repository root on a machine with a CUDA GPU:
    python benchmarks/gpu/grad_norm_cuda.py [out.json]"""
import json
import statistics
import sys
import time

import torch

import hetero
from hetero.runtime.grads import build_buckets, sum_of_squares, sync_gradients, weighted_squares
from hetero.runtime.model import build_stage

spec = hetero.load_model("configs/models/gpt2-large.yaml")
module = build_stage(spec, (0, spec.num_layers), True, True, 0).cuda()
for p in module.parameters():
    p.grad = torch.randn_like(p)
grads = [p.grad for p in module.parameters()]
names = [n for n, _ in module.named_parameters()]
holders = {n: (0,) for n in names}
buckets = build_buckets(holders, names, 0)


def per_tensor_read_back():
    return sum(float(torch.dot(g.reshape(-1), g.reshape(-1))) for g in grads)


def per_tensor_one_read_back():
    return float(torch.stack([torch.dot(g.reshape(-1), g.reshape(-1)) for g in grads]).sum())


def multi_tensor():
    return float(sum_of_squares(grads))


def runtime_sync():
    return weighted_squares(sync_gradients(module, buckets, holders, None, 1))


rows = {}
for name, fn in (("dot per tensor, read back each", per_tensor_read_back),
                 ("dot per tensor, read back once", per_tensor_one_read_back),
                 ("multi-tensor norm, read back once", multi_tensor),
                 ("runtime sync_gradients (one rank)", runtime_sync)):
    times = []
    for i in range(23):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        value = fn()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    rows[name] = {"median_ms": statistics.median(times) * 1e3, "value": value}
    print(f"{name:36s} {rows[name]['median_ms']:7.2f} ms   sum of squares {value:.6e}", flush=True)
ref = rows["dot per tensor, read back each"]["value"]
assert all(abs(r["value"] / ref - 1) < 1e-4 for r in rows.values()), rows
out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "tensors": len(grads),
       "parameters": sum(g.numel() for g in grads), "rows": rows}
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
