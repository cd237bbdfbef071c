#!/usr/bin/env python
"""How much of an operator's latency on an unseen GPU the spec sheet can explain (NeuSight data).

Four measurements, no model involved, printed and written to
benchmarks/results/opmodel_limits.json:
  1. launch floor per (op, GPU): the 1% quantile of the op's latency on that GPU, and the share of
     rows within 3x of it. A spec-only predictor must guess this host + driver + framework constant.
  2. sustained fraction of the fp32 datasheet peak reached by large linears (M, N, K >= 2048;
     quartiles), next to TDP, peak and bandwidth per FLOP.
  3. same-shape transfer: predict each GPU's GEMM latencies from ANOTHER GPU's measurement of the
     very same shape, as floor_target + (latency_source - floor_source) x peak_source / peak_target
     (the target's own floor is given, i.e. this is more than specs). MAPE per (target, source):
     the error a predictor would have even with a perfect shape model borrowed from a sibling GPU.
  4. sustained fraction of the datasheet memory bandwidth reached by large memory-bound ops (at
     least 200 MB moved; median per op), the bandwidth twin of 2.

    python benchmarks/bench_opmodel_limits.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "opmodel_limits.json"


def main(argv=None) -> int:
    from hetero.predictor.opmodel import load_neusight, shared_data_dir
    from hetero.predictor.opmodel import features as F

    data = shared_data_dir(REPO)
    if not (data / "neusight" / "ops").is_dir():
        print(f"skipped: no NeuSight data under {data} (set HETERO_SHARED_DATA)")
        return 0
    rec, devices = load_neusight(data)
    names = sorted(set(rec.device.tolist()))
    short = {n: n.replace("Tesla ", "").replace("NVIDIA ", "").split("-")[0] for n in names}
    print(__doc__.split("\n\n")[0] + "\n")

    floors, near = {}, {}
    for op in F.OPS:
        for n in names:
            lat = rec.latency_ms[(rec.op == op) & (rec.device == n)]
            floors[(op, n)] = float(np.quantile(lat, 0.01)) * 1e3
            near[(op, n)] = float(np.mean(lat * 1e3 < 3 * floors[(op, n)]))
    print("1. launch floor, us (share of rows within 3x of it)")
    print(f"{'op':8s}" + "".join(f"{short[n]:>16s}" for n in names))
    for op in F.OPS:
        print(f"{op:8s}" + "".join(f"{floors[(op, n)]:>9.1f} ({near[(op, n)]:>3.0%})" for n in names))

    print("\n2. large linears (M, N, K >= 2048): achieved / datasheet fp32 peak, quartiles")
    sustained = {}
    for n in names:
        m = (rec.op == "linear") & (rec.device == n)
        M, N, K = (rec.dims[k][m] for k in "MNK")
        big = (M >= 2048) & (N >= 2048) & (K >= 2048)
        tf = 2 * M[big] * N[big] * K[big] / (rec.latency_ms[m][big] * 1e-3)
        dev = devices[n]
        peak = dev.matrix_flops("fp32")
        q = np.quantile(tf / peak, [0.25, 0.5, 0.75])
        sustained[n] = {"quartiles": [float(v) for v in q], "rows": int(big.sum()), "peak_tflops": peak / 1e12,
                        "tdp_w": float(dev.tdp) if dev.tdp else None,
                        "bytes_per_flop": dev.effective_memory_bandwidth / peak}
        print(f"{short[n]:6s} {q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f}   (peak {peak / 1e12:5.1f} TFLOP/s, "
              f"TDP {sustained[n]['tdp_w']} W, {sustained[n]['bytes_per_flop']:.3f} B/FLOP, {big.sum()} rows)")

    print("\n3. same-shape transfer from another GPU, MAPE (rows = target, columns = source)")
    transfer = {}
    for op in ("linear", "bmm"):
        m = rec.op == op
        keys = np.stack([rec.dims[k][m] for k in "BMNK"], axis=1)
        per = {}
        for n in names:
            sel = rec.device[m] == n
            per[n] = {tuple(k): v for k, v in zip(keys[sel], rec.latency_ms[m][sel])}
        common = set.intersection(*(set(p) for p in per.values()))
        common = sorted(common)
        lat = {n: np.array([per[n][k] for k in common]) for n in names}
        print(f"{op} ({len(common)} shapes measured on all five)")
        print(f"{'target':8s}" + "".join(f"{short[s]:>8s}" for s in names))
        for t in names:
            row = []
            for s in names:
                if s == t:
                    row.append(None)
                    continue
                ft, fs = np.quantile(lat[t], 0.01), np.quantile(lat[s], 0.01)
                ratio = devices[s].matrix_flops("fp32") / devices[t].matrix_flops("fp32")
                pred = ft + np.maximum(lat[s] - fs, 0) * ratio
                row.append(float(np.mean(np.abs(pred - lat[t]) / lat[t])))
            transfer[f"{op}/{t}"] = {s: v for s, v in zip(names, row) if v is not None}
            print(f"{short[t]:8s}" + "".join("       -" if v is None else f"{v:>8.0%}" for v in row))
    best = {k: min(v.values()) for k, v in transfer.items()}
    print("\nbest sibling per target: " + ", ".join(f"{k.split('/')[0]} {short[k.split('/')[1]]} {v:.0%}"
                                                  for k, v in best.items()))

    print("\n4. large memory-bound ops (>= 200 MB moved): achieved / datasheet bandwidth, median (rows)")
    bw_ops = ("add", "mul", "gelu", "ln", "softmax")
    print(f"{'GPU':6s} {'GB/s':>6s}" + "".join(f"{op:>13s}" for op in bw_ops))
    bandwidth = {}
    for n in names:
        dev, cells = devices[n], []
        bandwidth[n] = {}
        for op in bw_ops:
            m = (rec.device == n) & (rec.op == op)
            _, _, nbytes = F.vector_work(F.VEC_INPUTS[op], F.VEC_FLOPS[op], rec.dims["B"][m], rec.dims["H"][m], 4)
            big = nbytes >= 200e6
            frac = nbytes[big] / (rec.latency_ms[m][big] * 1e-3) / dev.effective_memory_bandwidth
            bandwidth[n][op] = {"median": float(np.median(frac)), "rows": int(big.sum())}
            cells.append(f"{np.median(frac):>7.2f} ({big.sum():>3d})")
        print(f"{short[n]:6s} {dev.effective_memory_bandwidth / 1e9:>6.0f}" + "".join(cells))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"method": __doc__, "floors_us": {f"{op}/{n}": v for (op, n), v in floors.items()},
                               "share_within_3x_floor": {f"{op}/{n}": v for (op, n), v in near.items()},
                               "large_linear_fraction_of_peak": sustained, "same_shape_transfer_mape": transfer,
                               "best_sibling_mape": best, "large_memory_bound_fraction_of_bandwidth": bandwidth},
                              indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
