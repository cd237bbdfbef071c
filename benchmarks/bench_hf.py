"""Hugging Face import / export: time and memory against the model's size.

Writes a random Llama-shaped model folder (config.json and safetensors shards of at most 500 MB,
the names and shapes transformers uses; hidden 1024, 12 layers, GQA 16/4 heads, vocab 32000: 201 M
parameters, 0.80 GB in fp32), then runs ``hetero import-hf`` on it and ``hetero export-hf`` of the
result as subprocesses, sampling each one's /proc status every 20 ms: the peak of its anonymous
resident memory (what the process allocated; the memory-mapped safetensors pages it reads are
file-backed page cache, counted apart as RssFile) and of RssFile. Also reports the bytes a stage of
a PP2 x TP2 split reads (hetero.hf.weights on its own, no process group needed for the pipeline part)
against its share. Repeats each command ``--runs`` times; medians. Prints a table and writes
benchmarks/results/hf.json.

    .venv/bin/python benchmarks/bench_hf.py [--runs 3] [--layers 12]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def write_model(path: str, layers: int) -> "ModelSpec":  # noqa: F821
    from safetensors.torch import save_file

    from hetero.hf.config import hf_config
    from hetero.hf.weights import sources
    from hetero.specs.model import ModelSpec

    spec = ModelSpec(name="bench", architecture="llama", num_layers=layers, hidden_size=1024,
                     num_attention_heads=16, num_kv_heads=4, ffn_hidden_size=2816, vocab_size=32000,
                     seq_length=2048, tie_embeddings=False)
    os.makedirs(path)
    keys = {}
    for src in sources(spec, "llama").values():
        keys.setdefault(src.key, src.hf_shape)
    shards, current, size = [], {}, 0
    for key, shape in keys.items():
        n = int(torch.Size(shape).numel()) * 4
        if current and size + n > 500e6:
            shards.append(current)
            current, size = {}, 0
        current[key] = shape
        size += n
    shards.append(current)
    weight_map = {}
    g = torch.Generator().manual_seed(0)
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: torch.randn(s, generator=g) * 0.02 for k, s in shard.items()}, os.path.join(path, name),
                  metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**hf_config(spec), "max_position_embeddings": 2048}, f)
    return spec


def _status_kib(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0])
    except OSError:
        pass
    return out


def measured(cmd: list[str]) -> dict:
    """Wall seconds and peak RssAnon / RssFile (GB) of ``cmd``, sampled every 20 ms."""
    peak = {"RssAnon": 0, "RssFile": 0}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def sample():
        while proc.poll() is None:
            for k, v in _status_kib(proc.pid).items():
                peak[k] = max(peak[k], v)
            time.sleep(0.02)

    watcher = threading.Thread(target=sample)
    watcher.start()
    _, err = proc.communicate()
    watcher.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err}")
    return {"seconds": time.perf_counter() - t0, "anon_gb": peak["RssAnon"] * 1024 / 1e9,
            "file_gb": peak["RssFile"] * 1024 / 1e9}


def stage_bytes(folder: str, spec) -> list[dict]:
    """Bytes the two pipeline stages (layers split in half) read, against their parameters' bytes."""
    from hetero.hf.weights import load_stage_weights
    from hetero.runtime.model import build_stage

    half = spec.num_layers // 2
    out = []
    for layers, first, last in (((0, half), True, False), ((half, spec.num_layers), False, True)):
        stage = build_stage(spec, layers, first, last, 0)
        read = load_stage_weights(folder, stage, spec)
        out.append({"layers": list(layers), "read_gb": read / 1e9,
                    "share_gb": sum(p.numel() * 4 for p in stage.parameters()) / 1e9})
        del stage
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="hetero-bench-hf-")
    try:
        src = os.path.join(tmp, "hf")
        spec = write_model(src, args.layers)
        model_gb = spec.total_params() * 4 / 1e9
        hetero = [sys.executable, "-m", "hetero"]
        runs: dict[str, list[dict]] = {"import-hf": [], "export-hf": []}
        for r in range(args.runs):
            out, back = os.path.join(tmp, f"imported{r}"), os.path.join(tmp, f"exported{r}")
            runs["import-hf"].append(measured(hetero + ["import-hf", src, "-o", out]))
            runs["export-hf"].append(measured(hetero + ["export-hf", "--model", os.path.join(out, "model.yaml"),
                                                        "--checkpoint", os.path.join(out, "checkpoint"), "-o", back,
                                                        "--max-shard-size", "500MB"]))
            shutil.rmtree(out)
            shutil.rmtree(back)
        baseline = [measured([sys.executable, "-c", "import torch, hetero.hf.convert, safetensors.torch"])
                    for _ in range(args.runs)]
        result = {
            "model": {"parameters": spec.total_params(), "fp32_gb": model_gb,
                      "largest_tensor_gb": spec.vocab_size * spec.hidden_size * 4 / 1e9},
            "method": "medians of %d runs; peak RssAnon/RssFile sampled from /proc every 20 ms; 'python' is a "
                      "process that only imports torch and hetero.hf; machine load average %.1f at the end"
                      % (args.runs, os.getloadavg()[0]),
            "commands": {k: {m: statistics.median(x[m] for x in v) for m in ("seconds", "anon_gb", "file_gb")}
                         for k, v in {**runs, "python": baseline}.items()},
            "pipeline_stages": stage_bytes(src, spec),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"model: {spec.total_params() / 1e6:.0f} M parameters, {model_gb:.2f} GB fp32, largest tensor "
          f"{result['model']['largest_tensor_gb']:.3f} GB")
    print(f"{'command':<12}{'seconds':>10}{'peak anon GB':>15}{'peak file GB':>15}")
    for k, v in result["commands"].items():
        print(f"{k:<12}{v['seconds']:>10.1f}{v['anon_gb']:>15.3f}{v['file_gb']:>15.3f}")
    for s in result["pipeline_stages"]:
        print(f"stage layers {s['layers']}: read {s['read_gb']:.3f} GB, holds {s['share_gb']:.3f} GB")
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "hf.json"), "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
