"""NVIDIA GPUs: torch's CUDA build, NCCL collectives, ``CUDA_VISIBLE_DEVICES``."""
from __future__ import annotations

from .base import Backend, MemoryInfo


class CudaBackend(Backend):
    family = "nvidia"

    def detect(self) -> tuple[bool, str]:
        import torch

        if getattr(torch.version, "hip", None):
            return False, f"torch is a ROCm (HIP {torch.version.hip}) build, not CUDA"
        cuda = getattr(torch.version, "cuda", None)
        if not cuda:
            return False, f"torch {torch.__version__} was built without CUDA"
        detail = f"CUDA {cuda}"
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_nccl_available():
                nccl = torch.cuda.nccl.version()
                detail += ", NCCL " + ".".join(str(v) for v in (nccl if isinstance(nccl, tuple) else (nccl,)))
        except Exception:  # noqa: BLE001
            pass
        return True, detail

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count() if self.is_available() else 0

    def set_device(self, local_index: int = 0) -> None:
        import torch

        torch.cuda.set_device(local_index)

    def has_grouped_gemm(self, device, dtype) -> bool:
        """Hopper (compute capability 9.0) and newer, in bf16: torch's CUTLASS grouped GEMM."""
        import torch

        return (hasattr(torch, "_grouped_mm") and device.type == "cuda" and dtype == torch.bfloat16
                and torch.cuda.get_device_capability(device) >= (9, 0))

    def memory_info(self, local_index: int = 0) -> MemoryInfo | None:
        import torch

        info = self._accelerator_memory(local_index)
        if info is not None:
            return info
        if self.device_count() == 0:
            return None
        free, total = torch.cuda.mem_get_info(local_index)
        return MemoryInfo(total=int(total), free=int(free))
