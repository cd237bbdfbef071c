"""Generation tokens/s with the KV cache against batch size and context length, on the local CUDA GPU.

Model: Llama-2-7B cut to 8 layers, weights held in bf16 (what a rollout rank keeps), random values
(throughput does not depend on them). For each batch size B and context length C: B prompts of C
random tokens, NEW tokens generated for each (no end token), in one batch of B rows.

- decode: the cached forward alone (hetero.rl.generate.last_logits): one prefill of the B x C
  prompts, then NEW - 1 steps of one token per row, each step's greedy token fed back; timed between
  device synchronisations, median of REPS runs after WARM warm-up runs. Reported: prefill seconds,
  decode seconds per step, decode tokens/s (B / step time) and the KV cache's bytes;
- generate: hetero.rl.generate.generate end to end at temperature 1 (the rollout's sampling: one
  random stream per row), B x NEW / wall time, median of REPS runs;
- no cache, at the smallest context: every token recomputes the whole sequence (the model's own
  forward), greedy, for NO_CACHE_NEW tokens: tokens/s, and the ratio cached / uncached for as many
  tokens (cached: the prefill and NO_CACHE_NEW - 1 decode steps measured above) in the same run.

Writes JSON after every point, so a later failure keeps what was measured. Run from the repository
root on a machine with a CUDA GPU:
    python benchmarks/gpu/generate_cuda.py benchmarks/data/h200/generate.json
Without CUDA it says so and exits 0. ``--device cpu --quick`` runs a tiny model on the CPU (a check
that the script works, not a measurement to keep)."""
import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import hetero  # noqa: E402
from hetero.rl.generate import generate, last_logits  # noqa: E402
from hetero.rl.kv_cache import KVCache  # noqa: E402
from hetero.runtime.model import StageModel  # noqa: E402

FULL = {"model": "llama2-7b", "layers": 8, "batches": (1, 8, 32, 128), "contexts": (128, 512, 2048), "new": 128,
        "warm": 2, "reps": 5, "no_cache_new": 16}
QUICK = {"layers": 2, "batches": (1, 4), "contexts": (16, 64), "new": 8, "warm": 1, "reps": 3, "no_cache_new": 4}


def quick_spec(dtype="bf16"):
    """The tiny Llama that ``--quick`` runs (a check of the script, not a model to measure)."""
    return hetero.load_model({"name": "quick-llama", "architecture": "llama", "num_layers": 2, "hidden_size": 128,
                              "num_attention_heads": 4, "num_kv_heads": 2, "vocab_size": 512, "seq_length": 128,
                              "dtype": dtype})


def start(prog, description, full, quick, add_args=None):
    """Parse the command line these decode benchmarks share: (args, device, config), or None when CUDA
    is asked for and absent (said on stdout; the caller exits 0). ``add_args`` adds a script's own options."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("out", nargs="?", help="JSON file to write (default: print only)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    if add_args:
        add_args(ap)
    ap.add_argument("--quick", action="store_true", help="a tiny model and two sizes of each (checks the script)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{prog}: no CUDA device here; nothing measured (--device cpu --quick checks the script)")
        return None
    return args, torch.device(args.device), ({**full, **quick} if args.quick else full)


def build(spec, device):
    """The whole model on ``device`` with default-initialised (random) weights in the spec's dtype."""
    with torch.device(device):
        m = StageModel(spec, (0, spec.num_layers), True, True)
    return m.to({"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.dtype, torch.float32)).eval()


def timed(fn, device, warm, reps):
    times = []
    for i in range(warm + reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warm:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def point(m, spec, device, batch, context, cfg):
    g = torch.Generator().manual_seed(batch * 100003 + context)
    prompts = torch.randint(0, spec.vocab_size, (batch, context), generator=g).to(device)
    new = cfg["new"]
    box = {}

    def prefill_and_decode():
        cache = KVCache(m.layers.keys(), context + new)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            sync(device)
            t0 = time.perf_counter()
            logits = last_logits(m, prompts, cache)
            sync(device)
            box["prefill"] = time.perf_counter() - t0
            for _ in range(new - 1):
                logits = last_logits(m, logits.argmax(-1).view(batch, 1), cache)
        box["kv_bytes"] = cache.nbytes()

    prefills = []

    def run():
        prefill_and_decode()
        prefills.append(box["prefill"])

    total = timed(run, device, cfg["warm"], cfg["reps"])
    prefill = statistics.median(prefills[cfg["warm"]:])
    step = (total - prefill) / (new - 1)
    rows = prompts.tolist()
    wall = timed(lambda: generate(m, rows, max_new_tokens=new, temperature=1.0, seed=0, batch_rows=batch),
                 device, cfg["warm"], cfg["reps"])
    return {"batch": batch, "context": context, "new_tokens": new, "prefill_s": prefill, "decode_step_s": step,
            "decode_tokens_per_s": batch / step, "kv_cache_bytes": box["kv_bytes"],
            "generate_s": wall, "generate_tokens_per_s": batch * new / wall}


@torch.no_grad()
def no_cache(m, spec, device, batch, context, cfg):
    """Tokens/s when every new token recomputes the whole sequence (no KV cache)."""
    tokens = torch.randint(0, spec.vocab_size, (batch, context), generator=torch.Generator().manual_seed(1)).to(device)
    n = cfg["no_cache_new"]

    def run():
        seq = tokens
        with torch.autocast(device.type, dtype=torch.bfloat16):
            for _ in range(n):
                seq = torch.cat([seq, m(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)

    return batch * n / timed(run, device, cfg["warm"], cfg["reps"])


def main() -> int:
    started = start("generate_cuda", __doc__.split("\n\n")[0], FULL, QUICK)
    if started is None:
        return 0
    args, device, cfg = started
    if args.quick:
        spec = quick_spec()
    else:
        spec = hetero.load_model(str(REPO / "configs" / "models" / f"{FULL['model']}.yaml"))
        spec = dataclasses.replace(spec, num_layers=cfg["layers"], dtype="bf16",
                                   seq_length=max(spec.seq_length, max(cfg["contexts"]) + cfg["new"]))
    m = build(spec, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {"device": name, "torch": torch.__version__, "model": spec.name, "layers": spec.num_layers,
              "dtype": "bf16", "config": {k: v for k, v in cfg.items() if k != "model"},
              "method": __doc__.split("\n\n")[1:4], "points": []}
    for context in cfg["contexts"]:
        for batch in cfg["batches"]:
            row = point(m, spec, device, batch, context, cfg)
            if context == cfg["contexts"][0]:
                n = cfg["no_cache_new"]
                row["no_cache_tokens_per_s"] = no_cache(m, spec, device, batch, context, cfg)
                cached = batch * n / (row["prefill_s"] + (n - 1) * row["decode_step_s"])
                row["cached_over_no_cache"] = cached / row["no_cache_tokens_per_s"]
            print(json.dumps(row), flush=True)
            result["points"].append(row)
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
