"""Roofline and dimensionless features of one operator on one device.

Every function here takes a math namespace ``xp`` (``SCALAR`` for Python floats, ``VECTOR`` for
numpy arrays), so the single-call fast path and the vectorised path share one definition.

Device identity enters only through spec ratios: intensity relative to the ridge point
(peak / bandwidth), waves of tiles over the compute units, working set relative to L2, and the
roofline time relative to a fixed 10 us (launch-overhead scale).
"""
from __future__ import annotations

import math

import numpy as np

from ..ops import (DTYPE_BYTES, ELEMENTWISE_OPS, GEMM_OPS, NORM_OPS, VEC_FLOPS, VEC_INPUTS, VECTOR_OPS, gemm_work,
                   vector_work)

OPS = GEMM_OPS + VECTOR_OPS
FAMILY = {**{o: "gemm" for o in GEMM_OPS}, **{o: "vector" for o in VECTOR_OPS}}
OP_INDEX = {o: i for i, o in enumerate(VECTOR_OPS)}
OP_POS = {o: i for i, o in enumerate(OPS)}

OVERHEAD_SCALE = 1e-5  # seconds; roofline time is expressed relative to it
GEMM_TILES = ((32, 32), (64, 64), (128, 64), (128, 128), (256, 128))

DEFAULT_COMPUTE_UNITS = 64
DEFAULT_L2 = 4 * 2**20


class _Scalar:
    log2 = staticmethod(math.log2)
    ceil = staticmethod(math.ceil)
    maximum = staticmethod(max)


class _Vector:
    log2 = staticmethod(np.log2)
    ceil = staticmethod(np.ceil)
    maximum = staticmethod(np.maximum)


SCALAR = _Scalar()
VECTOR = _Vector()


def device_params(device, dtype: str) -> tuple[float, float, float, float, float]:
    """(matrix FLOP/s, vector FLOP/s, bytes/s, compute units, L2 bytes) of a ``DeviceType``. The
    matrix peak is NaN where the device lists none for ``dtype``: a dtype only elementwise ops run
    in (a bf16 model's fp32 loss on a device with half-precision matrix units alone) needs none, and
    a matrix product in it raises (:func:`require_matrix_peak`)."""
    matrix = float(device.matrix_flops(dtype)) if device.matrix_peak(dtype) is not None else math.nan
    return (matrix, float(device.vector_flops(dtype)),
            float(device.effective_memory_bandwidth),
            float(device.compute_units or DEFAULT_COMPUTE_UNITS),
            float(device.l2_cache or DEFAULT_L2))


def require_matrix_peak(device, dtype: str) -> None:
    """Raise the device's own error (naming the peak to add) for a matrix product in ``dtype`` on a
    ``device`` that lists no matrix peak for it (:func:`device_params`' NaN)."""
    device.matrix_flops(dtype)


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype '{dtype}' (known: {', '.join(DTYPE_BYTES)})") from None


def gemm_roofline(xp, is_bmm, B, M, N, K, e, P, BW):
    _, _, flops, nbytes = gemm_work(is_bmm, B, M, N, K, e)
    return xp.maximum(flops / P, nbytes / BW)


def gemm_features(xp, is_bmm, B, M, N, K, e, P, BW, SM, L2, floor=OVERHEAD_SCALE):
    """Return (features list, roofline seconds). ``floor``: the launch-floor scale (seconds) the
    roofline time is expressed against (``OVERHEAD_SCALE`` or the op's floor on the device)."""
    Bb, Mr, flops, nbytes = gemm_work(is_bmm, B, M, N, K, e)
    tc = flops / P
    tm = nbytes / BW
    troof = xp.maximum(tc, tm)
    f = [xp.log2(Mr), xp.log2(N), xp.log2(K), xp.log2(Bb), is_bmm,
         xp.log2(tc / tm), xp.log2(troof / floor), xp.log2(nbytes / L2)]
    for tm_, tn_ in GEMM_TILES:
        tiles = Bb * xp.ceil(Mr / tm_) * xp.ceil(N / tn_)
        waves = xp.ceil(tiles / SM)
        f.append(xp.log2(waves))
        f.append(tiles / (waves * SM))
    f.append(xp.log2(Bb * xp.ceil(Mr / 128) * xp.ceil(N / 128) / SM))
    f.append(Mr * N / (xp.ceil(Mr / 64) * xp.ceil(N / 64) * 4096.0))
    return f, troof


GEMM_FEATURE_NAMES = (["log_m", "log_n", "log_k", "log_batch", "is_bmm", "log_ai_over_ridge",
                       "log_troof_over_10us", "log_bytes_over_l2"]
                      + [n for t in GEMM_TILES for n in (f"log_waves_{t[0]}x{t[1]}", f"wave_eff_{t[0]}x{t[1]}")]
                      + ["log_tiles128_per_cu", "pad_eff_64"])


def vector_roofline(xp, n_in, fpe, B, H, e, Pv, BW):
    _, flops, nbytes = vector_work(n_in, fpe, B, H, e)
    return xp.maximum(flops / Pv, nbytes / BW)


def vector_features(xp, onehot, n_in, fpe, B, H, e, Pv, BW, SM, L2, floor=OVERHEAD_SCALE):
    """``onehot``: list of 0/1 (scalars or arrays), one per op of ``VECTOR_OPS``."""
    n, flops, nbytes = vector_work(n_in, fpe, B, H, e)
    tc = flops / Pv
    tm = nbytes / BW
    troof = xp.maximum(tc, tm)
    row_waves = xp.ceil(B / SM)
    blocks = xp.ceil(n / 512.0)
    blk_waves = xp.ceil(blocks / (4 * SM))
    f = list(onehot) + [xp.log2(n), xp.log2(B), xp.log2(H), xp.log2(troof / floor),
                        xp.log2(nbytes / L2), xp.log2(row_waves), B / (row_waves * SM),
                        xp.log2(blk_waves), blocks / (blk_waves * 4 * SM)]
    return f, troof


VECTOR_FEATURE_NAMES = ([f"op_{o}" for o in VECTOR_OPS]
                        + ["log_n", "log_rows", "log_cols", "log_troof_over_10us", "log_bytes_over_l2",
                           "log_row_waves", "row_wave_eff", "log_block_waves", "block_wave_eff"])


def _dim(dims, key, default=1.0):
    v = dims.get(key)
    if v is None:
        return default
    v = float(v)
    return default if v != v else v


def roofline_latency(op: str, dims, dtype: str, device) -> float:
    """Plain roofline, seconds: max(FLOPs / peak, bytes / bandwidth) with the dtype's peak (matrix
    peak for linear/bmm, vector peak otherwise) and bytes per element. Usable as a fallback."""
    P, Pv, BW, _, _ = device_params(device, dtype)
    e = dtype_bytes(dtype)
    if op in GEMM_OPS:
        if P != P:
            require_matrix_peak(device, dtype)
        return gemm_roofline(SCALAR, 1.0 if op == "bmm" else 0.0, _dim(dims, "B"), _dim(dims, "M"),
                             _dim(dims, "N"), _dim(dims, "K"), e, P, BW)
    if op in VECTOR_OPS:
        return vector_roofline(SCALAR, VEC_INPUTS[op], VEC_FLOPS[op], _dim(dims, "B"), _dim(dims, "H"), e, Pv, BW)
    raise ValueError(f"unknown op '{op}' (known: {', '.join(OPS)})")


def build_matrix(family: str, ops, dims: dict, e, P, Pv, BW, SM, L2, floor=OVERHEAD_SCALE):
    """Vectorised features for rows of one family. dims: arrays B, M, N, K, H (NaN -> 1)."""
    ops = np.asarray(ops)

    def d(k):
        v = np.asarray(dims.get(k, np.ones(len(ops))), dtype=float)
        return np.where(np.isnan(v), 1.0, v)

    if family == "gemm":
        is_bmm = (ops == "bmm").astype(float)
        f, troof = gemm_features(VECTOR, is_bmm, d("B"), d("M"), d("N"), d("K"), e, P, BW, SM, L2, floor)
    else:
        onehot = [(ops == o).astype(float) for o in VECTOR_OPS]
        n_in = np.array([VEC_INPUTS[o] for o in ops], dtype=float)
        fpe = np.array([VEC_FLOPS[o] for o in ops], dtype=float)
        f, troof = vector_features(VECTOR, onehot, n_in, fpe, d("B"), d("H"), e, Pv, BW, SM, L2, floor)
    n = len(ops)
    X = np.column_stack([np.broadcast_to(np.asarray(c, dtype=float), (n,)) for c in f])
    return X, np.broadcast_to(troof, (n,)).astype(float)
