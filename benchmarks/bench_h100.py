#!/usr/bin/env python
"""The predictor on a GPU it never saw: an H100 SXM5 measured with hetero's own tools.

Data (benchmarks/data/h100/, measured on one NVIDIA H100 80GB HBM3, torch 2.11 + CUDA 13):
  profile.csv   `hetero profile --device H100-SXM5-80GB` (the CUDA path: each operator timed as one
                isolated call between CUDA events, like the NeuSight records; 191 shapes of a
                transformer layer's operators plus the 17 probe shapes, fp32 and fp16).
  steps.json    benchmarks/gpu/step_cuda.py: whole training steps of the runtime's own models
                (hetero.runtime.model on one GPU: GPT-2-large fp32 and bf16, GPT-3 1.3B bf16, Llama-2-7B
                cut to 8 layers bf16; each at its own sequence length): forward with the loss, backward,
                AdamW, each between CUDA events, median of 10 after 3 warm-ups; peak allocated memory.
                The AdamW is the runtime's: torch's fused kernel, one pass over parameter, gradient and
                moments (re-measured for it: 8.1 ms for GPT-2-large, where the multi-tensor kernel the
                runtime used before took 21.0 ms; forward and backward reproduced within 1-2%).
  launch.json   benchmarks/gpu/launch_cuda.py: whole steps of `hetero launch` itself, the native engine
                placing the stage on the GPU (one rank: schedule of 2 micro-batches, gradient-norm
                reduction, fused AdamW with the clip factor, metrics); median of 7 steady steps.
  grad_norm.json benchmarks/gpu/grad_norm_cuda.py: the step's squared gradient norm, per-tensor dot
                products vs torch's multi-tensor norm (the runtime's on a GPU).
The learned operator model was fitted on the five NeuSight GPUs (A100, P100, P4, T4, V100; fp32);
the H100 is none of them, so it is predicted from its catalog entry (configs/devices.yaml).

Part 1, operators: APE of each profile row (probe rows left out), per dtype and family, for
  specs      the shipped model from the catalog specs alone;
  probed     the same model pinned by the profile's probe rows (what `hetero predict` uses once
             `hetero profile` has run on the device: per-op floors, bandwidth and GEMM peak scales);
  roofline   max(FLOPs / peak, bytes / bandwidth), no fitted factor.
fp16 rows test the model's unvalidated assumption that fp32 utilisation carries over to tensor cores.
Part 2, training steps: `hetero predict --json` of a one-GPU, one-stage plan of the same model and
micro-batch, with an empty profile cache (specs) and with the profile cached (probed: bf16 takes the
fp16 calibration, the same tensor cores at the same peak); forward and
backward per micro-batch, the step (forward + backward + optimizer) and peak memory vs measured.
Part 3, launched steps: `hetero predict --json` of the launched plan (specs / probed, as in part 2)
vs the median iteration time `hetero launch` measured on the GPU.
The model files say `attention: fused`, as the runtime runs it (--attention unfused shows what
Megatron's unfused attention would be predicted to cost).

    python benchmarks/bench_h100.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "benchmarks" / "data" / "h100"
DEVICE = "H100-SXM5-80GB"
ATTENTION = "fused"  # the runtime's attention is torch's scaled_dot_product_attention (flash on an H100)
CLUSTER = {"name": "h100x1", "groups": [{"name": "h100", "device": DEVICE, "nodes": 1, "devices_per_node": 1,
                                         "intra_node": {"bandwidth": "450 GB/s", "latency": "5 us"}}],
           "network": {"inter_node": {"bandwidth": "50 GB/s", "latency": "10 us"}}}


def _records():
    from hetero.predictor.opmodel.specs import Records
    from hetero.predictor.profiles import read_records

    return Records.from_rows([{"op": r.op, "device": r.device, "dtype": r.dtype, "latency_ms": r.latency_ms, **r.dims}
                              for r in read_records(DATA / "profile.csv")])


def operators() -> dict:
    from hetero.predictor.opmodel import default_model, roofline_latency
    from hetero.predictor.opmodel.lodo import metrics
    from hetero.predictor.opmodel.probes import ProbedDevice, probe_rows
    from hetero.specs.device import load_catalog

    rec = _records()
    device = load_catalog()[DEVICE]
    model = default_model()
    probed = ProbedDevice(model, device, rec)
    probes = set()
    for dt in set(rec.dtype.tolist()):
        probes |= set(probe_rows(rec, dt).values())
    test = rec.subset(np.setdiff1d(np.arange(len(rec)), sorted(probes)))
    out = {"n_probe_rows": len(probes)}
    for dt in sorted(set(test.dtype.tolist())):
        sub = test.subset(test.dtype == dt)
        meas = sub.latency_ms * 1e-3
        rows = [{k: float(v[i]) for k, v in sub.dims.items() if np.isfinite(v[i])} for i in range(len(sub))]
        preds = {"specs": model.predict_many(sub.op, sub.dims, dt, device),
                 "probed": np.array([probed.predict(str(o), d, dt) for o, d in zip(sub.op, rows)]),
                 "roofline": np.array([roofline_latency(str(o), d, dt, device) for o, d in zip(sub.op, rows)])}
        out[dt] = {k: metrics(sub.op, p, meas) for k, p in preds.items()}
    return out


def step_inputs(run: dict, attention: str) -> tuple[dict, dict, dict]:
    """(cluster, model, plan) dicts of a measured step ``run`` (a row of steps.json or launch.json):
    one H100, one stage with every layer, ``run["micro_batches"]`` (default 1) micro-batches of the
    run's size, the model with ``attention``."""
    spec = yaml.safe_load((REPO / "configs" / "models" / f"{run['model']}.yaml").read_text())
    spec.update(dtype=run["dtype"], num_layers=run.get("num_layers") or spec["num_layers"], attention=attention)
    m = run.get("micro_batches", 1)
    plan = {"global_batch_size": run["batch"] * m, "micro_batch_size": run["batch"], "schedule": "1f1b",
            "recompute": "none", "zero_stage": 0, "pipelines": [{"replicas": 1, "micro_batches": m,
            "stages": [{"group": "h100", "tp": 1, "layers": [0, spec["num_layers"]]}]}]}
    return CLUSTER, spec, plan


def launch_summary(run: dict, steps: int, attention: str = "fused") -> tuple[dict | None, str]:
    """`hetero launch` of the measured step ``run`` (:func:`step_inputs`) for ``steps`` steps on this
    machine's GPU: (the run summary, "") or (None, the end of its stderr) when it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for name, body in zip(("cluster", "model", "plan"), step_inputs(run, attention)):
            files[name] = Path(tmp) / f"{name}.yaml"
            files[name].write_text(yaml.safe_dump(body))
        summary_path = Path(tmp) / "summary.json"
        res = subprocess.run([sys.executable, "-m", "hetero", "launch", "--cluster", str(files["cluster"]),
                              "--model", str(files["model"]), "--plan", str(files["plan"]), "--steps", str(steps),
                              "--summary", str(summary_path), "--quiet", "--timeout", "600"],
                             capture_output=True, text=True, cwd=REPO, timeout=900)
        if res.returncode:
            return None, res.stderr[-2000:]
        return json.loads(summary_path.read_text()), ""


def _predict(tmp: Path, run: dict, cache: Path) -> dict:
    """`hetero predict --json` of the run's step, with ``cache`` as the profile cache."""
    files = dict(zip(("cluster.yaml", "model.yaml", "plan.yaml"), step_inputs(run, ATTENTION)))
    for name, body in files.items():
        (tmp / name).write_text(yaml.safe_dump(body))
    env = dict(os.environ, HETERO_CACHE_DIR=str(cache))
    res = subprocess.run([sys.executable, "-m", "hetero", "predict", "--cluster", str(tmp / "cluster.yaml"),
                          "--model", str(tmp / "model.yaml"), "--plan", str(tmp / "plan.yaml"), "--json"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    if res.returncode:
        raise SystemExit(f"hetero predict failed: {res.stderr}")
    return json.loads(res.stdout)


def _predicted(name: str, keys: tuple[str, ...]):
    """For each run of data file ``name`` (failed runs left out): the run, a row of its ``keys``, and
    `hetero predict --json` of it per profile cache (specs, probed)."""
    measured = json.loads((DATA / name).read_text())["runs"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        caches = _caches(tmp)
        for run in measured:
            if "error" not in run:
                yield run, {k: run.get(k) for k in keys}, {label: _predict(tmp, run, c) for label, c in caches.items()}


def steps() -> list[dict]:
    out = []
    for _, row, predictions in _predicted("steps.json", ("model", "num_layers", "dtype", "batch", "forward_ms",
                                                         "backward_ms", "optimizer_ms", "peak_allocated_bytes")):
        for label, p in predictions.items():
            st = p["pipelines"][0]["stages"][0]
            row[label] = {"forward_ms": st["forward_time_s"] * 1e3, "backward_ms": st["backward_time_s"] * 1e3,
                          "step_ms": p["iteration_time_s"] * 1e3, "peak_memory_bytes": st["peak_memory_bytes"]}
        out.append(row)
    return out


def launches() -> list[dict]:
    """launch.json's runs with the predictions of the launched plan (specs and probed)."""
    bare_steps = [b for b in json.loads((DATA / "steps.json").read_text())["runs"] if "error" not in b]
    out = []
    for run, row, predictions in _predicted("launch.json", ("model", "num_layers", "dtype", "batch", "micro_batches")):
        row["measured_ms"] = run["median_iteration_time_s"] * 1e3
        bare = [b for b in bare_steps if all(b.get(k) == run.get(k) for k in ("model", "dtype", "batch"))]
        # the same micro-batch measured alone (steps.json): m x (forward + backward) + AdamW
        row["bare_step_ms"] = (run["micro_batches"] * (bare[0]["forward_ms"] + bare[0]["backward_ms"])
                               + bare[0]["optimizer_ms"]) if bare else None
        for label, p in predictions.items():
            row[f"{label}_ms"] = p["iteration_time_s"] * 1e3
        row["error"] = {label: row[f"{label}_ms"] / row["measured_ms"] - 1 for label in predictions}
        out.append(row)
    return out


def _caches(tmp: Path) -> dict[str, Path]:
    """Profile caches: ``specs`` empty, ``probed`` holding the H100's measured profile."""
    empty, cached = tmp / "empty", tmp / "cached"
    (cached / "profiles").mkdir(parents=True)
    empty.mkdir()
    (cached / "profiles" / f"{DEVICE}.csv").write_bytes((DATA / "profile.csv").read_bytes())
    return {"specs": empty, "probed": cached}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--attention", choices=("fused", "unfused"), default="fused",
                    help="the model files' attention setting (the runtime's is fused)")
    args = ap.parse_args(argv)
    global ATTENTION
    ATTENTION = args.attention
    print(__doc__.split("\n\n")[0] + "\n")
    ops = operators()
    print(f"Part 1, operators on the H100 ({ops['n_probe_rows']} probe rows left out): MAPE / medAPE")
    fams = ("gemm", "norm", "elementwise")
    print(f"{'dtype':6s} {'method':9s} {'overall':>15s}" + "".join(f"{f:>15s}" for f in fams))
    for dt in ("fp32", "fp16"):
        for m in ("specs", "probed", "roofline"):
            r = ops[dt][m]
            print(f"{dt:6s} {m:9s} {r['overall']['mape']:>8.1%} /{r['overall']['medape']:>5.1%}"
                  + "".join(f"{r['family'][f]['mape']:>8.1%} /{r['family'][f]['medape']:>5.1%}" for f in fams))
    st = steps()
    print("\nPart 2, training steps on one H100 (ms; error = predicted / measured - 1)")
    print("(fwd+bwd: one micro-batch forward and backward, the NeuSight e2e quantity; step adds the optimizer)")
    print(f"{'model':14s} {'dtype':5s} {'batch':>5s} {'fwd+bwd':>8s} {'optim':>6s} {'mem GB':>7s} | "
          f"{'specs fwd+bwd':>13s} {'step':>6s} {'mem':>6s} | {'probed fwd+bwd':>14s} {'step':>6s} {'mem':>6s}")
    for r in st:
        fb = r["forward_ms"] + r["backward_ms"]
        r["fwd_bwd_error"], r["step_error"], r["memory_error"] = {}, {}, {}
        cells = []
        for label in ("specs", "probed"):
            p = r[label]
            r["fwd_bwd_error"][label] = (p["forward_ms"] + p["backward_ms"]) / fb - 1
            r["step_error"][label] = p["step_ms"] / (fb + r["optimizer_ms"]) - 1
            r["memory_error"][label] = p["peak_memory_bytes"] / r["peak_allocated_bytes"] - 1
            cells.append(f"{r['fwd_bwd_error'][label]:>+{13 + (label == 'probed')}.1%} {r['step_error'][label]:>+6.1%} "
                         f"{r['memory_error'][label]:>+6.1%}")
        name = r["model"] + (f"/{r['num_layers']}L" if r["model"] == "llama2-7b" else "")
        print(f"{name:14s} {r['dtype']:5s} {r['batch']:>5d} {fb:>8.1f} {r['optimizer_ms']:>6.1f} "
              f"{r['peak_allocated_bytes'] / 1e9:>7.1f} | {cells[0]} | {cells[1]}")
    pred = [r["specs"]["step_ms"] - r["specs"]["forward_ms"] - r["specs"]["backward_ms"] for r in st]
    print(f"optimizer step predicted {min(pred):.1f} .. {max(pred):.1f} ms (gradient-norm pass + fused AdamW, 4 + 28 "
          f"bytes per parameter); measured fused AdamW alone {min(r['optimizer_ms'] for r in st):.1f} .. "
          f"{max(r['optimizer_ms'] for r in st):.1f} ms (these isolated steps run no norm pass: GPT-2-large's takes "
          f"{json.loads((DATA / 'grad_norm.json').read_text())['rows']['runtime sync_gradients (one rank)']['median_ms']:.1f}"
          f" ms, below)")
    launched = launches()
    print("\nPart 3, `hetero launch` on one H100 (the native engine on the GPU): iteration time, ms")
    print("(bare: part 2's isolated forward + backward of the same micro-batch, m times, + AdamW: what the runtime "
          "adds on top)")
    print(f"{'model':14s} {'dtype':5s} {'mbs x m':>7s} {'measured':>9s} {'bare':>7s} {'added':>6s} | {'specs':>7s} "
          f"{'error':>7s} | {'probed':>7s} {'error':>7s}")
    for r in launched:
        name = r["model"] + (f"/{r['num_layers']}L" if r.get("num_layers") else "")
        added = f"{r['measured_ms'] / r['bare_step_ms'] - 1:>+6.1%}" if r["bare_step_ms"] else f"{'-':>6s}"
        print(f"{name:14s} {r['dtype']:5s} {str(r['batch']) + ' x ' + str(r['micro_batches']):>7s} "
              f"{r['measured_ms']:>9.1f} {r['bare_step_ms'] or 0:>7.1f} {added} | {r['specs_ms']:>7.1f} "
              f"{r['error']['specs']:>+7.1%} | {r['probed_ms']:>7.1f} {r['error']['probed']:>+7.1%}")
    norm = json.loads((DATA / "grad_norm.json").read_text())
    print(f"\nThe gradient norm of a GPT-2-large step on the GPU ({norm['tensors']} tensors, "
          f"benchmarks/gpu/grad_norm_cuda.py; median ms):")
    for label, r in norm["rows"].items():
        print(f"  {label:36s} {r['median_ms']:6.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"method": __doc__, "operators": ops, "steps": st,
                                               "launches": launched}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
