"""The device a rank computes on, and waiting for it.

A rank whose group's device type is a real accelerator (catalog vendor ``nvidia``, ``amd`` or
``ascend``) computes on it: its stage, activations, gradients and optimizer state live on
``cuda:<i>`` (ROCm builds of torch reuse ``torch.cuda``) or ``npu:<i>``, through the vendor backend's
own calls (:mod:`hetero.backends`). ``i`` is the worker's ``LOCAL_RANK``: the launcher gives each
node slot its own devices through the vendor's visible-devices variable, renumbered from 0.
``base: cpu`` device types (emulated accelerators) compute on the CPU.

Accelerator work is asynchronous: the host queues kernels and moves on. A timing that brackets
work on a device must wait for the device at both ends (:func:`synchronize`), or it measures how
long queuing took.
"""
from __future__ import annotations

import os

import torch

from hetero.backends import registry
from hetero.errors import HeteroError


def torch_device_type(family: str) -> str:
    """The torch device type a vendor family computes on (``cpu`` for emulated and unknown ones),
    known on every rank without touching a device."""
    info = registry.family(family)
    return info.device_type if info is not None else "cpu"


def rank_device(family: str, local_index: int | None = None) -> torch.device:
    """This process's device for a group of vendor ``family``, made current (``set_device``), so
    that libraries that take "the current device" (NCCL, the host bridge's staging) agree.
    ``local_index`` defaults to ``LOCAL_RANK``."""
    if not registry.is_accelerator(family):
        return torch.device("cpu")
    from hetero.backends import get_backend

    backend = get_backend(registry.family(family).backend)
    index = int(os.environ.get("LOCAL_RANK", "0")) if local_index is None else local_index
    ok, detail = backend.detect()
    count = backend.device_count() if ok else 0
    if index >= count:
        seen = f"{count} visible" if ok else detail
        raise HeteroError(f"this rank computes on {family} device {index} but {backend.name} has {seen} "
                          f"({backend.visible_devices_env}={backend.visible_devices()!r})")
    backend.set_device(index)
    return backend.device(index)


def waiter(device: torch.device):
    """A callable that waits for ``device`` (for :func:`hetero.runtime.pipeline.timed`), None on the CPU."""
    return None if device.type == "cpu" else (lambda: synchronize(device))


def synchronize(device: torch.device) -> None:
    """Wait until every kernel queued on ``device`` has run (no-op on the CPU)."""
    if device.type == "cpu":
        return
    getattr(torch, device.type).synchronize(device)
