"""Vendor tags and the process-group backend each one uses.

A *vendor tag* names the collective library domain of a rank: ranks with the same tag talk through
their vendor library, ranks with different tags only through the host bridge. Real vendors map to
their library (``nvidia``/``cuda`` -> ``nccl``, ``amd``/``rocm`` -> ``nccl`` (RCCL in HIP builds),
``ascend`` -> ``hccl``, ``cpu`` -> ``gloo``; the table is :mod:`hetero.backends.registry`). Any other
tag (``emu-a``, ``emu-b``: emulated vendors on CPU) gets a Gloo process group registered under its own backend name (``hetero_emu_a``) through
``torch.distributed.Backend.register_backend``, so the third-party backend path really runs and two
emulated vendors never share a group.
"""
from __future__ import annotations

import re
import threading
from typing import Mapping, Sequence

from hetero.backends import registry

_registered: dict[str, str] = {}
_BUILTIN = ("gloo", "nccl", "hccl", "mpi", "ucc", "xccl")
_lock = threading.Lock()


def emulated_backend_name(tag: str) -> str:
    """``emu-a`` -> ``hetero_emu_a``: the backend name of an emulated vendor's Gloo group."""
    return "hetero_" + re.sub(r"[^0-9a-zA-Z]+", "_", tag).strip("_").lower()


def _make_gloo(store, rank, size, timeout):
    import torch.distributed as dist

    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _register_gloo(name: str, tag: str) -> str:
    """Register (once per process) a Gloo-backed backend called ``name`` for vendor ``tag``."""
    import torch.distributed as dist

    with _lock:
        if name not in _registered and name.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(name, _make_gloo, devices=["cpu"])
        _registered[name] = tag
    return name


def register_emulated(tag: str) -> str:
    """Register (once per process) a Gloo-backed backend for an emulated vendor tag; returns its name."""
    return _register_gloo(emulated_backend_name(tag), tag)


def backend_for(tag: str, overrides: Mapping[str, str] | None = None) -> str:
    """The process-group backend name for a vendor tag (registering emulated ones).

    ``overrides`` maps tags to backend names; a name torch does not know (not gloo/nccl/hccl/...)
    is registered as a Gloo-backed emulated backend under that name.
    """
    if overrides and tag in overrides:
        name = overrides[tag]
        return name if name in _BUILTIN else _register_gloo(name, tag)
    info = registry.vendor(tag)
    if info is not None and info.library:
        return info.library
    return register_emulated(tag)


def device_type_for(backend: str) -> str:
    """Device type of the tensors a backend takes (emulated vendors: cpu)."""
    return registry.device_type_of_library(backend)


def ensure_backend_loaded(backend: str) -> None:
    """Import the vendor package that registers a backend with torch (``hccl`` needs torch_npu)."""
    if backend == "hccl":
        from hetero.backends import AscendBackend

        ok, reason = AscendBackend().detect()
        if not ok:
            raise RuntimeError(f"vendor backend hccl is unavailable: {reason}")


def check_vendor_list(vendor_of_rank: Sequence[str], world_size: int) -> None:
    if len(vendor_of_rank) != world_size:
        raise ValueError(f"vendor_of_rank has {len(vendor_of_rank)} entries but the world has {world_size} ranks "
                         "(give one vendor tag per rank)")
    bad = [i for i, t in enumerate(vendor_of_rank) if not isinstance(t, str) or not t]
    if bad:
        raise ValueError(f"vendor_of_rank: ranks {bad} have no vendor tag (need a non-empty string each)")
