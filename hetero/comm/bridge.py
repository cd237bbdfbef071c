"""The host bridge between vendors: Gloo (torch.distributed) or MPI (mpi4py), on CPU tensors.

A :class:`Bridge` spans the whole world (point-to-point between any two ranks of different
vendors) and makes :class:`BridgeGroup` objects over rank subsets (the vendor leaders of a
hierarchical collective). Every call takes a ``deadline`` (``time.monotonic()`` seconds) and raises
``TimeoutError`` (or torch's ``RuntimeError``) when it passes, so nothing waits forever.

Also here: :class:`StagingPool`, the reusable (pinned when the device is CUDA-like) host buffers
that device tensors are staged through on their way across the bridge.
"""
from __future__ import annotations

import datetime
import threading
import time
from typing import Sequence

from .errors import ReduceOp


def _remaining(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))


def wait_work(work, deadline: float) -> None:
    """Wait for a torch ``Work`` until ``deadline``."""
    if work is not None:
        work.wait(timeout=_remaining(deadline))


class StagingPool:
    """Host buffers reused across calls, keyed by dtype, grown on demand; pinned for CUDA-like devices."""

    def __init__(self):
        self._buffers: dict[tuple[object, int], object] = {}
        self._lock = threading.Lock()
        self.allocations = 0

    def get(self, numel: int, dtype, slot: int = 0, pin: bool = True):
        import torch

        key = (dtype, slot)
        with self._lock:
            buf = self._buffers.get(key)
            if buf is None or buf.numel() < numel:
                size = max(numel, 2 * buf.numel() if buf is not None else numel)
                buf = torch.empty(size, dtype=dtype, pin_memory=pin and _can_pin())
                self._buffers[key] = buf
                self.allocations += 1
            return buf[:numel]


def _can_pin() -> bool:
    import torch

    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


class BridgeGroup:
    """Collectives among ``ranks`` (global, sorted) over the bridge; host tensors only."""

    def __init__(self, bridge: "Bridge", ranks: Sequence[int]):
        self.bridge = bridge
        self.ranks = list(ranks)

    def all_reduce(self, host, op: ReduceOp, deadline: float) -> None:
        raise NotImplementedError

    def broadcast(self, host, src: int, deadline: float) -> None:
        raise NotImplementedError

    def all_gather(self, out, inp, deadline: float) -> None:
        """``out[i] = inp`` of ``ranks[i]``; ``out`` has shape ``(len(ranks), *inp.shape)``."""
        raise NotImplementedError

    def barrier(self, deadline: float) -> None:
        raise NotImplementedError


class Bridge:
    """World-wide host transport. ``group(ranks)`` must be called by every rank, in the same order."""

    name = ""

    def __init__(self, rank: int, world_size: int, timeout: float):
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._groups: dict[tuple[int, ...], BridgeGroup | None] = {}

    def group(self, ranks: Sequence[int]) -> BridgeGroup | None:
        key = tuple(sorted(ranks))
        if key not in self._groups:
            self._groups[key] = self._make_group(list(key))
        return self._groups[key]

    def _make_group(self, ranks: list[int]) -> BridgeGroup | None:
        raise NotImplementedError

    def isend(self, host, dst: int, tag: int):
        """Start sending a contiguous host tensor; returns a handle with ``wait(timeout=timedelta)``."""
        raise NotImplementedError

    def irecv(self, host, src: int, tag: int):
        """Start receiving into a contiguous host tensor; returns a handle with ``wait(timeout=timedelta)``."""
        raise NotImplementedError


# --------------------------------------------------------------------------------------------- Gloo
class GlooBridgeGroup(BridgeGroup):
    def __init__(self, bridge, ranks, pg):
        super().__init__(bridge, ranks)
        self.pg = pg

    def all_reduce(self, host, op, deadline):
        import torch.distributed as dist

        wait_work(dist.all_reduce(host, op=op.torch_op(), group=self.pg, async_op=True), deadline)

    def broadcast(self, host, src, deadline):
        import torch.distributed as dist

        wait_work(dist.broadcast(host, src=src, group=self.pg, async_op=True), deadline)

    def all_gather(self, out, inp, deadline):
        import torch.distributed as dist

        wait_work(dist.all_gather(list(out.unbind(0)), inp, group=self.pg, async_op=True), deadline)

    def barrier(self, deadline):
        import torch
        import torch.distributed as dist

        # an all-reduce of one byte, so the wait honours the deadline
        wait_work(dist.all_reduce(torch.zeros(1, dtype=torch.uint8), group=self.pg, async_op=True), deadline)


class GlooBridge(Bridge):
    name = "gloo"

    def __init__(self, rank, world_size, timeout):
        super().__init__(rank, world_size, timeout)
        import torch.distributed as dist

        td = datetime.timedelta(seconds=timeout)
        self.world_pg = dist.new_group(list(range(world_size)), backend="gloo", timeout=td)
        self.p2p_pg = dist.new_group(list(range(world_size)), backend="gloo", timeout=td)  # p2p apart

    def _make_group(self, ranks):
        import torch.distributed as dist

        if len(ranks) == self.world_size:
            pg = self.world_pg
        else:
            pg = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
        return GlooBridgeGroup(self, ranks, pg) if self.rank in ranks else None

    def isend(self, host, dst, tag):
        import torch.distributed as dist

        return dist.isend(host, dst=dst, group=self.p2p_pg, tag=tag)

    def irecv(self, host, src, tag):
        import torch.distributed as dist

        return dist.irecv(host, src=src, group=self.p2p_pg, tag=tag)


# ---------------------------------------------------------------------------------------------- MPI
def _mpi_wait(req, deadline: float, what: str) -> None:
    spins = 0
    while not req.Test():
        if time.monotonic() > deadline:
            raise TimeoutError(f"MPI {what} timed out")
        spins += 1
        if spins > 2000:
            time.sleep(0.0001)


class _Widen:
    """Carries a tensor MPI cannot reduce natively (fp16/bf16/bool) as float32/uint8 and back."""

    def __init__(self, host):
        import torch

        self.host = host
        if host.dtype == torch.bool:
            self.work = host.to(torch.uint8)
        elif host.dtype in (torch.bfloat16, torch.float16):
            self.work = host.float()
        else:
            self.work = host
        self.arr = self.work.numpy()

    def done(self):
        if self.work is not self.host:
            self.host.copy_(self.work)


class MpiBridgeGroup(BridgeGroup):
    def __init__(self, bridge, ranks, comm):
        super().__init__(bridge, ranks)
        self.comm = comm

    def all_reduce(self, host, op, deadline):
        from mpi4py import MPI

        mop = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op.value]
        w = _Widen(host)
        _mpi_wait(self.comm.Iallreduce(MPI.IN_PLACE, w.arr, op=mop), deadline, "all_reduce")
        w.done()

    def broadcast(self, host, src, deadline):
        w = _Widen(host)
        _mpi_wait(self.comm.Ibcast(w.arr, root=self.ranks.index(src)), deadline, "broadcast")
        w.done()

    def all_gather(self, out, inp, deadline):
        wi, wo = _Widen(inp.contiguous()), _Widen(out)
        _mpi_wait(self.comm.Iallgather(wi.arr, wo.arr), deadline, "all_gather")
        wo.done()

    def barrier(self, deadline):
        _mpi_wait(self.comm.Ibarrier(), deadline, "barrier")


class MpiBridge(Bridge):
    """MPI bridge: ranks of ``MPI.COMM_WORLD`` must equal torch.distributed ranks (launch with mpiexec)."""

    name = "mpi"

    def __init__(self, rank, world_size, timeout):
        super().__init__(rank, world_size, timeout)
        from mpi4py import MPI

        self.MPI = MPI
        self.world = MPI.COMM_WORLD.Dup()
        if self.world.Get_rank() != rank or self.world.Get_size() != world_size:
            raise RuntimeError(
                f"bridge='mpi' needs torch.distributed ranks to match MPI ranks: torch rank {rank}/{world_size}, "
                f"MPI rank {self.world.Get_rank()}/{self.world.Get_size()} (launch with mpiexec and initialise "
                "torch.distributed with hetero.backends.mpi.init_torch_distributed_from_mpi)")
        self.thread_level = MPI.Query_thread()

    def _make_group(self, ranks):
        MPI = self.MPI
        member = self.rank in ranks
        sub = self.world.Split(0 if member else MPI.UNDEFINED, key=self.rank)
        return MpiBridgeGroup(self, ranks, sub) if member else None

    def isend(self, host, dst, tag):
        w = _Widen(host)
        return _MpiHandle(self.world.Isend(w.arr, dest=dst, tag=tag), w, f"send to rank {dst}")

    def irecv(self, host, src, tag):
        w = _Widen(host)
        return _MpiHandle(self.world.Irecv(w.arr, source=src, tag=tag), w, f"recv from rank {src}")


class _MpiHandle:
    """An MPI request that waits like a torch ``Work`` (``wait(timeout=timedelta)``)."""

    def __init__(self, req, widen, what):
        self.req, self.widen, self.what = req, widen, what

    def wait(self, timeout=None):
        secs = timeout.total_seconds() if timeout is not None else 1e9
        _mpi_wait(self.req, time.monotonic() + secs, self.what)
        self.widen.done()
        return True

    def is_completed(self):
        return bool(self.req.Test())


def make_bridge(kind: str, rank: int, world_size: int, timeout: float) -> Bridge:
    kind = kind.lower()
    if kind == "gloo":
        return GlooBridge(rank, world_size, timeout)
    if kind == "mpi":
        from hetero.backends import MpiBackend

        ok, reason = MpiBackend().detect()
        if not ok:
            raise RuntimeError(f"bridge='mpi' is unavailable: {reason}")
        return MpiBridge(rank, world_size, timeout)
    raise ValueError(f"unknown bridge {kind!r} (use 'gloo' or 'mpi')")
