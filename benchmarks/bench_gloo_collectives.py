"""Gloo's collectives against the predictor's ring model at the point-to-point rate, on this machine.

    .venv/bin/python benchmarks/bench_gloo_collectives.py [--mb 17] [--rounds 9]

Two processes (one thread each, as the runtime's CPU workers) in one Gloo group on 127.0.0.1. Each
round times, back to back after a barrier: a send / recv of the whole buffer (the point-to-point
rate a cluster file's loopback link stands for), an all-reduce of the buffer, and an all-gather of
two halves in the list form the host bridge uses (``dist.all_gather``). The predictor charges a
2-rank ring all-reduce one buffer's transfer and a 2-rank all-gather half of one; the ratios
(each collective over that model, at the send / recv time measured in the same round) say how much
more Gloo takes. Medians over the rounds after the first; the load average before and after is
recorded, since other jobs on the cores slow the collectives' reductions and copies too. Writes
benchmarks/results/gloo_collectives.json.

Why: the demo's plan on the emulated pair (ZeRO-1 over two vendors) predicted a 21 ms gradient
sync; the run's per-rank summary measured several times that, and the same plan at ZeRO 0 synced
5.4x faster in the same minute (docs/emulation.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _worker(rank: int, port: int, nbytes: int, rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    n = nbytes // 4
    buf, half, parts = torch.ones(n), torch.ones(n // 2), torch.empty(2, n // 2)
    ops = {"send_recv": lambda: dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0),
           "all_reduce": lambda: dist.all_reduce(buf),
           "all_gather_list": lambda: dist.all_gather(list(parts.unbind(0)), half)}
    times: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(rounds):
        for name, fn in ops.items():
            dist.barrier()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=17.0, help="buffer size in MB (the demo's gradients: 17)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("-o", default=str(ROOT / "benchmarks" / "results" / "gloo_collectives.json"))
    args = ap.parse_args(argv)
    import tempfile

    import torch.multiprocessing as mp

    nbytes = int(args.mb * 1e6) // 8 * 8
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "times.json"
        mp.spawn(_worker, args=(29400 + os.getpid() % 500, nbytes, args.rounds, str(raw)), nprocs=2)
        times = json.loads(raw.read_text())
    load_after = os.getloadavg()
    base = times["send_recv"][1:]
    model = {"send_recv": 1.0, "all_reduce": 1.0, "all_gather_list": 0.5}   # x one buffer's transfer
    rows = {}
    for name, ts in times.items():
        ts = ts[1:]
        ratio = statistics.median(t / (model[name] * b) for t, b in zip(ts, base))
        rows[name] = {"median_s": statistics.median(ts), "over_ring_model": ratio}
        print(f"{name:16s} {statistics.median(ts) * 1e3:8.1f} ms  {ratio:5.2f}x the ring model at the p2p rate")
    print(f"p2p rate {nbytes / statistics.median(base) / 1e9:.2f} GB/s; load average {load_before[0]:.1f} -> "
          f"{load_after[0]:.1f}")
    out = Path(args.o)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"method": __doc__, "bytes": nbytes, "rounds": args.rounds, "ops": rows,
                               "p2p_bytes_per_s": nbytes / statistics.median(base),
                               "load_average": [load_before[0], load_after[0]]}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
