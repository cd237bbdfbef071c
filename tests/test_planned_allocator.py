"""The planned allocator: the cyclic arena plan, the C++ core served as c10's CPU allocator (a toy MoE
layer's varying expert sizes go to the fallback pool), and ``hetero launch --allocator planned``."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetero.memplan import fragmentation
from hetero.memplan.serve import place_cyclic, plan_step

from helpers import local_cluster, tiny_model

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ planning a recorded step


def test_a_block_live_across_the_step_boundary_keeps_its_range_over_both_pieces():
    # block 0 lives [3, 10) and, in the next step, [0, 2): block 1 ([0, 2)) cannot share its range,
    # block 2 ([4, 6)) cannot either, block 3 ([2, 3)) can
    offsets, arena = place_cyclic([1024, 512, 512, 1024], [[(3, 10), (0, 2)], [(0, 2)], [(4, 6)], [(2, 3)]])
    assert offsets[0] not in (offsets[1], offsets[2])
    assert offsets[3] == offsets[0]
    assert arena == 1024 + 512


def test_plan_step_aligns_the_steps_and_leaves_persistent_blocks_unplanned():
    A, F = "alloc", "free"
    log = [  # step 1: a gradient (id 0, freed in step 2), an activation, an optimizer moment (never freed)
        (1, A, 0, 4096, 0, 0), (1, A, 1, 1000, 0, 0), (1, F, 1, 1000, 0, 0), (1, A, 2, 4096, 1, 0),
        # step 2: frees step 1's gradient first, then allocates its own and an activation
        (2, F, 0, 4096, 0, 0), (2, A, 3, 4096, 0, 0), (2, A, 4, 1000, 0, 0), (2, F, 4, 1000, 0, 0)]
    p = plan_step(log, 1, 2)
    assert p.sizes == [4096, 1000] and p.phases == [0, 0]
    assert all(o >= 0 for o in p.offsets)            # the gradient wraps: [1, 4) and [0, 0]
    assert p.arena_bytes == 4096 + 1024
    # a block whose counterpart is never freed is left to the fallback pool
    log2 = [(1, A, 0, 4096, 0, 0), (2, A, 1, 4096, 0, 0)]
    assert plan_step(log2, 1, 2).offsets == [-1]


# ------------------------------------------------------------------ the allocator in a process


def _moe_worker(rank, world_size):
    import torch

    from hetero.memplan.serve import PlannedAllocator

    before = torch.randn(1000)   # made by the default allocator: freed by it after the install
    torch.manual_seed(0)

    class ToyMoE(torch.nn.Module):
        """Top-1 routing to 4 experts: how many tokens each expert gets changes every step."""

        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(32, 4)
            self.experts = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))

        def forward(self, x):
            choice = self.router(x).argmax(-1)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                idx = (choice == e).nonzero().flatten()
                out = out.index_add(0, idx, expert(x.index_select(0, idx)))
            return out + self.router(x).softmax(-1).sum(-1, keepdim=True)

    def train(alloc):
        torch.manual_seed(1)
        model = ToyMoE()
        opt = torch.optim.AdamW(model.parameters(), 1e-2)
        losses = []
        for step in range(1, 7):
            if alloc:
                alloc.begin_step(step)
            x = torch.randn(64, 32)
            opt.zero_grad(set_to_none=True)
            loss = model(x).pow(2).mean()
            loss.backward()
            if alloc:
                alloc.set_phase(1)
            opt.step()
            losses.append(loss.item())
            if alloc:
                alloc.end_step(step)
        return losses

    default = train(None)
    alloc = PlannedAllocator("cpu")
    assert alloc.install(), alloc.failure
    del before
    planned = train(alloc)
    kept = torch.ones(4096)   # served by the planned allocator, freed after it is uninstalled
    stats = alloc.stats()
    alloc.uninstall()
    after = torch.randn(10000).sum()   # the default allocator is back: allocate and free through it
    del kept
    return default, planned, stats, float(after)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_moe_layer_with_varying_expert_sizes_is_served_by_the_fallback_and_counted():
    from _spawn import spawn

    default, planned, stats, _ = spawn(_moe_worker, 1, timeout=220)[0]
    assert planned == default
    assert stats["kind"] == "planned" and stats["serving"]
    assert stats["planned_hits"] > 0
    assert stats["fallback_allocs"] > 0 and stats["fallback_bytes"] > 0
    assert stats["fallback_served_bytes"] > 0
    assert stats["reserved_bytes"] == stats["planned_bytes"] + stats["fallback_bytes"]


# ------------------------------------------------------------------ hetero launch --allocator planned

CLUSTER = local_cluster(devices=1)
GPT = tiny_model()
PLAN = {"global_batch_size": 8, "micro_batch_size": 2, "schedule": "1f1b", "recompute": "selective",
        "pipelines": [{"micro_batches": 4, "stages": [{"group": "fast", "layers": [0, 3]},
                                                      {"group": "slow", "layers": [3, 4]}]}]}


def launch(tmp_path: Path, allocator: str, steps: int = 5, plan: dict = PLAN, model: dict = GPT,
           cluster: dict = CLUSTER) -> dict:
    """Run ``hetero launch`` with ``--allocator`` and return its summary."""
    import yaml

    out = tmp_path / allocator
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, data in (("cluster", cluster), ("model", model), ("plan", plan)):
        files[name] = out / f"{name}.yaml"
        files[name].write_text(yaml.safe_dump(data))
    cmd = [sys.executable, "-m", "hetero", "launch", "--cluster", str(files["cluster"]), "--model",
           str(files["model"]), "--plan", str(files["plan"]), "--steps", str(steps), "--seed", "0", "--lr", "1e-2",
           "--summary", str(out / "summary.json"), "--timeout", "30", "--run-dir", str(out / "run"), "--quiet",
           "--allocator", allocator]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    summary["_elapsed_s"] = time.time() - t0
    return summary


def tight_cluster(kind_fits: str, kind_fails: str) -> dict:
    """CLUSTER with each group's memory between what the two allocators are predicted to reserve for
    its stage of PLAN, so that ``kind_fits`` fits and ``kind_fails`` does not."""
    import copy
    import math

    import hetero

    cluster, model, plan = hetero.load_cluster(CLUSTER), hetero.load_model(GPT), hetero.load_plan(PLAN)
    fits = hetero.predict(cluster, model, plan, allocator=kind_fits).pipelines[0].stages
    fails = hetero.predict(cluster, model, plan, allocator=kind_fails).pipelines[0].stages
    spec = copy.deepcopy(CLUSTER)
    for s_ok, s_bad in zip(fits, fails):
        assert s_ok.reserved_memory_bytes < s_bad.reserved_memory_bytes
        device = next(g["device"] for g in spec["groups"] if g["name"] == s_ok.group)
        spec["devices"][device]["memory"] = f"{int(math.sqrt(s_ok.reserved_memory_bytes * s_bad.reserved_memory_bytes))} B"
    return spec


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_1f1b_pipeline_with_selective_recompute_trains_identically_on_the_planned_arena(tmp_path):
    """Also the plan only the planned arena is predicted to fit: on devices with memory between the
    two allocators' predicted reservations, hetero predict --allocator caching rejects it, planned
    admits it, and the launch runs it."""
    import hetero

    tight = tight_cluster("planned", "caching")
    cluster, model, plan = hetero.load_cluster(tight), hetero.load_model(GPT), hetero.load_plan(PLAN)
    assert not hetero.predict(cluster, model, plan, allocator="caching").fits_memory
    assert hetero.predict(cluster, model, plan, allocator="planned").fits_memory
    caching = launch(tmp_path, "caching")
    planned = launch(tmp_path, "planned", cluster=tight)
    assert planned["losses"] == caching["losses"]
    assert all("allocator" not in r for r in caching["ranks"])
    for r in planned["ranks"]:
        a = r["allocator"]
        assert a["kind"] == "planned" and a["serving"], a
        for key in ("reserved_bytes", "peak_live_bytes", "planned_bytes", "fallback_bytes", "planned_hits",
                    "fallback_allocs"):
            assert isinstance(a[key], int), key
        mine = fragmentation(a["peak_live_bytes"], a["reserved_bytes"])
        replay = fragmentation(a["lower_bound_bytes"], a["caching_replay_reserved_bytes"])
        assert mine <= max(0.2 * replay, 0.02), (r["rank"], mine, replay)
        assert a["fallback_bytes"] <= 0.1 * a["reserved_bytes"], a


@pytest.mark.cuda
@pytest.mark.timeout(600)
def test_on_cuda_the_planned_arena_trains_the_tiny_model_with_less_fragmentation():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (benchmarks/gpu/planned_alloc_cuda.py measures the large models)")
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    from planned_alloc_cuda import run_child

    caching = run_child("caching", "tiny", "fp32", 4, None, 0)
    planned = run_child("planned", "tiny", "fp32", 4, None, 0)
    assert caching.get("result") == "ran" and planned.get("result") == "ran", (caching, planned)
    assert planned["kind"] == "planned" and planned["serving"]
    assert planned["fragmentation"] <= max(0.2 * caching["fragmentation"], 0.02), (planned, caching)
    assert planned["fallback_bytes"] <= 0.1 * planned["reserved_bytes"]


def test_where_the_library_cannot_be_built_the_rank_says_why_and_keeps_the_default(monkeypatch):
    import hetero.memplan.serve as serve

    def no_compiler(cuda=False):
        raise RuntimeError("cannot build the planned allocator (RuntimeError: Ninja is required to load C++ extensions)")

    monkeypatch.setattr(serve, "load_extension", no_compiler)
    alloc = serve.PlannedAllocator("cpu")
    assert not alloc.install() and not alloc.active
    assert "Ninja is required" in alloc.failure and "\n" not in alloc.failure
    alloc.begin_step(1)   # no-ops without the library
    alloc.end_step(2)
    serve.mark_phase(1)
    assert alloc.stats() == {"kind": "caching", "fallback_reason": alloc.failure}
