"""The host's dispatch floor of generation on a CPU: what one decode step of
:func:`hetero.rl.generate.generate` costs when the model is too small for its arithmetic to matter.

Method: tiny models (gpt and llama, hidden 64), a few layer and row counts, temperature 1.0 with a
stop string that never comes (as the RL rollout samples, every call runs its tokens). One decode
step's seconds = (generate with N new tokens - generate with 1) / (N - 1), the median of a few
runs, one thread. A least-squares fit of ``step = per_step + per_layer[architecture] x layers +
per_row x rows`` over the cases gives the floor the predictor uses (a llama layer issues more
kernels than a gpt one: RoPE, the gated MLP, the grouped keys and values); the first call (prefill
and the first token) gets its own figures the same way.

``hetero profile`` on a CPU measures a small set of cases (:func:`measure_decode_dispatch`) and keeps
the fit in the profile's sidecar (``decode_dispatch``), so the predictor's generation times follow
the machine the profile was taken on, as its block probes do; ``benchmarks/bench_decode_floor.py``
measures the full set.
"""
from __future__ import annotations

from hetero.measure.profiling import median_seconds

ARCHITECTURES = ("gpt", "llama")
PROFILE_CASES = {"layers": (1, 4), "rows": (1, 8)}
"""What ``hetero profile`` measures (with both architectures: 8 cases, about 2 seconds)."""


def profile_case_count() -> int:
    """How many cases :func:`measure_decode_dispatch` times (one progress step each)."""
    return len(ARCHITECTURES) * len(PROFILE_CASES["layers"]) * len(PROFILE_CASES["rows"])


def floor_model_dict(arch: str, layers: int) -> dict:
    """The model file of one case: hidden 64, 4 heads (2 key/value heads for llama), 256 byte tokens."""
    spec = {"name": f"floor-{arch}-{layers}", "architecture": arch, "num_layers": layers, "hidden_size": 64,
            "num_attention_heads": 4, "vocab_size": 256, "seq_length": 64, "dtype": "fp32"}
    if arch == "llama":
        spec["num_kv_heads"] = 2
    return spec


def measure_cases(layer_counts, row_counts, repeats: int = 3, new: int = 16, progress=None) -> list[dict]:
    """One row per (architecture, layers, rows): ``first_call_s`` (prefill and the first token) and
    ``decode_step_s``. Sets torch to one thread (as the rollout ranks run)."""
    import torch

    from hetero.rl.generate import generate
    from hetero.rl.load import load_whole_model
    from hetero.specs.model import load_model
    from hetero.tokenizer import load_text_tokenizer

    torch.set_num_threads(1)
    tok = load_text_tokenizer("bytes", 256, "tokenizer")
    prompt = tok.encode("19+7=", special=True)
    rows = []
    for arch in ARCHITECTURES:
        for layers in layer_counts:
            model = load_whole_model(load_model(floor_model_dict(arch, layers)), None)
            for b in row_counts:
                def call(n, b=b):
                    return lambda: generate(model, [prompt], max_new_tokens=n, temperature=1.0, seed=0,
                                            samples=b, stop="\x00\x01", tokenizer=tok, batch_rows=b)
                one = median_seconds(call(1), repeats)
                many = median_seconds(call(new), repeats)
                rows.append({"arch": arch, "layers": layers, "rows": b, "prompt_tokens": len(prompt),
                             "first_call_s": one, "decode_step_s": (many - one) / (new - 1)})
                if progress:
                    progress(f"decode {arch} {layers} layers {b} rows")
    return rows


def fit(rows: list[dict], key: str) -> tuple[list[float], float]:
    """Least squares of ``key`` = per_step + per_layer[gpt] x layers + per_layer[llama] x layers +
    per_row x rows: (coefficients in that order, the largest relative residual). Writes each row's
    fitted value under ``key + "_fit"``."""
    import numpy as np

    X = np.array([[1.0, r["layers"] * (r["arch"] == "gpt"), r["layers"] * (r["arch"] == "llama"), r["rows"]]
                  for r in rows])
    y = np.array([r[key] for r in rows])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    pred = X @ coef
    for r, p in zip(rows, pred):
        r[key + "_fit"] = float(p)
    return [float(c) for c in coef], float(np.max(np.abs(pred - y) / y))


def dispatch_table(rows: list[dict]) -> dict:
    """The predictor's figures (:data:`hetero.predictor.generation.CPU_DISPATCH`'s keys) from measured
    cases; a negative fitted constant (a fit's intercept can dip below zero) counts as 0."""
    dec, dec_err = fit(rows, "decode_step_s")
    pre, pre_err = fit(rows, "first_call_s")
    pos = lambda v: max(0.0, v)  # noqa: E731
    return {"decode_per_step_s": pos(dec[0]), "decode_per_layer_s": {"gpt": pos(dec[1]), "llama": pos(dec[2])},
            "per_row_s": pos(dec[3]), "prefill_per_layer_s": {"gpt": pos(pre[1]), "llama": pos(pre[2])},
            "prefill_per_row_s": pos(pre[3]), "largest_residual": {"decode": dec_err, "prefill": pre_err},
            "cases": len(rows)}


def measure_decode_dispatch(progress=None) -> dict:
    """What ``hetero profile`` keeps as ``decode_dispatch``: :func:`dispatch_table` of
    :data:`PROFILE_CASES`."""
    return dispatch_table(measure_cases(PROFILE_CASES["layers"], PROFILE_CASES["rows"], progress=progress))


__all__ = ["ARCHITECTURES", "PROFILE_CASES", "profile_case_count", "dispatch_table", "fit", "floor_model_dict", "measure_cases", "measure_decode_dispatch"]
