"""Host CPUs: Gloo collectives. Always available; also the carrier of emulated vendors."""
from __future__ import annotations

import os

from .base import Backend, MemoryInfo


class CpuBackend(Backend):
    family = "cpu"

    def detect(self) -> tuple[bool, str]:
        import torch

        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_gloo_available()):
                return False, f"torch {torch.__version__} was built without Gloo"
        except Exception as e:  # noqa: BLE001
            return False, f"torch.distributed unavailable: {e}"
        return True, f"Gloo (torch {torch.__version__}), {os.cpu_count()} cores"

    def device_count(self) -> int:
        return 1

    def memory_info(self, local_index: int = 0) -> MemoryInfo | None:
        total = free = None
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    key, value = line.split(":", 1)
                    if key == "MemTotal":
                        total = int(value.split()[0]) * 1024
                    elif key == "MemAvailable":
                        free = int(value.split()[0]) * 1024
        except OSError:
            try:
                total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError):
                return None
        return MemoryInfo(total=total, free=free) if total else None
