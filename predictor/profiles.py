"""This machine's measured operator latencies: the profile grid, the cache, and a model fitted on it.

``hetero profile`` times the operators of a transformer layer (linear, bmm, ln, softmax and the
elementwise ops) over a grid of shapes on the local device and writes profile records
(SCHEMAS.md: ``op,device,B,M,N,K,H,latency_ms,dtype``). The records are cached per device at
``$HETERO_CACHE_DIR/profiles/<device>.csv`` (default ``~/.cache/hetero/profiles/<device>.csv``);
:func:`local_op_model` fits a small latency model on that cache, which the predictor uses for
cpu-family devices (emulated ``base: cpu`` devices included; their ``slowdown`` is the predictor's
business, this model answers for the real local hardware).

The model (:class:`LocalOpModel`) is deliberately simple and robust, because a CPU profile holds a
few hundred rows, not the tens of thousands a learned cross-device model needs. Per (op, dtype) it
stores ``r = log(measured / reference roofline)`` (the log inefficiency against fixed reference
rates) together with a point in a small log feature space (GEMMs: work and arithmetic intensity;
vector ops: element count and row length), and predicts by inverse-distance weighting of the
nearest measured points. Inside the grid this interpolates; outside it holds the efficiency of the
nearest measured shapes constant, i.e. time scales with the work, which is the right asymptote for
large operators and never produces the wild values a polynomial fit extrapolates to.

Block probes (CPU). The operator sum misses what a real training step on a CPU spends around and
between the kernels: Python / autograd dispatch of ~50 kernels per block, the fused kernels the
runtime actually calls (``scaled_dot_product_attention`` instead of bmm + softmax + bmm, the tanh
GELU of GPT-2), gradient accumulation into ``.grad``. So ``hetero profile`` on a CPU also times the
runtime's own transformer block (:class:`hetero.runtime.model.Block`, forward and backward with
autograd) at a few shapes, and one AdamW step over its parameters (the runtime's optimizer). They
are stored next to the records in ``<device>.meta.json`` (with the thread count and the load
average during the profile). :meth:`LocalOpModel.layer_ratio` (and :meth:`~LocalOpModel.edge_ratio`
for the embedding and head) is the measured block time over the operator-sum prediction at the nearest probes (interpolated in log hidden size and log rows), which
the predictor multiplies into its per-layer times; :meth:`LocalOpModel.optimizer_time` is the
measured AdamW seconds per parameter, interpolated in log(parameters). Both come from the machine, never from a
particular benchmark.

Threads and load. Workers of ``hetero launch`` run ``--threads`` intra-op threads each (default 1),
so the CPU profile defaults to 1 thread too and records the count it used. Timings take the fastest
block of repeated calls (background load only ever adds time), so a profile taken on a busy machine
still describes the machine, not the load.

No torch import here except inside :func:`measure` / :func:`measure_blocks` (the profiler itself):
loading the model only reads the CSV (and its JSON sidecar), so predicting stays fast and works on
a login node.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

COLUMNS = ("op", "device", "B", "M", "N", "K", "H", "latency_ms", "dtype")
DIMS = ("B", "M", "N", "K", "H")
GEMM_OPS = ("linear", "bmm")
VECTOR_OPS = ("ln", "softmax", "gelu", "add", "mul", "div", "pow", "tanh", "relu")
OPS = GEMM_OPS + VECTOR_OPS
# Tensors read per output element and FLOPs per element (the same conventions as the op model).
VEC_INPUTS = {"ln": 1, "softmax": 1, "add": 2, "mul": 2, "div": 2, "pow": 1, "tanh": 1, "relu": 1, "gelu": 1}
VEC_FLOPS = {"ln": 8, "softmax": 5, "add": 1, "mul": 1, "div": 1, "pow": 1, "tanh": 8, "relu": 1, "gelu": 10}
DTYPE_BYTES = {"fp64": 8, "fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}

# Fixed reference rates: only a normaliser for the stored inefficiency, not a claim about the device.
REF_FLOPS = 1e12
REF_BANDWIDTH = 50e9


# --------------------------------------------------------------------------------------- cache
def cache_dir() -> Path:
    """``$HETERO_CACHE_DIR/profiles`` (default ``~/.cache/hetero/profiles``)."""
    root = os.environ.get("HETERO_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "hetero"
    return base / "profiles"


def safe_name(device_name: str) -> str:
    """A device name usable as a file name (``NVIDIA A100-SXM4-80GB`` -> ``NVIDIA_A100-SXM4-80GB``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", device_name).strip("_") or "device"


def cache_path(device_name: str = "cpu") -> Path:
    return cache_dir() / f"{safe_name(device_name)}.csv"


def meta_path(records_path) -> Path:
    """The JSON sidecar of a profile CSV (thread count, load, block probes): ``<name>.meta.json``."""
    p = Path(records_path)
    return p.with_name(p.stem + ".meta.json")


def read_meta(records_path) -> dict:
    """The sidecar of ``records_path`` ({} when there is none or it is unreadable)."""
    try:
        data = json.loads(meta_path(records_path).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_meta(records_path, meta: dict) -> Path:
    from hetero.specs.io import write_text_atomic

    path = meta_path(records_path)
    write_text_atomic(path, json.dumps(meta, indent=1))
    return path


# --------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class Record:
    """One measured operator: ``dims`` holds only the dimensions that apply to ``op``."""

    op: str
    device: str
    dims: dict = field(hash=False)
    latency_ms: float
    dtype: str = "fp32"

    def row(self) -> dict:
        out = {"op": self.op, "device": self.device, "latency_ms": f"{self.latency_ms:.6g}", "dtype": self.dtype}
        for d in DIMS:
            v = self.dims.get(d)
            out[d] = "" if v is None else str(int(v))
        return out


class ProfileError(ValueError):
    """A profile CSV that does not follow the record format (names the file, row and column)."""


def records_to_csv(records: Iterable[Record]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(COLUMNS), lineterminator="\n")
    w.writeheader()
    for r in records:
        w.writerow(r.row())
    return buf.getvalue()


def write_records(path, records: Iterable[Record]) -> Path:
    """Write records as CSV atomically (temporary file + rename)."""
    from hetero.specs.io import write_text_atomic

    path = Path(path)
    write_text_atomic(path, records_to_csv(records))
    return path


def read_records(path) -> list[Record]:
    """Read a profile CSV; raises :class:`ProfileError` naming the file, row and column."""
    path = Path(path)
    out: list[Record] = []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames or []
        for col in ("op", "device", "latency_ms"):
            if col not in header:
                raise ProfileError(f"{path}: missing column '{col}' (columns: {', '.join(COLUMNS)})")
        for i, row in enumerate(reader, start=2):
            op = (row.get("op") or "").strip()
            if op not in OPS:
                raise ProfileError(f"{path}, row {i}, column 'op': unknown op '{op}' (known: {', '.join(OPS)})")
            dims = {}
            for d in DIMS:
                text = (row.get(d) or "").strip()
                if text:
                    try:
                        dims[d] = float(text)
                    except ValueError:
                        raise ProfileError(f"{path}, row {i}, column '{d}': '{text}' is not a number") from None
            try:
                lat = float(row["latency_ms"])
            except (TypeError, ValueError):
                raise ProfileError(f"{path}, row {i}, column 'latency_ms': '{row.get('latency_ms')}' is not a number") from None
            dtype = (row.get("dtype") or "fp32").strip() or "fp32"
            out.append(Record(op, (row.get("device") or "").strip(), dims, lat, dtype))
    return out


# --------------------------------------------------------------------------------------- grid
def default_grid(quick: bool = False) -> list[tuple[str, dict]]:
    """(op, dims) to measure: the operators of gpt/llama layers of hidden 256..2048.

    linear: rows (B=1, M = micro-batch x sequence) x K @ K x N for the qkv, out, fc1, fc2 shapes,
    plus a few wide (LM-head-like) N. bmm: attention scores and context for heads x batch in
    {16, 64}, sequence 128..1024, head dim 64/128. Vector ops: rows x H over the activations'
    shapes; softmax over attention rows (rows = batch x heads x seq, H = seq).
    Sized to take about a minute on two CPU cores; ``quick`` is a few seconds (tests, smoke runs).
    """
    grid: list[tuple[str, dict]] = []
    if quick:
        hiddens, rows_list, bh_list, seqs, hds = (128, 256), (64, 256), (8,), (64, 128), (32,)
        vec_rows, vec_h, sm = (64, 512), (128, 512), ((512, 64), (2048, 128))
    else:
        hiddens, rows_list, bh_list, seqs, hds = (256, 512, 768, 1024, 2048), (128, 512, 2048), \
            (16, 64), (128, 256, 512, 1024), (64, 128)
        vec_rows, vec_h = (128, 512, 2048, 8192), (256, 1024, 4096)
        sm = tuple((bh * s, s) for bh in (16, 64) for s in (128, 256, 512, 1024))
    for h in hiddens:
        for rows in rows_list:
            if rows * h > 2**21:
                continue  # > 2048 x 1024: seconds per operator on a small CPU; extrapolated instead
            for k, n in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)):
                grid.append(("linear", {"B": 1, "M": rows, "N": n, "K": k}))
    wide = ((64, 512), (256, 1024)) if quick else ((128, 512), (128, 1024), (512, 1024))
    for rows, k in wide:
        grid.append(("linear", {"B": 1, "M": rows, "N": 4096 if quick else 16384, "K": k}))
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
            raise RuntimeError(f"device '{requested}' is not a CPU device and no accelerator was found here")
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


def measure(grid: list[tuple[str, dict]], device_name: str, torch_device: str = "cpu",
            dtypes: Iterable[str] = ("fp32",), quick: bool = False,
            progress: Callable[[str], None] | None = None) -> list[Record]:
    """Time every (op, dims) of ``grid`` with ``torch.utils.benchmark``: warm-up calls, then the
    fastest of ``reps`` blocks of ``number`` calls each (``number`` sized so a block lasts at least
    ``block_s``). Returns records; ``progress(label)`` is called after each operator."""
    import torch
    from torch.utils import benchmark

    block_s = 0.004 if quick else 0.01
    sync = None
    if torch_device.startswith("npu"):
        sync = torch.npu.synchronize  # torch.utils.benchmark only synchronises CUDA
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
            stmt = (lambda: (fn(), sync())) if sync else fn
            timer = benchmark.Timer(stmt="stmt()", globals={"stmt": stmt},
                                    num_threads=torch.get_num_threads(), label=op)
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
            best = min(times)
            out.append(Record(op, device_name, dict(dims), best * 1e3, dtype_name))
            del fn, stmt, timer
            if progress:
                progress(f"{op} {' '.join(f'{k}={int(v)}' for k, v in dims.items())}")
    return out


# --------------------------------------------------------------------------------------- block probes
def default_block_probes(quick: bool = False) -> list[dict]:
    """Shapes at which ``hetero profile`` times the runtime's real model: gpt and llama, hidden
    128..1024 (head dim 64), rows (micro-batch x sequence) 128..1024, a stack of 4 blocks (so the
    weights stream through the caches as in a real stage) and the embedding / head edges."""
    if quick:
        shapes = ((128, 1, 64),)
    else:
        shapes = ((128, 1, 128), (256, 1, 128), (256, 4, 128), (512, 2, 128), (512, 2, 512), (1024, 1, 256))
    return [{"architecture": arch, "hidden_size": h, "num_attention_heads": max(1, h // 64),
             "micro_batch_size": b, "seq_length": s, "num_layers": 2 if quick else 4,
             "vocab_size": 1024 if quick else 4096} for arch in ("gpt", "llama") for h, b, s in shapes]


def probe_model_dict(probe: Mapping) -> dict:
    """The model file of a block probe."""
    return {"name": f"probe-{probe['architecture']}-{probe['hidden_size']}", "architecture": probe["architecture"],
            "num_layers": int(probe.get("num_layers") or 1), "hidden_size": int(probe["hidden_size"]),
            "num_attention_heads": int(probe["num_attention_heads"]),
            "vocab_size": int(probe.get("vocab_size") or 1024), "seq_length": int(probe["seq_length"]),
            "dtype": "fp32"}


def _time_stage(torch, module, tokens, targets, loss_fn, reps: int) -> tuple[float, float]:
    """Fastest forward (to the loss) and backward of ``module`` over ``reps`` timed rounds."""
    fwd, bwd = [], []
    for i in range(reps + 2):   # two warm-up rounds (allocations, kernel selection)
        t0 = time.perf_counter()
        loss = loss_fn(module(tokens), targets)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if i >= 2:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return min(fwd), min(bwd)


def measure_blocks(probes: list[dict], quick: bool = False,
                   progress: Callable[[str], None] | None = None) -> list[dict]:
    """Time the runtime's model (:mod:`hetero.runtime.model`) at each probe shape on the CPU with
    the current torch thread count: a first+last stage of ``num_layers`` blocks and the same stage
    without blocks (embedding, final norm, head, loss), forward and backward with autograd into
    accumulated ``.grad``; a block is the difference over ``num_layers``. Also one AdamW step (the
    runtime's optimizer) over the whole stage. Fastest of several repetitions (module docstring)."""
    import torch

    import hetero
    from hetero.runtime.grads import make_optimizer
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
        reps = 3 if (quick or big) else 5
        ff, fb = _time_stage(torch, full, tokens, targets, loss_fn, reps)
        edges = build_stage(spec, (L, L), True, True, 0)
        ef, eb = _time_stage(torch, edges, tokens, targets, loss_fn, reps)
        opt = make_optimizer(full.parameters(), 1e-3, 0.0)
        steps = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            opt.step()
            if i >= 1:
                steps.append(time.perf_counter() - t0)
        params = sum(p.numel() for p in full.parameters())
        out.append({**probe, "forward_ms": max(ff - ef, 1e-9) / L * 1e3, "backward_ms": max(fb - eb, 1e-9) / L * 1e3,
                    "edges_forward_ms": ef * 1e3, "edges_backward_ms": eb * 1e3,
                    "adamw_ms": min(steps) * 1e3, "params": int(params),
                    "param_tensors": sum(1 for _ in full.parameters())})
        del full, edges, opt
        if progress:
            progress(f"block {probe['architecture']} h={h} rows={b * s}")
    return out


# --------------------------------------------------------------------------------------- the model
def _work(op: str, dims: Mapping, elem_bytes: int) -> tuple[float, float]:
    """(FLOPs, bytes moved) of one operator, dims missing -> 1."""
    d = lambda k: float(dims.get(k) or 1.0)  # noqa: E731
    if op in GEMM_OPS:
        B, M, N, K = d("B"), d("M"), d("N"), d("K")
        if op == "linear":   # (B*M) x K @ K x N, one weight
            rows = B * M
            return 2.0 * rows * N * K, elem_bytes * (rows * K + K * N + rows * N)
        return 2.0 * B * M * N * K, elem_bytes * B * (M * K + K * N + M * N)
    n = d("B") * d("H")
    return VEC_FLOPS[op] * n, elem_bytes * n * (VEC_INPUTS[op] + 1)


def _features(op: str, dims: Mapping, elem_bytes: int) -> tuple[tuple[float, ...], float]:
    """(point in feature space, log reference roofline seconds)."""
    flops, nbytes = _work(op, dims, elem_bytes)
    log_roof = math.log(max(flops / REF_FLOPS, nbytes / REF_BANDWIDTH))
    if op in GEMM_OPS:
        # size and arithmetic intensity; log2 so one grid step ~ 1 unit
        return (math.log2(flops), math.log2(flops / nbytes)), log_roof
    n, h = float(dims.get("B") or 1) * float(dims.get("H") or 1), float(dims.get("H") or 1)
    return (math.log2(n), 0.5 * math.log2(h)), log_roof


class LocalOpModel:
    """Operator latency on this machine, from its profile records (see the module docstring)."""

    def __init__(self, records: Iterable[Record], source: str = "<records>", k: int = 4,
                 meta: Mapping | None = None):
        self.source = source
        self.k = k
        self.meta = dict(meta or {})
        self.threads = self.meta.get("threads")
        self.blocks = [b for b in self.meta.get("blocks") or []
                       if all(float(b.get(key) or 0) > 0 for key in ("forward_ms", "backward_ms", "hidden_size",
                                                                    "micro_batch_size", "seq_length"))]
        self._ratios: list | None = None
        self.points: dict[tuple[str, str], list[tuple[tuple[float, ...], float]]] = {}
        self.devices: set[str] = set()
        n = 0
        for r in records:
            if r.op not in OPS or not (r.latency_ms > 0):
                continue
            e = DTYPE_BYTES.get(r.dtype, 4)
            x, log_roof = _features(r.op, r.dims, e)
            self.points.setdefault((r.op, r.dtype), []).append((x, math.log(r.latency_ms * 1e-3) - log_roof))
            self.devices.add(r.device)
            n += 1
        self.num_records = n
        if not n:
            raise ProfileError(f"{source}: no usable profile records")
        self._memo: dict = {}

    def __repr__(self) -> str:
        return f"LocalOpModel({self.num_records} records from {self.source})"

    def _pool(self, op: str, dtype: str):
        """The measured points for (op, dtype), with documented fallbacks when they are missing:
        another dtype of the same op (CPUs rarely run half precision faster), then the op's family."""
        for key in ((op, dtype), (op, "fp32")):
            if key in self.points:
                return self.points[key], key[1]
        for (o, dt), pts in self.points.items():
            if o == op:
                return pts, dt
        family = GEMM_OPS if op in GEMM_OPS else VECTOR_OPS
        pool = [p for (o, dt), pts in self.points.items() if o in family for p in pts]
        if pool:
            return pool, dtype
        pool = [p for pts in self.points.values() for p in pts]
        return pool, dtype

    def predict(self, op: str, dims: Mapping, dtype: str = "fp32", device=None) -> float:
        """Seconds for one ``op`` with ``dims`` on the profiled hardware. ``device`` is accepted for
        the op-model interface and ignored: emulation slowdowns are applied by the predictor."""
        if op not in OPS:
            raise ValueError(f"unknown op '{op}' (known: {', '.join(OPS)})")
        key = (op, dtype, *(float(dims.get(d) or 0.0) for d in DIMS))
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        pts, used_dtype = self._pool(op, dtype)
        x, log_roof = _features(op, dims, DTYPE_BYTES.get(used_dtype, 4))
        ds = sorted((math.dist(x, p), r) for p, r in pts)[: self.k]
        if ds[0][0] < 1e-9:
            r = ds[0][1]
        else:
            w = [1.0 / (d * d) for d, _ in ds]
            r = sum(wi * ri for wi, (_, ri) in zip(w, ds)) / sum(w)
        out = math.exp(log_roof + r)
        if len(self._memo) > 100_000:
            self._memo.clear()
        self._memo[key] = out
        return out


    # ---------------------------------------------------------------- block probes
    def _probe_ratios(self) -> list:
        """Per probe: (architecture, point, forward ratio, backward ratio, edge ratios or None),
        ratio = measured time / this model's operator-sum prediction at the probe's shape (edges:
        embedding + final norm + head + loss)."""
        if self._ratios is None:
            import hetero

            from .ops import (embedding_backward_ops, embedding_forward_ops, head_backward_ops, head_forward_ops,
                              layer_backward_ops, layer_forward_ops)

            out = []
            for pb in self.blocks:
                try:
                    spec = hetero.load_model(probe_model_dict(pb))
                except Exception:  # noqa: BLE001 - a probe we cannot rebuild is skipped
                    continue
                b, s = int(pb["micro_batch_size"]), int(pb["seq_length"])
                t = lambda ops: sum(self.predict(o.op, o.dims_dict()) for o in ops)  # noqa: E731
                of = t(layer_forward_ops(spec, b, s, 1, "fp32"))
                ob = t(layer_backward_ops(spec, b, s, 1, "none", "fp32"))
                ef = t(embedding_forward_ops(spec, b, s, 1, "fp32") + head_forward_ops(spec, b, s, 1, "fp32"))
                eb = t(embedding_backward_ops(spec, b, s, 1, "fp32") + head_backward_ops(spec, b, s, 1, "fp32"))
                if of > 0 and ob > 0:
                    edges = None
                    if float(pb.get("edges_forward_ms") or 0) > 0 and float(pb.get("edges_backward_ms") or 0) > 0:
                        edges = (pb["edges_forward_ms"] * 1e-3 / ef, pb["edges_backward_ms"] * 1e-3 / eb)
                    out.append((pb["architecture"], self._probe_point(spec.hidden_size, b * s),
                                pb["forward_ms"] * 1e-3 / of, pb["backward_ms"] * 1e-3 / ob, edges))
            self._ratios = out
        return self._ratios

    @staticmethod
    def _probe_point(hidden: float, rows: float) -> tuple[float, float]:
        return (math.log2(max(hidden, 1.0)), math.log2(max(rows, 1.0)))

    def _ratio(self, which: str, model, mbs: int, seq: int) -> tuple[float, float]:
        key = (which, model.architecture, model.hidden_size, mbs * seq)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        pts = self._probe_ratios()
        if which == "edges":
            pts = [(a, x, e[0], e[1]) for a, x, _, _, e in pts if e is not None]
        else:
            pts = [(a, x, f, b) for a, x, f, b, _ in pts]
        same = [p for p in pts if p[0] == model.architecture] or pts
        if not same:
            out = (1.0, 1.0)
        else:
            x = self._probe_point(model.hidden_size, mbs * seq)
            ds = sorted((math.dist(x, p[1]), p[2], p[3]) for p in same)[:3]
            if ds[0][0] < 1e-9:
                out = (ds[0][1], ds[0][2])
            else:
                w = [1.0 / (d * d) for d, _, _ in ds]
                out = (sum(wi * f for wi, (_, f, _) in zip(w, ds)) / sum(w),
                       sum(wi * b for wi, (_, _, b) in zip(w, ds)) / sum(w))
        self._memo[key] = out
        return out

    def layer_ratio(self, model, mbs: int, seq: int) -> tuple[float, float]:
        """(forward, backward) multipliers from the operator sum of one layer of ``model`` to the
        runtime's measured block time: inverse-distance weighting of the nearest block probes of the
        same architecture (any architecture when none), in (log2 hidden, log2 rows). (1, 1) without
        probes."""
        return self._ratio("layer", model, mbs, seq)

    def edge_ratio(self, model, mbs: int, seq: int) -> tuple[float, float]:
        """The same for the stage edges (embedding; final norm + head + loss)."""
        return self._ratio("edges", model, mbs, seq)

    def optimizer_time(self, params: float, hidden: int | None = None) -> float | None:
        """Seconds of the runtime's AdamW step over ``params`` parameters: the block probes' measured
        seconds per parameter, interpolated in log(parameters) (the rate grows once the optimizer
        state leaves the caches), held constant beyond the probes; None without probes.
        ``hidden`` is accepted for the interface and unused."""
        pts = sorted((float(b["params"]), float(b["adamw_ms"]) * 1e-3 / float(b["params"]))
                     for b in self.blocks if float(b.get("adamw_ms") or 0) > 0 and float(b.get("params") or 0) > 0)
        if not pts or params <= 0:
            return None
        # one rate per distinct size (probes of the same size: their mean)
        merged: dict[float, list[float]] = {}
        for n, r in pts:
            merged.setdefault(n, []).append(r)
        xs = sorted(merged)
        rates = [sum(merged[n]) / len(merged[n]) for n in xs]
        if params <= xs[0]:
            rate = rates[0]
        elif params >= xs[-1]:
            rate = rates[-1]
        else:
            i = next(k for k in range(1, len(xs)) if xs[k] >= params)
            t = (math.log(params) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
            rate = rates[i - 1] + t * (rates[i] - rates[i - 1])
        return float(params) * rate


_LOADED: dict[str, tuple[float, LocalOpModel]] = {}


def load_local_model(path) -> LocalOpModel:
    return LocalOpModel(read_records(path), source=str(path), meta=read_meta(path))


def local_op_model(device_name: str = "cpu", fallback: str | None = "cpu") -> LocalOpModel | None:
    """The latency model fitted on this machine's cached profile of ``device_name``, or None when no
    profile was cached (run ``hetero profile``) or the cache is unreadable. Reloaded when the file
    changes. A device type without its own profile uses ``fallback``'s: emulated ``base: cpu``
    devices (``cpu-slow``, ...) run on this CPU, so its ``cpu`` profile describes them (the
    predictor applies their slowdown)."""
    path = cache_path(device_name)
    try:
        mtime = path.stat().st_mtime_ns
        try:
            mtime = (mtime, meta_path(path).stat().st_mtime_ns)
        except OSError:
            mtime = (mtime, None)
    except OSError:
        if fallback and fallback != device_name:
            return local_op_model(fallback, None)
        return None
    hit = _LOADED.get(str(path))
    if hit and hit[0] == mtime:
        return hit[1]
    try:
        model = load_local_model(path)
    except (OSError, ProfileError):
        return None
    _LOADED[str(path)] = (mtime, model)
    return model


__all__ = ["COLUMNS", "LocalOpModel", "ProfileError", "Record", "cache_dir", "cache_path", "default_block_probes",
           "default_grid", "detect_device", "local_op_model", "measure", "measure_blocks", "meta_path", "read_meta",
           "read_records", "write_meta", "write_records"]
