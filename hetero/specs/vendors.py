"""Which collective library a vendor tag's ranks use, and what its point-to-point messages keep.

Kept free of torch so that plan checks (and the planner, which must not import torch) can apply
the rules that depend on the library; :mod:`hetero.comm.vendors` registers the process groups.
"""
from __future__ import annotations

LIBRARY_OF_VENDOR = {
    "nvidia": "nccl", "cuda": "nccl", "nccl": "nccl",
    "amd": "nccl", "rocm": "nccl", "rccl": "nccl",
    "ascend": "hccl", "npu": "hccl", "hccl": "hccl",
    "cpu": "gloo", "gloo": "gloo",
}
"""Real vendor tags and their library (RCCL is NCCL's API in HIP builds). Any other tag is an
emulated vendor on CPU: a Gloo group of its own."""

TAGLESS_P2P = ("nccl", "hccl")
"""Libraries whose send/recv ignore the message tag: two ranks' messages arrive in the order sent."""


def library_of(vendor: str) -> str:
    """The collective library of a vendor tag (``gloo`` for emulated vendors)."""
    return LIBRARY_OF_VENDOR.get(vendor.lower(), "gloo")


__all__ = ["LIBRARY_OF_VENDOR", "TAGLESS_P2P", "library_of"]
