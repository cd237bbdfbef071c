"""The vendor registry: every fact hetero keeps about a vendor, in one table.

A *vendor family* is what a device type's ``vendor:`` names in ``configs/devices.yaml`` (``nvidia``,
``amd``, ``ascend``, ``intel``, ``cpu``, ``other``). Each has one :class:`VendorInfo`: the tags that
also name it (``cuda``, ``rocm``, ``npu``, the library names), the backend module of
:mod:`hetero.backends` that probes and drives its devices, the torch device type its ranks compute
on, the ``torch.distributed`` backend its collectives use and the environment variable that
restricts which devices a process sees. The launcher, the runtime, the spec checks and the
communicator all ask here, e.g. ``visible_devices_env("amd")`` -> ``"HIP_VISIBLE_DEVICES"``.

A family without a backend (``intel``, ``other``) computes on the CPU; a vendor tag that names no
family here (``emu-a``) is an emulated vendor: a Gloo group of its own (:mod:`hetero.comm.vendors`).

Pure data, no imports: the spec checks and the predict path, which never import torch, use it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VendorInfo:
    """One vendor family and what hetero needs to know about it."""

    name: str
    """The family as a device type's ``vendor:`` writes it."""
    aliases: tuple[str, ...] = ()
    """Other vendor tags (and ``HETERO_BACKEND`` values) that name this family."""
    backend: str | None = None
    """The :mod:`hetero.backends` backend (module and name) that probes and drives it; None: computes on the CPU."""
    device_type: str = "cpu"
    """The torch device type its ranks compute on (``cuda`` also for ROCm: HIP builds of torch reuse it)."""
    library: str | None = None
    """``torch.distributed`` backend of its collectives (RCCL answers to ``nccl``); None: a Gloo group of its own."""
    library_label: str = ""
    """The collective library as people call it, for display (NCCL, RCCL, HCCL, Gloo)."""
    visible_devices_env: str | None = None
    """Environment variable that restricts which of its devices a process sees (None: none)."""
    framework_overhead_bytes: int = 512 * 2**20
    """Bytes a device of this family spends outside the tensors the model owns (the runtime's context,
    library workspaces, allocator slack), as the predictor's peak memory charges them; 0 for CPU
    processes (their memory is measured as live tensor bytes)."""

    @property
    def accelerator(self) -> bool:
        """True when its ranks compute on a device of their own (not the host CPU)."""
        return self.device_type != "cpu"


VENDORS: tuple[VendorInfo, ...] = (
    VendorInfo("nvidia", aliases=("cuda", "nccl"), backend="cuda", device_type="cuda", library="nccl",
               library_label="NCCL", visible_devices_env="CUDA_VISIBLE_DEVICES"),
    VendorInfo("amd", aliases=("rocm", "rccl", "hip"), backend="rocm", device_type="cuda", library="nccl",
               library_label="RCCL", visible_devices_env="HIP_VISIBLE_DEVICES"),
    VendorInfo("ascend", aliases=("npu", "hccl"), backend="ascend", device_type="npu", library="hccl",
               library_label="HCCL", visible_devices_env="ASCEND_RT_VISIBLE_DEVICES", framework_overhead_bytes=2**30),
    VendorInfo("intel"),
    VendorInfo("cpu", aliases=("gloo",), backend="cpu", device_type="cpu", library="gloo", library_label="Gloo",
               framework_overhead_bytes=0),
    VendorInfo("other"),
)
"""Every vendor family, in the order error messages list them."""

TAGLESS_P2P = ("nccl", "hccl")
"""Libraries whose send/recv ignore the message tag: two ranks' messages arrive in the order sent."""

_FAMILY = {v.name: v for v in VENDORS}
_TAG = {tag: v for v in VENDORS for tag in (v.name, *v.aliases)}


def family_names() -> tuple[str, ...]:
    """The vendor families a device type's ``vendor:`` may name (other tags: emulated devices only)."""
    return tuple(_FAMILY)


def family(name: str) -> VendorInfo | None:
    """The family called exactly ``name`` (no aliases: a device type's family), or None."""
    return _FAMILY.get(name)


def vendor(tag: str) -> VendorInfo | None:
    """The family a vendor tag names, by name or alias, in any case (None: an emulated vendor)."""
    return _TAG.get(tag.lower())


def visible_devices_env(family_name: str) -> str | None:
    """The visible-devices variable of a family (``nvidia`` -> ``CUDA_VISIBLE_DEVICES``), None if it has none."""
    info = family(family_name)
    return info.visible_devices_env if info else None


def is_accelerator(family_name: str) -> bool:
    """True when ranks of this family compute on a device of their own (emulated and unknown: the CPU)."""
    info = family(family_name)
    return bool(info and info.accelerator)


def library_of(tag: str) -> str:
    """The collective library of a vendor tag (``gloo`` for emulated vendors and families without one)."""
    info = vendor(tag)
    return (info.library if info else None) or "gloo"


def device_type_of_library(library: str) -> str:
    """Device type of the tensors a collective library takes (emulated vendors' backends: ``cpu``)."""
    for v in VENDORS:
        if v.library == library:
            return v.device_type
    return "cpu"


def framework_overhead(family_name: str) -> int:
    """Bytes a device of the family spends outside the model's tensors (an unknown family: ``other``'s)."""
    return (family(family_name) or _FAMILY["other"]).framework_overhead_bytes


def backend_aliases() -> dict[str, str]:
    """Every tag that names a family with a backend -> that backend's name (``nvidia``, ``nccl`` -> ``cuda``)."""
    return {tag: v.backend for tag, v in _TAG.items() if v.backend}


__all__ = ["VendorInfo", "VENDORS", "TAGLESS_P2P", "family_names", "family", "vendor", "visible_devices_env",
           "is_accelerator", "library_of", "device_type_of_library", "framework_overhead", "backend_aliases"]
