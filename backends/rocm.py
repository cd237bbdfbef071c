"""AMD GPUs: torch's ROCm (HIP) build; RCCL under torch's ``nccl`` backend name; ``HIP_VISIBLE_DEVICES``.

A HIP build of torch exposes AMD GPUs as ``cuda`` devices and RCCL as the ``nccl`` backend, so
only detection (``torch.version.hip``) and the visible-devices variable differ from CUDA.
"""
from __future__ import annotations

from typing import Optional, Tuple

from .base import Backend, MemoryInfo


class RocmBackend(Backend):
    name = "rocm"
    device_type = "cuda"
    dist_backend = "nccl"  # RCCL answers to the NCCL name in HIP builds of torch
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    library = "RCCL"

    def detect(self) -> Tuple[bool, str]:
        import torch

        hip = getattr(torch.version, "hip", None)
        if not hip:
            return False, f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None)"
        return True, f"HIP {hip}"

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count() if self.is_available() else 0

    def set_device(self, local_index: int = 0) -> None:
        import torch

        torch.cuda.set_device(local_index)

    def memory_info(self, local_index: int = 0) -> Optional[MemoryInfo]:
        import torch

        info = self._accelerator_memory(local_index)
        if info is not None:
            return info
        if self.device_count() == 0:
            return None
        free, total = torch.cuda.mem_get_info(local_index)
        return MemoryInfo(total=int(total), free=int(free))
