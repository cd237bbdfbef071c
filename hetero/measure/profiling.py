"""Measure operator latencies on this machine: what ``hetero profile`` runs (torch imported lazily).

:func:`default_grid` lists the operators of a transformer layer (linear, bmm, ln, softmax and the
elementwise ops) over a grid of shapes; :func:`measure` times them on the local device
(:func:`detect_device`) and returns :class:`~hetero.predictor.profiles.Record` s, which the CLI
writes to the cache that :mod:`hetero.predictor.profiles` reads.

Block probes (CPU). The operator sum misses what a real training step on a CPU spends around and
between the kernels: Python / autograd dispatch of ~50 kernels per block, the fused kernels the
runtime actually calls (``scaled_dot_product_attention`` instead of bmm + softmax + bmm, the tanh
GELU of GPT-2), gradient accumulation into ``.grad``. So ``hetero profile`` on a CPU also times the
runtime's own transformer block (:class:`hetero.runtime.model.Block`, forward and backward with
autograd) at a few shapes (:func:`default_block_probes`), and one AdamW step over its parameters
(the runtime's optimizer): :func:`measure_blocks`. The CLI stores them next to the records in
``<device>.meta.json``; :class:`~hetero.predictor.profiles.LocalOpModel` turns them into corrections.

Threads and load. Workers of ``hetero launch`` run ``--threads`` intra-op threads each (default 1),
so the CPU profile defaults to 1 thread too and records the count it used. Timings take the fastest
block of repeated calls (background load only ever adds time), so a profile taken on a busy machine
still describes the machine, not the load.
"""
from __future__ import annotations

import math
import re
import statistics
import time
from typing import Callable, Iterable, Mapping

from hetero.predictor.profiles import VECTOR_OPS, Record, moe_probe_model_dict, probe_model_dict

# --------------------------------------------------------------------------------------- grid
def default_grid(quick: bool = False) -> list[tuple[str, dict]]:
    """(op, dims) to measure: the operators of gpt/llama layers of hidden 256..2048.

    linear: rows (B=1, M = micro-batch x sequence) x K @ K x N for the qkv, out, fc1, fc2 shapes,
    plus a few wide (LM-head-like) N. bmm: attention scores and context for heads x batch in
    {16, 64}, sequence 128..1024, head dim 64/128. Vector ops: rows x H over the activations'
    shapes; softmax over attention rows (rows = batch x heads x seq, H = seq).
    Sized to take about two minutes on two CPU cores; ``quick`` is a few seconds (tests, smoke runs).
    """
    grid: list[tuple[str, dict]] = []
    if quick:
        hiddens, rows_list, bh_list, seqs, hds = (128, 256), (64, 256), (8,), (64, 128), (32,)
        vec_rows, vec_h, sm = (64, 512), (128, 512), ((512, 64), (2048, 128))
    else:
        # 32 rows: a mixture-of-experts layer's experts each take a few dozen tokens of a micro-batch
        hiddens, rows_list, bh_list, seqs, hds = (256, 512, 768, 1024, 2048), (32, 128, 512, 2048), \
            (16, 64), (128, 256, 512, 1024), (64, 128)
        vec_rows, vec_h = (128, 512, 2048, 8192), (256, 1024, 4096)
        sm = tuple((bh * s, s) for bh in (16, 64) for s in (128, 256, 512, 1024))
    for h in hiddens:
        for rows in rows_list:
            if rows * h > 2**21:
                continue  # > 2048 x 1024: seconds per operator on a small CPU; extrapolated instead
            for k, n in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)):
                grid.append(("linear", {"B": 1, "M": rows, "N": n, "K": k}))
    # LM heads: a vocabulary wide, at the widths of small and mid-sized models
    wide = ((64, 512), (256, 1024)) if quick else ((128, 256), (1024, 256), (128, 512), (128, 1024), (512, 1024))
    for rows, k in wide:
        for n in ((4096,) if quick else (2048, 8192, 16384)):
            grid.append(("linear", {"B": 1, "M": rows, "N": n, "K": k}))
    for bh in bh_list:
        for s in seqs:
            if bh * s > 2**15:
                continue
            for d in hds:
                grid.append(("bmm", {"B": bh, "M": s, "N": s, "K": d}))   # scores: q @ k^T
                grid.append(("bmm", {"B": bh, "M": s, "N": d, "K": s}))   # context: p @ v
    for op in VECTOR_OPS:
        if op == "softmax":
            for rows, h in sm:
                grid.append((op, {"B": rows, "H": h}))
            continue
        for rows in vec_rows:
            for h in vec_h:
                grid.append((op, {"B": rows, "H": h}))
    return grid


def probe_grid(grid: Iterable[tuple[str, dict]] = ()) -> list[tuple[str, dict]]:
    """The probe shapes of :mod:`hetero.predictor.opmodel.probes` not already in ``grid``: what
    ``hetero profile`` adds on an accelerator so the learned model can be pinned to it."""
    from hetero.predictor.opmodel.probes import PROBES

    have = {(op, tuple(sorted(d.items()))) for op, d in grid}
    return [(op, dict(d)) for op, d in PROBES if (op, tuple(sorted(d.items()))) not in have]


# --------------------------------------------------------------------------------------- measuring
def detect_device(requested: str | None = None) -> tuple[str, str]:
    """(record device name, torch device string). Accelerators are probed at run time, guarded.

    ``requested`` names the device type written in the records; a name whose catalog entry is
    cpu-family (or ``cpu``) runs on the CPU, anything else on the local accelerator when present.
    """
    import torch

    family = None
    if requested:
        try:
            from hetero.specs.device import load_catalog

            dev = load_catalog().get(requested)
            family = dev.family if dev is not None else None
        except Exception:  # noqa: BLE001 - the catalog is optional here
            family = None
        if requested == "cpu" or family == "cpu":
            return requested, "cpu"
    accel = None
    try:
        if torch.cuda.is_available():
            accel = ("cuda", torch.cuda.get_device_name(0))
    except Exception:  # noqa: BLE001 - a broken driver must not stop a CPU profile
        accel = None
    if accel is None:
        try:
            import torch_npu  # noqa: F401  (Ascend)

            if torch.npu.is_available():
                accel = ("npu", torch.npu.get_device_name(0))
        except Exception:  # noqa: BLE001
            accel = None
    if accel is None:
        if requested and family not in (None, "cpu"):
            raise RuntimeError(f"device '{requested}' is not a CPU device and no accelerator was found here "
                               f"(fix: profile it on a machine that has one, or leave --device out to profile "
                               f"this machine's CPU)")
        return requested or "cpu", "cpu"
    kind, raw = accel
    return requested or catalog_name(raw), f"{kind}:0"


def catalog_name(raw: str) -> str:
    """Map a driver's device name to a catalog key when one matches (else the name as given)."""
    try:
        from hetero.specs.device import load_catalog

        keys = list(load_catalog())
    except Exception:  # noqa: BLE001
        return raw
    norm = lambda s: re.sub(r"[^a-z0-9]", "", s.lower().replace("nvidia", "").replace("tesla", ""))  # noqa: E731
    target = norm(raw)
    hits = [k for k in keys if norm(k) == target] or [k for k in keys if norm(k) and norm(k) in target]
    return max(hits, key=len) if hits else raw


def _make_op(torch, op: str, dims: Mapping, dtype, device):
    """Allocate inputs and return a closure running ``op`` once."""
    F = torch.nn.functional
    g = lambda *s: torch.randn(*s, dtype=dtype, device=device)  # noqa: E731
    if op == "linear":
        x, w, b = g(int(dims["B"]), int(dims["M"]), int(dims["K"])), g(int(dims["N"]), int(dims["K"])), g(int(dims["N"]))
        return lambda: F.linear(x, w, b)
    if op == "bmm":
        a, c = g(int(dims["B"]), int(dims["M"]), int(dims["K"])), g(int(dims["B"]), int(dims["K"]), int(dims["N"]))
        return lambda: torch.bmm(a, c)
    rows, h = int(dims["B"]), int(dims["H"])
    x = g(rows, h)
    if op == "ln":
        w, b = g(h), g(h)
        return lambda: F.layer_norm(x, (h,), w, b)
    if op == "softmax":
        return lambda: torch.softmax(x, dim=-1)
    if op == "gelu":
        return lambda: F.gelu(x)
    if op == "relu":
        return lambda: torch.relu(x)
    if op == "tanh":
        return lambda: torch.tanh(x)
    if op == "pow":
        return lambda: torch.pow(x, 2.0)
    y = g(rows, h).abs_().add_(0.5)
    if op == "add":
        return lambda: torch.add(x, y)
    if op == "mul":
        return lambda: torch.mul(x, y)
    if op == "div":
        return lambda: torch.div(x, y)
    raise ValueError(f"unknown op '{op}'")


TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}
ISOLATED_CALLS, ISOLATED_KEEP = 25, 5


def isolated_call_ms(fn: Callable[[], object], new_event: Callable[[], object], synchronize: Callable[[], object],
                     calls: int = ISOLATED_CALLS, keep: int = ISOLATED_KEEP) -> float:
    """Milliseconds of one call on an asynchronous device, timed as the NeuSight records the learned
    model is fitted on were: an event, the call, an event, then wait for the device -- so each time
    is host dispatch + kernel on an idle device, the latency the model predicts and whose dispatch
    share the cost model overlaps (:meth:`~hetero.predictor.opmodel.model.OpModel.host_overhead`).
    Back-to-back calls would measure max(dispatch, kernel) instead. Returns the mean of the
    ``keep`` fastest of ``calls`` calls. ``new_event()`` gives an object with ``record()`` and
    ``elapsed_time(other) -> ms`` (``torch.cuda.Event(enable_timing=True)``)."""
    start, end = new_event(), new_event()
    times = []
    for _ in range(calls):
        start.record()
        fn()
        end.record()
        synchronize()
        times.append(float(start.elapsed_time(end)))
    times.sort()
    fastest = times[:max(1, keep)]
    return sum(fastest) / len(fastest)


def measure(grid: list[tuple[str, dict]], device_name: str, torch_device: str = "cpu",
            dtypes: Iterable[str] = ("fp32",), quick: bool = False,
            progress: Callable[[str], None] | None = None) -> list[Record]:
    """Time every (op, dims) of ``grid``. On a CPU (ops run synchronously) with
    ``torch.utils.benchmark``: warm-up calls, then the fastest of ``reps`` blocks of ``number``
    calls each (``number`` sized so a block lasts at least ``block_s``). On CUDA and Ascend NPUs
    each call is timed alone between two events (:func:`isolated_call_ms`), the protocol of the
    data the learned model was fitted on. Returns records; ``progress(label)`` is called after
    each operator."""
    import torch
    from torch.utils import benchmark

    block_s = 0.004 if quick else 0.01
    # CUDA and Ascend (torch_npu mirrors torch.cuda's Event / synchronize) run kernels asynchronously
    asynchronous = torch.cuda if torch_device.startswith("cuda") else (
        torch.npu if torch_device.startswith("npu") else None)
    out: list[Record] = []
    # Wake the thread pool / device and let clocks settle before the first timed operator.
    warm = _make_op(torch, "linear", {"B": 1, "M": 256, "N": 256, "K": 256}, torch.float32, torch_device)
    t_end = time.perf_counter() + (0.1 if quick else 0.5)
    while time.perf_counter() < t_end:
        warm()
    del warm
    for dtype_name in dtypes:
        tdtype = getattr(torch, TORCH_DTYPES[dtype_name])
        for op, dims in grid:
            fn = _make_op(torch, op, dims, tdtype, torch_device)
            if asynchronous is not None:
                for _ in range(3):  # warm-up: allocations, BLAS heuristics
                    fn()
                ms = isolated_call_ms(fn, lambda: asynchronous.Event(enable_timing=True), asynchronous.synchronize)
            else:
                ms = _fastest_block_ms(torch, benchmark, fn, op, block_s, quick)
            out.append(Record(op, device_name, dict(dims), ms, dtype_name))
            del fn
            if progress:
                progress(_label(op, dims))
    return out


def _fastest_block_ms(torch, benchmark, fn, label: str, block_s: float, quick: bool) -> float:
    """Milliseconds per call of ``fn`` on a CPU: warm-up calls, then the fastest of several blocks
    of ``number`` calls (``number`` sized so a block lasts at least ``block_s``)."""
    timer = benchmark.Timer(stmt="stmt()", globals={"stmt": fn}, num_threads=torch.get_num_threads(), label=label)
    one = math.inf
    for _ in range(3):                    # warm-up (allocations, kernel selection, caches);
        t0 = time.perf_counter()          # the fastest call sizes the blocks
        timer.timeit(1)
        one = min(one, max(time.perf_counter() - t0, 1e-7))
        if one > 0.05:
            break
    number = max(1, int(block_s / one))
    reps = 3 if (quick or one * number > 0.05) else 5
    times = []
    for _ in range(reps):
        times.extend(timer.timeit(number).times)
    # the fastest block: other processes on the machine only ever add time (preemption,
    # shared cores and caches), so the minimum is the least load-biased estimate
    return min(times) * 1e3


def _label(op: str, dims: Mapping) -> str:
    return f"{op} {' '.join(f'{k}={int(v)}' for k, v in dims.items())}"


# --------------------------------------------------------------------------------------- block probes
def default_block_probes(quick: bool = False) -> list[dict]:
    """Shapes at which ``hetero profile`` times the runtime's real model: gpt and llama, hidden
    64..1024 (head dim 64; 16 at hidden 64, the shipped tiny models' shape), rows (micro-batch x
    sequence) 32..1024, a stack of 4 blocks (so the weights stream through the caches as in a real
    stage) and the embedding / head edges. The hidden-64 probes are there because a block's fixed
    dispatch, fitted over the probes, is no guide below the smallest one (docs/predictor.md)."""
    if quick:
        shapes = ((128, 2, 1, 64),)
    else:
        shapes = ((64, 4, 1, 32), (64, 4, 4, 32), (128, 2, 1, 128), (256, 4, 1, 128), (256, 4, 4, 128),
                  (512, 8, 2, 128), (512, 8, 2, 512), (1024, 16, 1, 256))
    return [{"architecture": arch, "hidden_size": h, "num_attention_heads": heads,
             "micro_batch_size": b, "seq_length": s, "num_layers": 2 if quick else 4,
             "vocab_size": 1024 if quick else 4096} for arch in ("gpt", "llama") for h, heads, b, s in shapes]


def median_seconds(fn: Callable[[], object], rounds: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``rounds`` timed calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _median_rounds(forward: Callable[[], object], reps: int,
                   backward: Callable[[object], object] = lambda out: out.backward()) -> tuple[float, float]:
    """Median seconds of ``forward()`` and of ``backward`` of what it returns, over ``reps`` timed
    rounds after two warm-up rounds (allocations, kernel selection). The median, not the fastest
    round as for single operators: a block is what a training step repeats, and the run's report
    compares the prediction with its median step (the fastest round made small models predict too
    fast: docs/benchmarks.md gives the figures)."""
    fwd, bwd = [], []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        out = forward()
        t1 = time.perf_counter()
        backward(out)
        t2 = time.perf_counter()
        if i >= 2:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def measure_blocks(probes: list[dict], quick: bool = False,
                   progress: Callable[[str], None] | None = None) -> list[dict]:
    """Time the runtime's model (:mod:`hetero.runtime.model`) at each probe shape on the CPU with
    the current torch thread count: a first+last stage of ``num_layers`` blocks and the same stage
    without blocks (embedding, final norm, head, loss), forward and backward with autograd into
    accumulated ``.grad``; a block is the difference over ``num_layers``. Also one AdamW step (the
    runtime's optimizer, with a clipping factor as in a clipped step) over the whole stage. Fastest
    of several repetitions (module docstring)."""
    import torch

    import hetero
    from hetero.runtime.grads import make_optimizer, scaled_step, weighted_squares
    from hetero.runtime.model import build_stage, loss_fn

    out = []
    for probe in probes:
        spec = hetero.load_model(probe_model_dict(probe))
        L = spec.num_layers
        b, s, h = int(probe["micro_batch_size"]), int(probe["seq_length"]), int(probe["hidden_size"])
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, spec.vocab_size, (b, s), generator=gen)
        targets = torch.randint(0, spec.vocab_size, (b, s), generator=gen)
        full = build_stage(spec, (0, L), True, True, 0)
        big = sum(p.numel() for p in full.parameters()) * L > 5e7
        reps = 3 if (quick or big) else 7
        ff, fb = _median_rounds(lambda m=full: loss_fn(m(tokens), targets), reps)
        edges = build_stage(spec, (L, L), True, True, 0)
        ef, eb = _median_rounds(lambda m=edges: loss_fn(m(tokens), targets), reps)
        opt = make_optimizer(full.parameters(), 1e-3, 0.0)
        grads = [p.grad for p in full.parameters() if p.grad is not None]
        steps, norms = [], []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            weighted_squares({1: grads})  # the step's gradient-norm pass, as the runtime computes it
            t1 = time.perf_counter()
            scaled_step(opt, full, 0.5)  # as the runtime steps with clipping active
            if i >= 1:
                norms.append(t1 - t0)
                steps.append(time.perf_counter() - t1)
        params = sum(p.numel() for p in full.parameters())
        out.append({**probe, "forward_ms": max(ff - ef, 1e-9) / L * 1e3, "backward_ms": max(fb - eb, 1e-9) / L * 1e3,
                    "edges_forward_ms": ef * 1e3, "edges_backward_ms": eb * 1e3,
                    "adamw_ms": min(steps) * 1e3, "grad_norm_ms": min(norms) * 1e3, "params": int(params),
                    "adamw_kernel": "fused" if opt.defaults.get("fused") else "foreach",
                    "param_tensors": sum(1 for _ in full.parameters())})
        del full, edges, opt
        if progress:
            progress(f"block {probe['architecture']} h={h} rows={b * s}")
    return out


# --------------------------------------------------------------------------------------- MoE probes
def default_moe_probes(quick: bool = False) -> list[dict]:
    """Shapes at which ``hetero profile`` times the runtime's mixture-of-experts layer alone (router,
    dispatch, the experts one after another, combine): gpt and llama experts, 4 to 16 experts, top-2,
    rows (micro-batch x sequence) 256 and 1024, so that what the layer spends per expert and around
    the experts separates from what grows with the tokens."""
    shapes = ((256, 256, 8, 512),) if quick else \
        ((256, 256, 4, 1024), (256, 256, 16, 1024), (256, 1024, 8, 512), (512, 512, 4, 1024), (512, 512, 16, 2048))
    return [{"architecture": arch, "hidden_size": h, "num_attention_heads": max(1, h // 64), "micro_batch_size": 1,
             "seq_length": rows, "num_experts": e, "top_k": 2, "expert_ffn_hidden_size": ffn}
            for arch in ("gpt", "llama") for h, rows, e, ffn in shapes]


def measure_moe_blocks(probes: list[dict], quick: bool = False,
                       progress: Callable[[str], None] | None = None) -> list[dict]:
    """Time the runtime's MoE layer (:class:`hetero.runtime.moe.MoEMLP`, the experts a loop as on any
    CPU) at each probe shape: forward, and backward of its output with autograd into ``.grad``; the
    median of repeated rounds after two warm-up rounds, as for the block probes."""
    import torch

    import hetero
    from hetero.runtime.model import MLP
    from hetero.runtime.moe import MoEMLP

    out = []
    for probe in probes:
        spec = hetero.load_model(moe_probe_model_dict(probe))
        torch.manual_seed(0)
        layer = MoEMLP(spec, MLP).train()
        rows, h = int(probe["micro_batch_size"]) * int(probe["seq_length"]), spec.hidden_size
        x = torch.randn(1, rows, h, requires_grad=True)
        grad = torch.randn(1, rows, h)
        f, b = _median_rounds(lambda m=layer: m(x), 3 if quick else 7, lambda y: y.backward(grad))
        out.append({**probe, "forward_ms": f * 1e3, "backward_ms": b * 1e3})
        del layer
        if progress:
            progress(f"moe {probe['architecture']} h={h} rows={rows} experts={probe['num_experts']}")
    return out


__all__ = ["TORCH_DTYPES", "catalog_name", "default_block_probes", "default_grid", "default_moe_probes", "detect_device",
           "measure", "measure_blocks", "measure_moe_blocks"]
