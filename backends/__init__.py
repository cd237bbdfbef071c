"""Vendor backends (imported as ``hetero.backends``).

One module per vendor behind one small interface (:class:`~hetero.backends.base.Backend`):
``cuda`` (NCCL), ``rocm`` (RCCL under torch's ``nccl`` name), ``ascend`` (torch_npu + HCCL),
``cpu`` (Gloo) and ``mpi`` (mpi4py, the host bridge between vendors). Vendor libraries are
imported lazily, inside the backend that needs them.

Public calls::

    from hetero.backends import get_backend, select_backend, env_report
    b = select_backend()            # HETERO_BACKEND, else probe installed packages, else CPU (+warning)
    b.detect()                      # (True, "CUDA 12.4, NCCL 2.21.5") or (False, reason)
    b.device(local_rank), b.dist_backend, b.visible_devices_env, b.memory_info(0)
    rows = env_report()             # [EnvRow(component, status, detail), ...] for ``hetero env``

Vendor facts (families, aliases, libraries, visible-devices variables) live in one table,
:mod:`hetero.backends.registry`; the backends read theirs from it.
"""
from __future__ import annotations

import importlib.util
import os
import warnings
from typing import NamedTuple

from . import registry
from .ascend import AscendBackend
from .base import Backend, MemoryInfo
from .cpu import CpuBackend
from .cuda import CudaBackend
from .mpi import MpiBackend, find_mpiexec
from .rocm import RocmBackend

__all__ = [
    "Backend", "MemoryInfo", "CudaBackend", "RocmBackend", "AscendBackend", "CpuBackend", "MpiBackend",
    "BACKENDS", "DEVICE_BACKENDS", "ENV_VAR", "get_backend", "select_backend", "env_report", "EnvRow",
    "find_mpiexec", "BackendFallbackWarning", "registry", "backend_of",
]

#: environment variable that forces a device backend by name
ENV_VAR = "HETERO_BACKEND"

BACKENDS: dict[str, type] = {
    "cuda": CudaBackend,
    "rocm": RocmBackend,
    "ascend": AscendBackend,
    "cpu": CpuBackend,
    "mpi": MpiBackend,
}
#: backends that own a device (``mpi`` is a bridge between vendors, not a device backend)
DEVICE_BACKENDS = ("ascend", "rocm", "cuda", "cpu")
#: vendor tags that name a backend (``nvidia``, ``nccl`` -> ``cuda``), from :mod:`hetero.backends.registry`
_ALIASES = registry.backend_aliases()


class BackendFallbackWarning(UserWarning):
    """No accelerator software stack was found: running on CPU with Gloo."""


def get_backend(name: str) -> Backend:
    """The backend called ``name`` (or an alias such as ``nvidia``, ``amd``, ``npu``, ``gloo``)."""
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in BACKENDS:
        import difflib

        close = difflib.get_close_matches(key, list(BACKENDS) + list(_ALIASES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown backend {name!r} (known: {', '.join(BACKENDS)}){hint}")
    return BACKENDS[key]()


def select_backend(env: dict[str, str] | None = None) -> Backend:
    """Choose this process's device backend.

    1. ``HETERO_BACKEND`` (in ``env``, default ``os.environ``) names one: it is used if its
       software is installed, else a ``RuntimeError`` gives the reason.
    2. Otherwise installed packages are probed (not devices): torch_npu + CANN, a ROCm build of
       torch, a CUDA build of torch.
    3. Otherwise CPU (Gloo), with a :class:`BackendFallbackWarning`.
    """
    env = os.environ if env is None else env
    forced = env.get(ENV_VAR, "").strip()
    if forced:
        backend = get_backend(forced)
        if backend.name not in DEVICE_BACKENDS:
            raise ValueError(f"{ENV_VAR}={forced}: {backend.name!r} is a bridge between vendors, not a device "
                             f"backend (choose one of {', '.join(DEVICE_BACKENDS)})")
        ok, detail = backend.detect()
        if not ok:
            raise RuntimeError(f"{ENV_VAR}={forced} but the {backend.name} backend is not available: {detail}")
        return backend
    reasons = []
    for name in DEVICE_BACKENDS[:-1]:
        backend = BACKENDS[name]()
        ok, detail = backend.detect()
        if ok:
            return backend
        reasons.append(f"{name}: {detail}")
    warnings.warn("no accelerator software found, falling back to CPU (Gloo): " + "; ".join(reasons)
                  + f" (set {ENV_VAR} to choose explicitly)", BackendFallbackWarning, stacklevel=2)
    return CpuBackend()


def backend_of(device) -> Backend:
    """The vendor backend of a ``torch.device`` (``cuda`` devices are ROCm's in a HIP build of torch,
    ``npu`` Ascend's, anything else the CPU's): where a capability such as
    :meth:`~hetero.backends.base.Backend.has_grouped_gemm` is asked."""
    import torch

    if device.type == "cuda":
        return RocmBackend() if getattr(torch.version, "hip", None) else CudaBackend()
    return AscendBackend() if device.type == "npu" else CpuBackend()


class EnvRow(NamedTuple):
    component: str
    status: str  # "found" | "missing"
    detail: str  # a version when found, else the reason


def _dist_version(name: str):
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return None


def env_report() -> list[EnvRow]:
    """What this machine has for ``hetero``: torch, each vendor stack, MPI, Gloo, DeepSpeed.

    Cheap: nothing is initialised and DeepSpeed is looked up, not imported.
    """
    rows: list[EnvRow] = []

    def row(component, ok, detail):
        rows.append(EnvRow(component, "found" if ok else "missing", detail))

    try:
        import torch

        row("torch", True, torch.__version__)
    except Exception as e:  # noqa: BLE001
        row("torch", False, f"cannot import torch: {e}")
        return rows

    acc = getattr(torch, "accelerator", None)
    try:
        if acc is not None and acc.is_available():
            dev = acc.current_accelerator()
            row("accelerator", True, f"{dev.type} x{acc.device_count()} (torch.accelerator)")
        else:
            row("accelerator", False, "no accelerator device visible to torch")
    except Exception as e:  # noqa: BLE001
        row("accelerator", False, f"torch.accelerator failed: {e}")

    for label, cls in (("CUDA (NCCL)", CudaBackend), ("ROCm (RCCL)", RocmBackend), ("torch_npu/CANN (HCCL)", AscendBackend)):
        backend = cls()
        ok, detail = backend.detect()
        if ok:
            n = backend.device_count()
            detail += f"; {n} device(s)" + (f" [{backend.visible_devices_env}={backend.visible_devices()}]"
                                            if backend.visible_devices() is not None else "")
        row(label, ok, detail)

    ok, detail = MpiBackend().detect()
    mpiexec = find_mpiexec()
    if ok:
        detail += f"; mpiexec: {mpiexec or 'not found'}"
    row("MPI (mpi4py)", ok, detail)

    ok, detail = CpuBackend().detect()
    row("Gloo", ok, detail)

    spec = importlib.util.find_spec("deepspeed")
    if spec is None:
        row("DeepSpeed", False, "not installed (pip install deepspeed)")
    else:
        row("DeepSpeed", True, _dist_version("deepspeed") or "installed (version unknown)")

    try:
        chosen = select_backend_quiet()
        row("selected backend", True, f"{chosen.name} ({chosen.dist_backend})")
    except Exception as e:  # noqa: BLE001
        row("selected backend", False, str(e))
    return rows


def select_backend_quiet() -> Backend:
    """:func:`select_backend` without the CPU fallback warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BackendFallbackWarning)
        return select_backend()
