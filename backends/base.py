"""The one small interface every vendor backend implements.

A backend answers, without touching a device unless asked: is this vendor's software stack here
(``detect``), what torch device type and ``torch.device`` a local index maps to, which
``torch.distributed`` backend its collectives use, which environment variable restricts the
visible devices, and how much memory a device has. Vendor libraries are imported lazily, inside
the methods that need them, so ``import hetero.backends`` stays cheap and works everywhere.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryInfo:
    """Device memory in bytes (``free`` may be None where the vendor cannot say)."""

    total: int
    free: int | None = None


class Backend(abc.ABC):
    """A vendor backend: detection, devices, the distributed library and memory."""

    #: short name: cuda | rocm | ascend | cpu | mpi
    name: str = ""
    #: torch device type string ("cuda" also for ROCm: HIP builds of torch reuse it)
    device_type: str = "cpu"
    #: ``torch.distributed`` backend name of this vendor's collective library
    dist_backend: str = "gloo"
    #: environment variable that restricts which devices a process sees (None: none)
    visible_devices_env: str | None = None
    #: the vendor's collective library, for display (NCCL, RCCL, HCCL, Gloo, MPI)
    library: str = ""
    #: the vendor family in :mod:`hetero.backends.registry` whose facts fill the attributes above
    family: str | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "family" in cls.__dict__:   # a subclass naming its family takes every fact from the registry
            from . import registry

            info = registry.family(cls.family)
            cls.name, cls.device_type, cls.dist_backend = info.backend, info.device_type, info.library
            cls.visible_devices_env, cls.library = info.visible_devices_env, info.library_label

    @abc.abstractmethod
    def detect(self) -> tuple[bool, str]:
        """``(available, detail)``: detail is a version when available, else the reason it is not.

        Detection probes installed software, not devices: a CUDA build of torch on a login node
        without a GPU still reports the CUDA backend as available (its version says so).
        """

    def is_available(self) -> bool:
        return self.detect()[0]

    def device_count(self) -> int:
        """Devices this process can see (0 when none or unknown)."""
        return 0

    def device(self, local_index: int = 0):
        """The ``torch.device`` of local device ``local_index``."""
        import torch

        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, local_index)

    def set_device(self, local_index: int = 0) -> None:
        """Make ``local_index`` the current device of this process (no-op on CPU)."""

    def has_grouped_gemm(self, device, dtype) -> bool:
        """Whether ``torch._grouped_mm`` (one kernel for many matrix products of different row counts:
        a mixture of experts' expert compute) runs well on ``device`` in ``dtype``; False: a loop over
        the products."""
        return False

    def memory_info(self, local_index: int = 0) -> MemoryInfo | None:
        """Total and free memory of a device, or None where unknown."""
        return None

    def visible_devices(self) -> str | None:
        """The current value of the visible-devices variable (None if unset or none)."""
        import os

        return os.environ.get(self.visible_devices_env) if self.visible_devices_env else None

    def _accelerator_memory(self, local_index: int) -> MemoryInfo | None:
        """Memory through the generic ``torch.accelerator`` API (torch >= 2.6) when it applies."""
        import torch

        acc = getattr(torch, "accelerator", None)
        if acc is None or not hasattr(acc, "get_memory_info"):
            return None
        try:
            current = acc.current_accelerator() if acc.is_available() else None
            if current is None or current.type != self.device_type:
                return None
            free, total = acc.get_memory_info(local_index)
            return MemoryInfo(total=int(total), free=int(free))
        except Exception:  # noqa: BLE001 - memory is best effort
            return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}: {self.dist_backend}>"
