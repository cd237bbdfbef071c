"""Huawei Ascend NPUs: ``torch_npu`` (needs the CANN runtime), HCCL, ``ASCEND_RT_VISIBLE_DEVICES``.

``torch_npu`` is imported only inside the methods that need it: importing it registers the
``npu`` device type and the ``hccl`` distributed backend with torch, and fails without CANN.
Detection first looks for the package without importing it, then for CANN's ``libhccl.so``,
so the reason it gives is precise: "torch_npu not installed" or "torch_npu installed but the
CANN runtime is missing: libhccl.so not found".
"""
from __future__ import annotations

import ctypes.util
import glob
import importlib.util
import os

from .base import Backend, MemoryInfo

_CANN_ROOTS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")
_DEFAULT_CANN = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/nnae/latest")


def _find_libhccl() -> str | None:
    """Path of CANN's ``libhccl.so`` if it can be found, else None."""
    found = ctypes.util.find_library("hccl")
    if found:
        return found
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    for var in _CANN_ROOTS:
        root = os.environ.get(var)
        if root:
            dirs += [os.path.join(root, "lib64"), os.path.join(root, "..", "lib64"), root]
    for root in _DEFAULT_CANN:
        dirs.append(os.path.join(root, "lib64"))
    for d in dirs:
        hits = glob.glob(os.path.join(d, "libhccl.so*"))
        if hits:
            return hits[0]
    return None


def _torch_npu_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("torch_npu")
    except Exception:  # noqa: BLE001
        return None



class AscendBackend(Backend):
    family = "ascend"

    def detect(self) -> tuple[bool, str]:
        if importlib.util.find_spec("torch_npu") is None:
            return False, "torch_npu not installed"
        version = _torch_npu_version() or "unknown version"
        lib = _find_libhccl()
        if lib is None:
            return False, (f"torch_npu {version} installed but the CANN runtime is missing: libhccl.so not found "
                           "(install CANN and source set_env.sh)")
        try:
            self._torch_npu()
        except Exception as e:  # noqa: BLE001
            return False, f"torch_npu {version} installed but failed to import: {type(e).__name__}: {e}"
        return True, f"torch_npu {version}, CANN at {os.path.dirname(lib) or lib}"

    @staticmethod
    def _torch_npu():
        import torch_npu  # noqa: F401  (registers the npu device and the hccl backend)

        return torch_npu

    def device_count(self) -> int:
        if not self.is_available():
            return 0
        import torch

        return torch.npu.device_count()

    def set_device(self, local_index: int = 0) -> None:
        self._torch_npu()
        import torch

        torch.npu.set_device(local_index)

    def memory_info(self, local_index: int = 0) -> MemoryInfo | None:
        if self.device_count() == 0:
            return None
        info = self._accelerator_memory(local_index)
        if info is not None:
            return info
        import torch

        free, total = torch.npu.mem_get_info(local_index)
        return MemoryInfo(total=int(total), free=int(free))
