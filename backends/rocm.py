"""AMD GPUs: torch's ROCm (HIP) build; RCCL under torch's ``nccl`` backend name; ``HIP_VISIBLE_DEVICES``.

A HIP build of torch exposes AMD GPUs as ``cuda`` devices and RCCL as the ``nccl`` backend, so
only detection (``torch.version.hip``) and the visible-devices variable differ from CUDA: the
device, count and memory calls are :class:`~hetero.backends.cuda.CudaBackend`'s.
"""
from __future__ import annotations

from .cuda import CudaBackend


class RocmBackend(CudaBackend):
    family = "amd"  # RCCL answers to the NCCL name in HIP builds of torch

    def detect(self) -> tuple[bool, str]:
        import torch

        hip = getattr(torch.version, "hip", None)
        if not hip:
            return False, f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None)"
        return True, f"HIP {hip}"

    def has_grouped_gemm(self, device, dtype) -> bool:
        """torch's grouped GEMM kernel is CUDA's (CUTLASS): a loop over the experts on AMD GPUs."""
        return False
