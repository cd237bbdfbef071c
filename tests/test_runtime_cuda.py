"""The native engine on a CUDA GPU: a GPU group's stage, activations, gradients and AdamW state live
on the device, and it meets CPU ranks of another vendor through the host bridge (hetero.comm) or
host-staged Gloo (plain torch.distributed). Every run is checked against the single-device CPU
reference, as the CPU-only runtime tests are.

Skipped where torch sees no CUDA device (CI has none). Run on a machine with one:
    python -m pytest tests/test_runtime_cuda.py
One GPU is enough except for the tensor-parallel test, which needs two (NCCL runs one rank per GPU).
"""
from __future__ import annotations

import pytest
import torch

from helpers import GPT, RTOL, STEPS, cluster_dict, emulated_device, group_dict
from helpers import assert_matches_reference as _assert_matches, launch as _launch, plan_dict as _plan
from helpers import reference as _reference

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: torch sees none here (these runs check the native "
                                       "engine's device placement; CPU-only runs are in test_runtime.py)")]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CLUSTER = cluster_dict(group_dict("gpu", "H100-SXM5-80GB", 1, max(1, min(GPUS, 2))),
                       group_dict("cpu", "cpu-emu-a", 1, 2), name="gpu-and-cpu",
                       devices={"cpu-emu-a": emulated_device("emu-a")})


def _devices(summary: dict) -> list[str]:
    """Each rank's device, in pipeline order (pipeline, replica, stage)."""
    ranks = sorted(summary["ranks"], key=lambda r: (r["pipeline"], r["replica"], r["stage"], r["tp_rank"]))
    return [r["device"] for r in ranks]


@pytest.mark.timeout(240)
def test_one_stage_on_the_gpu_matches_the_cpu_reference(tmp_path):
    plan = _plan([{"micro_batches": 4, "stages": [{"group": "gpu", "layers": [0, 4]}]}])
    summary, _ = _launch(tmp_path, GPT, plan, cluster=CLUSTER, timeout=200)
    assert _devices(summary) == ["cuda"]
    _assert_matches(summary, GPT)
    # timed with the device waited for: a forward of a real model is not the microseconds of queuing it
    assert summary["ranks"][0]["forward_time_s"] > 20e-6


@pytest.mark.timeout(240)
@pytest.mark.parametrize("communicator", ["hetero", "torch"])
def test_a_gpu_stage_hands_off_to_a_cpu_stage_of_another_vendor(tmp_path, monkeypatch, communicator):
    """Activations leave the GPU and gradients come back to it through host memory."""
    monkeypatch.setenv("HETERO_RUNTIME_COMM", communicator)
    plan = _plan([{"micro_batches": 4, "stages": [{"group": "gpu", "layers": [0, 3]},
                                                   {"group": "cpu", "layers": [3, 4]}]}], schedule="1f1b")
    summary, _ = _launch(tmp_path, GPT, plan, cluster=CLUSTER, timeout=200)
    assert _devices(summary) == ["cuda", "cpu"]
    assert summary["communicator"] == ("hetero.comm" if communicator == "hetero" else "torch.distributed")
    _assert_matches(summary, GPT)


@pytest.mark.timeout(240)
def test_a_gpu_pipeline_and_a_cpu_pipeline_of_another_shape_sum_their_gradients(tmp_path):
    """Data parallelism across vendors and pipeline shapes: the GPU rank's gradient buckets are
    all-reduced with CPU ranks through the hierarchical (host-staged) path."""
    plan = _plan([{"micro_batches": 2, "stages": [{"group": "gpu", "layers": [0, 4]}]},
                  {"micro_batches": 2, "stages": [{"group": "cpu", "layers": [0, 2]},
                                                  {"group": "cpu", "layers": [2, 4]}]}])
    summary, _ = _launch(tmp_path, GPT, plan, cluster=CLUSTER, timeout=200)
    assert _devices(summary) == ["cuda", "cpu", "cpu"]
    _assert_matches(summary, GPT)


@pytest.mark.timeout(300)
def test_a_checkpoint_saved_from_the_gpu_resumes_on_the_cpu(tmp_path):
    """Checkpoints hold host tensors: one written by a GPU rank loads into a CPU plan (and the
    AdamW state follows its parameter's device), continuing the reference's losses."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    ckpt = str(tmp_path / "ckpt")
    on_gpu = _plan([{"micro_batches": 4, "stages": [{"group": "gpu", "layers": [0, 2]},
                                                     {"group": "cpu", "layers": [2, 4]}]}])
    on_cpu = _plan([{"micro_batches": 4, "stages": [{"group": "cpu", "layers": [0, 3]},
                                                     {"group": "gpu", "layers": [3, 4]}]}])
    losses, _ = _reference(GPT)
    first, _ = _launch(a, GPT, on_gpu, "--steps", "2", "--save", ckpt, cluster=CLUSTER, timeout=200)
    second, _ = _launch(b, GPT, on_cpu, "--steps", str(STEPS - 2), "--load", ckpt,
                        cluster=CLUSTER, timeout=200)
    assert _devices(first) == ["cuda", "cpu"] and _devices(second) == ["cpu", "cuda"]
    assert first["losses"] + second["losses"] == pytest.approx(losses, rel=RTOL)


@pytest.mark.timeout(240)
def test_bf16_autocast_runs_on_the_gpu(tmp_path):
    """bf16 under CUDA autocast: the fp32 reference's training to within bf16's precision, and not
    bit-for-bit fp32's (which would mean autocast never took effect on the device)."""
    model = {**GPT, "name": "tiny-bf16", "dtype": "bf16"}
    plan = _plan([{"micro_batches": 4, "stages": [{"group": "gpu", "layers": [0, 4]}]}])
    summary, _ = _launch(tmp_path, model, plan, cluster=CLUSTER, timeout=200)
    assert _devices(summary) == ["cuda"]
    losses, _ = _reference(GPT)
    assert summary["losses"] == pytest.approx(losses, rel=0.03), (summary["losses"], losses)
    assert max(abs(a / b - 1) for a, b in zip(summary["losses"], losses)) > 1e-4, (summary["losses"], losses)


@pytest.mark.timeout(240)
@pytest.mark.skipif(GPUS < 2, reason="tensor parallelism over NCCL needs two GPUs (one rank per GPU); "
                                     f"this machine has {GPUS}")
def test_tp2_on_two_gpus_matches_the_reference(tmp_path):
    plan = _plan([{"micro_batches": 4, "stages": [{"group": "gpu", "tp": 2, "layers": [0, 3]},
                                                   {"group": "cpu", "layers": [3, 4]}]}])
    summary, _ = _launch(tmp_path, GPT, plan, cluster=CLUSTER, timeout=200)
    assert _devices(summary) == ["cuda", "cuda", "cpu"]
    _assert_matches(summary, GPT)

