"""Vendor backends: detection, selection (HETERO_BACKEND, probing, CPU fallback), env report."""
from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib

import pytest

import hetero.backends as hb
from hetero.backends import ascend as ascend_mod

pytestmark = pytest.mark.timeout(60)


def _no_accelerators(monkeypatch):
    for cls in (hb.CudaBackend, hb.RocmBackend, hb.AscendBackend):
        monkeypatch.setattr(cls, "detect", lambda self, n=cls.name: (False, f"{n} absent (test)"))


def test_interface_fields():
    expect = {
        "cuda": ("cuda", "nccl", "CUDA_VISIBLE_DEVICES"),
        "rocm": ("cuda", "nccl", "HIP_VISIBLE_DEVICES"),
        "ascend": ("npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES"),
        "cpu": ("cpu", "gloo", None),
        "mpi": ("cpu", "mpi", None),
    }
    for name, (dev, dist_backend, env) in expect.items():
        b = hb.get_backend(name)
        assert isinstance(b, hb.Backend) and b.name == name
        assert (b.device_type, b.dist_backend, b.visible_devices_env) == (dev, dist_backend, env)
        ok, detail = b.detect()
        assert isinstance(ok, bool) and isinstance(detail, str) and detail
    cpu = hb.get_backend("cpu")
    import torch

    assert cpu.device(3) == torch.device("cpu")
    mem = cpu.memory_info()
    assert mem is not None and mem.total > 0 and (mem.free is None or 0 < mem.free <= mem.total)
    assert hb.get_backend("nvidia").name == "cuda" and hb.get_backend("gloo").name == "cpu"
    with pytest.raises(ValueError, match="did you mean"):
        hb.get_backend("cdua")


def test_override_wins(monkeypatch):
    _no_accelerators(monkeypatch)
    assert hb.select_backend({"HETERO_BACKEND": "cpu"}).name == "cpu"
    monkeypatch.setattr(hb.CudaBackend, "detect", lambda self: (True, "CUDA 12.4 (test)"))
    assert hb.select_backend({}).name == "cuda"  # probing finds the (pretend) CUDA build
    assert hb.select_backend({"HETERO_BACKEND": "cpu"}).name == "cpu"  # the override still wins
    with pytest.raises(RuntimeError, match="HETERO_BACKEND=rocm.*rocm absent"):
        hb.select_backend({"HETERO_BACKEND": "rocm"})
    with pytest.raises(ValueError, match="bridge"):
        hb.select_backend({"HETERO_BACKEND": "mpi"})


def test_probe_order(monkeypatch):
    _no_accelerators(monkeypatch)
    monkeypatch.setattr(hb.RocmBackend, "detect", lambda self: (True, "HIP 6.2 (test)"))
    monkeypatch.setattr(hb.CudaBackend, "detect", lambda self: (True, "CUDA (test)"))
    assert hb.select_backend({}).name == "rocm"
    monkeypatch.setattr(hb.AscendBackend, "detect", lambda self: (True, "torch_npu (test)"))
    assert hb.select_backend({}).name == "ascend"


def test_cpu_fallback_warns(monkeypatch):
    _no_accelerators(monkeypatch)
    with pytest.warns(hb.BackendFallbackWarning, match="falling back to CPU"):
        b = hb.select_backend({})
    assert b.name == "cpu" and b.dist_backend == "gloo"


def test_ascend_reasons(monkeypatch):
    real_find_spec = importlib.util.find_spec
    if real_find_spec("torch_npu") is None:
        ok, reason = hb.AscendBackend().detect()
        assert not ok and reason == "torch_npu not installed"
    # torch_npu present but CANN missing: the reason names libhccl.so (torch_npu is never imported)
    monkeypatch.setattr(ascend_mod.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "torch_npu" else real_find_spec(name, *a))
    monkeypatch.setattr(ascend_mod, "_find_libhccl", lambda: None)
    monkeypatch.setattr(ascend_mod, "_torch_npu_version", lambda: "2.5.1")
    monkeypatch.setattr(hb.AscendBackend, "_torch_npu", staticmethod(lambda: pytest.fail("imported torch_npu")))
    ok, reason = hb.AscendBackend().detect()
    assert not ok
    assert "torch_npu 2.5.1 installed but the CANN runtime is missing: libhccl.so not found" in reason


def test_env_report_and_cli(capsys):
    rows = hb.env_report()
    comps = [r.component for r in rows]
    for needed in ("torch", "CUDA (NCCL)", "ROCm (RCCL)", "torch_npu/CANN (HCCL)", "MPI (mpi4py)", "Gloo",
                   "DeepSpeed"):
        assert needed in comps
    assert all(r.status in ("found", "missing") and r.detail for r in rows)
    assert dict((r.component, r.status) for r in rows)["torch"] == "found"
    assert dict((r.component, r.status) for r in rows)["Gloo"] == "found"

    from hetero.cli import env

    parser = argparse.ArgumentParser(prog="hetero")
    env.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["env", "--json"])
    assert args.func(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["component"] for d in data] == comps
    args = parser.parse_args(["env"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "Gloo" in out and "DeepSpeed" in out


# --- the vendor registry: one table that the backends, specs, launcher, runtime and communicator ask ---

def test_registry_resolves_every_catalog_vendor():
    from hetero.backends import registry
    from hetero.specs.device import VENDORS, load_catalog

    catalog = load_catalog()
    assert {d.vendor for d in catalog.values()} >= {"nvidia", "amd", "ascend", "cpu"}
    for name, device in catalog.items():
        info = registry.vendor(device.vendor)
        assert info is not None and info.name == device.family, name
    assert VENDORS == registry.family_names()   # the spec checks' list is the registry's, not a copy
    # what the launcher sets per node slot, and what the communicator uses per vendor tag
    assert [registry.visible_devices_env(f) for f in ("nvidia", "amd", "ascend", "intel", "cpu", "emu-a")] == [
        "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", None, None, None]
    assert [registry.library_of(t) for t in ("NVIDIA", "rocm", "rccl", "npu", "cpu", "intel", "emu-a")] == [
        "nccl", "nccl", "nccl", "hccl", "gloo", "gloo", "gloo"]
    assert [registry.device_type_of_library(lib) for lib in ("nccl", "hccl", "gloo", "hetero_emu_a")] == [
        "cuda", "npu", "cpu", "cpu"]
    assert [f for f in VENDORS if registry.is_accelerator(f)] == ["nvidia", "amd", "ascend"]


def test_backends_and_layers_read_the_registry():
    from hetero.backends import registry
    from hetero.comm import vendors as comm_vendors
    from hetero.runtime import device, launcher

    for info in registry.VENDORS:
        if info.backend is None:
            with pytest.raises(ValueError, match="unknown backend"):
                hb.get_backend(info.name)
            continue
        b = hb.get_backend(info.name)
        assert b.name == info.backend
        assert (b.device_type, b.dist_backend, b.visible_devices_env, b.library) == (
            info.device_type, info.library, info.visible_devices_env, info.library_label)
        for alias in info.aliases:
            assert hb.get_backend(alias.upper()).name == info.backend
        assert device.torch_device_type(info.name) == info.device_type
    # the tables these layers kept before are gone, not copies to keep in step
    assert not hasattr(launcher, "VISIBLE_DEVICES") and not hasattr(device, "ACCELERATOR_FAMILIES")
    assert not hasattr(comm_vendors, "DEVICE_OF_BACKEND") and not hasattr(comm_vendors, "KNOWN")
    assert importlib.util.find_spec("hetero.specs.vendors") is None
    assert comm_vendors.backend_for("amd") == "nccl" and comm_vendors.device_type_for("hccl") == "npu"


def test_the_predictor_charges_each_vendors_framework_overhead_from_the_registry(monkeypatch):
    """A device's memory outside the model's tensors is a vendor fact: the registry holds it, and
    the predictor's stage memory reads it there (a changed figure moves the prediction)."""
    import dataclasses

    from hetero.backends import registry
    from hetero.predictor import memory

    assert registry.framework_overhead("ascend") == 2**30 and registry.framework_overhead("cpu") == 0
    assert registry.framework_overhead("emu-b") == registry.framework_overhead("other") == 512 * 2**20
    assert memory.FRAMEWORK_OVERHEAD == {v.name: v.framework_overhead_bytes for v in registry.VENDORS}
    import hetero

    model = hetero.load_model(pathlib.Path(__file__).resolve().parents[1] / "configs" / "models" / "tiny.yaml")
    before = memory.stage_memory(model, "nvidia", 1, 1, 2, "none", 0, 1, 1, True, True)
    monkeypatch.setitem(registry._FAMILY, "nvidia",
                        dataclasses.replace(registry.family("nvidia"), framework_overhead_bytes=7 * 2**20))
    after = memory.stage_memory(model, "nvidia", 1, 1, 2, "none", 0, 1, 1, True, True)
    assert (before.overhead, after.overhead) == (512 * 2**20, 7 * 2**20)


def test_registry_is_torch_free():
    import subprocess
    import sys

    code = ("import sys, hetero.backends.registry, hetero.specs.plan; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
