"""The runtime's own small-message costs between two processes of this machine.

An emulated cluster (every device a CPU process of this machine, docs/emulation.md) talks over
loopback Gloo, and the cluster file's links describe bandwidth and latency. What a tiny message
costs through the runtime is more than the latency a link declares: the communicator's Python
path, the host bridge between the two emulated vendors, and the wake-up of the rank that waits.
For tiny models these costs are a large part of a step (a two-stage pipeline of a 0.2M-parameter
GPT hands over sixteen activations a step and ends it with world all-reduces), so the predictor
takes them as floors on such clusters (:mod:`hetero.predictor.costs`).

Method: two spawned ranks on 127.0.0.1, each with the runtime's collectives
(:class:`hetero.runtime.collectives.Collectives`) over two emulated vendors (emu-a, emu-b: the
cross-vendor path the shipped examples take), one thread each. ``p2p_s``: half the median round
trip of a 64-byte tensor, sent and received as the pipeline does; ``allreduce_s``: the median of a
world all-reduce of 8 float64 values (the step's metrics row is of that size). Warm-up calls first;
medians of :data:`ROUNDS` calls. ``hetero profile`` on a CPU keeps the result in the profile's
sidecar (``loopback``).
"""
from __future__ import annotations

import os
import time

ROUNDS = 200
WARMUP = 20
TIMEOUT_S = 120.0


def _rank(rank: int, port: int, queue) -> None:
    """One of the two ranks (module level, so a spawned process can run it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from hetero.measure.profiling import median_seconds
    from hetero.runtime.collectives import Collectives

    torch.set_num_threads(1)
    comm = Collectives.init(rank, 2, TIMEOUT_S, vendors=["emu-a", "emu-b"], device=torch.device("cpu"),
                            device_types=["cpu", "cpu"])
    msg, row = torch.zeros(16), torch.zeros(8, dtype=torch.float64)

    def round_trip():
        if rank == 0:
            comm.send(msg, 1)
            comm.wait_sends()
            comm.recv(msg, 1)
        else:
            comm.recv(msg, 0)
            comm.send(msg, 0)
            comm.wait_sends()

    out = {"p2p_s": median_seconds(round_trip, ROUNDS, WARMUP) / 2,
           "allreduce_s": median_seconds(lambda: comm.all_reduce(row), ROUNDS, WARMUP)}
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def measure_loopback() -> dict | None:
    """``{"p2p_s", "allreduce_s", "vendors", "rounds"}`` measured as the module docstring says, or
    None when the two ranks could not run (no free port, a rank that failed): the predictor then
    keeps the cluster file's links alone. Both ranks are ended on the way out, whatever happened."""
    import multiprocessing as mp
    import queue as queues

    from hetero.runtime.launcher import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=_rank, args=(r, port, results), daemon=True) for r in range(2)]
    deadline = time.monotonic() + TIMEOUT_S
    got = None
    try:
        for p in ranks:
            p.start()
        while got is None and time.monotonic() < deadline:
            try:
                got = results.get(timeout=0.5)
            except queues.Empty:
                if any(p.exitcode not in (None, 0) for p in ranks):   # a rank failed: no answer comes
                    return None
    except OSError:
        return None
    finally:
        for p in ranks:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return None if got is None else {**got, "vendors": "emu-a/emu-b", "rounds": ROUNDS}


__all__ = ["ROUNDS", "measure_loopback"]
