"""In-process resharding of ZeRO runs (zero_stage 1 and 2): at a pause every rank gathers its stage's
moments whole, the exchange is that of a zero_stage 0 run, and the rebuilt ZeRO optimizer keeps its
slices; checked bitwise against loading the same plan-independent checkpoint into the target plan."""
from __future__ import annotations

import threading

import pytest
import torch

from _spawn import spawn
from helpers import local_cluster, random_state_checkpoint

# an odd vocabulary: tp 2 splits the embedding unevenly, and no flat vector divides evenly
MODEL = {"name": "reshard-zero", "architecture": "gpt", "num_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
         "vocab_size": 509, "seq_length": 16, "dtype": "fp32", "tie_embeddings": True}


def _cluster(fast: int) -> dict:
    return local_cluster(devices=(fast, 0), slowdown=None, name="reshard-zero-test")


def _plan(pipelines, zero: int, gbs=12) -> dict:
    return {"global_batch_size": gbs, "micro_batch_size": 1, "zero_stage": zero, "pipelines": pipelines}


def _one_stage(replicas: int, tp: int = 1) -> list:
    return [{"replicas": replicas, "micro_batches": 12 // replicas, "stages": [{"group": "fast", "layers": [0, 4],
                                                                               "tp": tp}]}]


PP2 = [{"micro_batches": 12, "stages": [{"group": "fast", "layers": [0, 2]}, {"group": "fast", "layers": [2, 4]}]}]

# name, model dtype, processes, (cluster, plan) before, (cluster, plan) after: two ranks, processes 0 and 1
SCENARIOS = {
    "zero1 dp3 -> zero1 dp2": ("fp32", 3, (_cluster(3), _plan(_one_stage(3), 1)), (_cluster(2), _plan(_one_stage(2), 1))),
    "bf16 zero2 dp2 -> zero0 pp2": ("bf16", 2, (_cluster(2), _plan(_one_stage(2), 2)), (_cluster(2), _plan(PP2, 0))),
    "zero1 tp2 -> zero2 dp2": ("fp32", 2, (_cluster(2), _plan(_one_stage(1, tp=2), 1)),
                               (_cluster(2), _plan(_one_stage(2), 2))),
}


def _state(engine) -> dict[str, torch.Tensor]:
    """Every parameter, every tensor the optimizer updates (ZeRO: the slices' masters) and its AdamW
    state, as this rank holds them."""
    from hetero.runtime.grads import local_part

    out = {f"param {n}": local_part(p.detach()) for n, p in engine.module.named_parameters()}
    for i, p in enumerate(engine.optimizer.param_groups[0]["params"]):
        out[f"updated {i}"] = local_part(p.detach())
        for k, v in engine.optimizer.state.get(p, {}).items():
            out[f"updated {i} {k}"] = torch.as_tensor(local_part(v))
    return out


def _worker(rank, world, name, ckpt, port, run_dir):
    import hetero
    from hetero.runtime.launcher import prepare
    from hetero.runtime.options import RunOptions
    from hetero.runtime.elastic.reconfig import LiveReconfig
    from hetero.runtime.trainer import Trainer

    dtype, _, (c0, p0), (c1, p1) = SCENARIOS[name]
    model = hetero.load_model({**MODEL, "dtype": dtype})

    def spec(cluster, plan, where):
        opts = RunOptions(load=ckpt, run_dir=f"{run_dir}/{where}{rank}", overlap=False, timeout_s=60.0)
        return prepare(hetero.load_cluster(cluster), model, hetero.load_plan(plan), opts,
                       run_dir=opts.run_dir).spec

    live = LiveReconfig(port, rank, world, timeout_s=60.0)
    live.first_world()
    trainer = Trainer(spec(c0, p0, "old"), rank)
    assert trainer.engine.sharded is not None and trainer.step == 3
    live.watch(trainer)
    if not live.pause(trainer):   # the coordinator's decision: the new plan leaves this rank out
        return None
    ref = Trainer(spec(c1, p1, "ref"), trainer.rank)   # the checkpoint loaded into the target plan
    got, want = _state(trainer.engine), _state(ref.engine)
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    bad = [k for k in want if not (got[k].shape == want[k].shape and got[k].dtype == want[k].dtype
                                   and torch.equal(got[k], want[k]))]
    return {"bad": bad, "compared": len(want), "steps": sum(1 for k in want if k.endswith(" step")),
            "zero": trainer.ctx.plan.zero_stage, "sharded": trainer.engine.sharded is not None,
            "step": trainer.step}


def _coordinate(coordinator, name: str, world: int) -> None:
    from hetero.runtime.reshard.live import decision_for

    dtype, _, old, new = SCENARIOS[name]
    got = coordinator.await_survivors(1, list(range(world)), timeout_s=120)
    coordinator.publish(1, {0: 0, 1: 1}, decision_for({**MODEL, "dtype": dtype}, old, new, sorted(got), step=3))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_paused_zero_run_reshards_in_process_to_what_the_checkpoint_loads(tmp_path, name):
    from hetero.runtime.reshard.live import Coordinator

    dtype, world, _, (_, new) = SCENARIOS[name]
    ckpt = str(tmp_path / "ckpt")
    random_state_checkpoint(ckpt, {**MODEL, "dtype": dtype})
    coordinator = Coordinator()
    threading.Thread(target=_coordinate, args=(coordinator, name, world), daemon=True).start()
    try:
        results = spawn(_worker, world, args=(name, ckpt, coordinator.port, str(tmp_path / "run")), timeout=100)
    finally:
        coordinator.close()
    members = [r for r in results if r is not None]
    assert len(members) == 2 and results[2:] == [None] * (world - 2), results
    for r in members:
        assert r["bad"] == [], (name, r["bad"])
        assert r["step"] == 3 and r["zero"] == new["zero_stage"] and r["sharded"] == (new["zero_stage"] > 0)
        assert r["steps"] > 0 and r["compared"] > 2 * 20   # the AdamW state was there to compare


@pytest.mark.parametrize("with_checkpoint", [True, False], ids=["--save checkpoint", "none"])
def test_after_a_lost_zero_rank_every_region_comes_from_the_checkpoint(tmp_path, capsys, with_checkpoint):
    """A lost ZeRO rank's optimizer slices have no copy, so the survivor serves nothing (it could not
    gather its moments without the lost rank) and its whole state comes from the checkpoint."""
    import torch.distributed as dist

    import hetero
    from hetero.runtime.reshard import live as L
    from hetero.runtime.reshard.space import ParameterSpace

    ckpt = str(tmp_path / "ckpt")
    random_state_checkpoint(ckpt, MODEL)
    old, new = (_cluster(2), _plan(_one_stage(2), 1)), (_cluster(1), _plan(_one_stage(1), 1))
    coordinator = L.Coordinator()
    try:
        store = L.connect(coordinator.port)
        L.regroup(store, 0, 0, 1, 20)
        coordinator.publish(1, {0: 0}, L.decision_for(MODEL, old, new, [0], step=5, lost_slices=True,
                                                      checkpoint=ckpt if with_checkpoint else None))
        if not with_checkpoint:   # (the launcher ends the run before: tests/test_elastic.py)
            with pytest.raises(L.ReconfigurationError, match="zero_stage 1: the lost rank's optimizer slices have "
                                                             "no copy: the live state cannot be rebuilt .fix: run with --save, or a plan "
                                                             "with zero_stage: 0"):
                L.reconfigure(store, 1, 0, {}, timeout_s=20)
            return
        place = L.reconfigure(store, 1, 0, {}, timeout_s=20)
        assert place.fallback == ckpt and place.step == 3 and place.stats.bytes_received == 0
        assert "optimizer slices have no copy" in capsys.readouterr().out
        want = ParameterSpace(hetero.load_model(MODEL)).shapes
        assert sorted(place.state) == sorted(want)
        assert all(place.state[n].tensors["exp_avg"].shape == want[n] and float(place.state[n].step) == 3.0
                   for n in want)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        coordinator.close()
