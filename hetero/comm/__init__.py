"""``hetero.comm``: one communicator over NCCL / RCCL / HCCL / Gloo, with a Gloo or MPI host bridge.

Quick use (every rank, after ``torch.distributed.init_process_group``)::

    from hetero.comm import Communicator
    comm = Communicator.from_vendors(['emu-a', 'emu-a', 'emu-b', 'emu-c'], bridge='gloo', timeout=60)
    comm.all_reduce(t, op='sum')                   # world: hierarchical across the three vendors
    g = comm.new_group([0, 1])                     # collective; same-vendor ranks: flat, no bridge
    w = comm.all_reduce(t, op='avg', group=g, async_op=True); w.wait()
    comm.send(t, dst=2); comm.recv(t, src=2)       # across vendors: host memory over the bridge
    comm.stats.bridge_bytes, comm.stats.vendor_bytes

or :func:`init` to initialise ``torch.distributed`` from the usual environment variables first.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from .communicator import DEFAULT_TIMEOUT, Communicator
from .errors import HeteroCommError, HeteroCommTimeout, ReduceOp
from .group import Group
from .stats import CommStats, TraceEntry
from .vendors import backend_for, emulated_backend_name
from .work import Work

__all__ = [
    "Communicator", "Group", "Work", "CommStats", "TraceEntry", "ReduceOp", "HeteroCommError",
    "HeteroCommTimeout", "init", "backend_for", "emulated_backend_name", "DEFAULT_TIMEOUT",
]


def init(vendor_of_rank: Sequence[str], bridge: str = "gloo", timeout: float = DEFAULT_TIMEOUT,
         backend_of_vendor: Mapping[str, str] | None = None, init_method: str | None = None,
         rank: int | None = None, world_size: int | None = None) -> Communicator:
    """Initialise ``torch.distributed`` if needed, then build the :class:`Communicator`.

    Without ``init_method``, the usual variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, as torchrun sets them) are used; under ``mpiexec`` with ``bridge='mpi'`` the
    rank and a free port come from MPI. The default group is Gloo on CPU, plus the vendor's
    library for its device type (``cpu:gloo,cuda:nccl``) where this rank's vendor needs it.
    """
    import datetime
    import os

    import torch.distributed as dist

    if not dist.is_initialized():
        from .vendors import backend_for as _bf, device_type_for

        if bridge == "mpi" and init_method is None and "MASTER_PORT" not in os.environ:
            from hetero.backends.mpi import init_torch_distributed_from_mpi

            init_torch_distributed_from_mpi("gloo", timeout_s=timeout)
        else:
            r = int(os.environ["RANK"]) if rank is None else rank
            ws = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
            own = _bf(vendor_of_rank[r], backend_of_vendor)
            dev = device_type_for(own)
            backend = "gloo" if dev == "cpu" else f"cpu:gloo,{dev}:{own}"
            dist.init_process_group(backend, init_method=init_method or "env://", rank=r, world_size=ws,
                                    timeout=datetime.timedelta(seconds=timeout))
    return Communicator.from_vendors(vendor_of_rank, bridge=bridge, timeout=timeout,
                                     backend_of_vendor=backend_of_vendor)
