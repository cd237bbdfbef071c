"""RL weight-sync GB/s on the local CUDA GPU: the actor's weights to a whole rollout copy, as
:mod:`hetero.rl.sync` moves them in a ``hetero rl`` run.

Model: Llama-2-7B cut to LAYERS layers (fp32 parameters, as the actor holds them; random values).
Two placements of one step's sync, each timed between device synchronisations, median of REPS runs
after WARM warm-up runs, reported as parameter bytes per second:

- collocated: the actor rank (the GPU) fills its own temporary whole copy on the same GPU (the pieces
  it holds are copied on the device; one process);
- cross-vendor: the actor rank on the GPU (vendor ``nvidia``) sends to a rollout rank of another vendor
  (an emulated CPU rank, ``emu-b``) through the unified communicator's host bridge: bucketed, staged
  through host memory, over Gloo on loopback (two processes). Every run's CRC32 checksums are
  compared (they must match).

Writes JSON. Run from the repository root on a machine with a CUDA GPU:
    python benchmarks/gpu/weight_sync_cuda.py benchmarks/data/h200/weight_sync.json
Without CUDA it says so and exits 0. ``--device cpu --quick`` runs a tiny model with both ranks on
the CPU (a check that the script works, not a measurement to keep)."""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import hetero  # noqa: E402
from hetero.layout import RankInfo, RankLayout  # noqa: E402
from hetero.rl.sync import WeightSync, checksums_match, local_params, whole_model  # noqa: E402
from hetero.runtime.model import StageModel  # noqa: E402

FULL = {"layers": 4, "warm": 1, "reps": 5, "bucket_mb": 256.0}
QUICK = {"layers": 2, "warm": 1, "reps": 3, "bucket_mb": 1.0}


def spec_of(quick: bool):
    if quick:
        return hetero.load_model({"name": "quick-llama", "architecture": "llama", "num_layers": 2, "hidden_size": 128,
                                  "num_attention_heads": 4, "num_kv_heads": 2, "vocab_size": 512, "seq_length": 128,
                                  "dtype": "fp32"})
    base = hetero.load_model(str(REPO / "configs" / "models" / "llama2-7b.yaml")).to_dict()
    return hetero.load_model({**base, "num_layers": FULL["layers"], "dtype": "fp32"})


def actor_layout(spec):
    plan = hetero.load_plan({"global_batch_size": 1, "micro_batch_size": 1,
                             "pipelines": [{"micro_batches": 1,
                                            "stages": [{"group": "actor", "layers": [0, spec.num_layers]}]}]})
    info = RankInfo(rank=0, group="actor", vendor="nvidia", node=0, local_rank=0, pipeline=0, replica=0, stage=0,
                    tp_rank=0, tp_size=1, layers=(0, spec.num_layers))
    return plan, RankLayout(ranks=(info,), nodes=())


def sync_device(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def collocated(spec, device, cfg) -> dict:
    plan, layout = actor_layout(spec)
    with torch.device(device):
        actor = StageModel(spec, (0, spec.num_layers), True, True)
    params = local_params(actor)
    sync = WeightSync(spec, plan, layout, [0], {0: "nvidia"}, cfg["bucket_mb"])
    _, whole = whole_model(spec, device)
    times = []
    for i in range(cfg["warm"] + cfg["reps"]):
        sync_device(device)
        t0 = time.perf_counter()
        sync.receive(None, 0, whole, i, params)
        sync_device(device)
        if i >= cfg["warm"]:
            times.append(time.perf_counter() - t0)
    nbytes = sum(p.numel() * 4 for p in params.values())
    return {"bytes": nbytes, "seconds": statistics.median(times), "GB_per_s": nbytes / statistics.median(times) / 1e9,
            "checksums_match": checksums_match([sync.log])[0]}


def _cross_rank(rank: int, port: int, device_name: str, quick: bool, out: str) -> None:
    from hetero.runtime.collectives import Collectives

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cfg = QUICK if quick else FULL
    spec = spec_of(quick)
    device = torch.device(device_name if rank == 0 else "cpu")
    torch.set_num_threads(1)
    comm = Collectives.init(rank, 2, 600.0, vendors=["nvidia" if device_name == "cuda" else "emu-a", "emu-b"],
                            device=device, device_types=[device_name, "cpu"])
    plan, layout = actor_layout(spec)
    sync = WeightSync(spec, plan, layout, [1], {0: "nvidia", 1: "emu-b"}, cfg["bucket_mb"])
    if rank == 0:
        with torch.device(device):
            params = local_params(StageModel(spec, (0, spec.num_layers), True, True))
    else:
        _, whole = whole_model(spec, "cpu")
    times = []
    for i in range(cfg["warm"] + cfg["reps"]):
        comm.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            sync.send(comm, 0, params, i)
            comm.wait_sends()
        else:
            sync.receive(comm, 1, whole, i)
        comm.barrier()
        if i >= cfg["warm"]:
            times.append(time.perf_counter() - t0)
    logs = comm.all_gather_object(sync.log)
    if rank == 0:
        nbytes = sum(p.numel() * 4 for p in params.values())
        Path(out).write_text(json.dumps({"bytes": nbytes, "seconds": statistics.median(times),
                                         "GB_per_s": nbytes / statistics.median(times) / 1e9,
                                         "checksums_match": checksums_match(logs)[0]}))
    comm.shutdown()


def cross_vendor(device_name: str, quick: bool, tmp: str) -> dict:
    import torch.multiprocessing as mp

    from hetero.runtime.launcher import free_port

    mp.spawn(_cross_rank, args=(free_port(), device_name, quick, tmp), nprocs=2, join=True)
    return json.loads(Path(tmp).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: nothing measured")
        return 0
    cfg = QUICK if args.quick else FULL
    device = torch.device(args.device)
    if device.type == "cpu":   # as a worker runs (one thread: many spinning threads on busy cores cost more)
        torch.set_num_threads(1)
    spec = spec_of(args.quick)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "config": cfg,
               "model": spec.name, "layers": spec.num_layers}
    results["collocated"] = collocated(spec, device, cfg)
    print(f"collocated (on the device): {results['collocated']['GB_per_s']:.2f} GB/s, checksums match "
          f"{results['collocated']['checksums_match']}", flush=True)
    tmp = (args.out or "weight_sync") + ".cross.tmp"
    results["cross_vendor"] = cross_vendor(args.device, args.quick, tmp)
    os.remove(tmp)
    print(f"cross-vendor (device -> host bridge -> CPU rank): {results['cross_vendor']['GB_per_s']:.2f} GB/s, "
          f"checksums match {results['cross_vendor']['checksums_match']}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
