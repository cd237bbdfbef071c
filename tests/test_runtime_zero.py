"""ZeRO-1 in the native engine (hetero.runtime.zero): AdamW state sharded over holder sets.

Each launch is checked against the single-device reference (losses and gradient norms), and each
rank's measured AdamW state against the predictor's ZeRO accounting of its stage."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_runtime import GPT, STEPS, _assert_matches, _launch, _plan, _reference, _write  # noqa: E402

import test_runtime  # noqa: E402

# Pipelines of different shapes: stage boundaries staggered ([0,1) [1,4) vs [0,2) [2,4)), so the
# holder sets chain across pipelines, and a tp2 stage beside an unsplit one (tp ranks keep a copy
# of their slice of the full tensors).
PLANS = {
    "staggered": [{"micro_batches": 2, "stages": [{"group": "fast", "layers": [0, 1]},
                                                  {"group": "fast", "layers": [1, 4]}]},
                  {"micro_batches": 2, "stages": [{"group": "slow", "layers": [0, 2]},
                                                  {"group": "slow", "layers": [2, 4]}]}],
    "tp2_beside_tp1": [{"micro_batches": 1, "stages": [{"group": "fast", "tp": 2, "layers": [0, 4]}]},
                       {"micro_batches": 3, "stages": [{"group": "slow", "layers": [0, 4]}]}],
}


def _predicted_optimizer_bytes(tmp_path, plan: dict) -> dict[tuple[int, int], float]:
    import hetero

    p = hetero.predict(hetero.load_cluster(_write(tmp_path, "pc.yaml", test_runtime.CLUSTER)),
                       hetero.load_model(_write(tmp_path, "pm.yaml", GPT)),
                       hetero.load_plan(_write(tmp_path, "pp.yaml", plan)))
    return {(pi, si): s.memory_breakdown.optimizer for pi, pp in enumerate(p.pipelines)
            for si, s in enumerate(pp.stages)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape,communicator", [("staggered", "hetero"), ("staggered", "torch"),
                                                ("tp2_beside_tp1", "hetero")])
def test_zero1_matches_the_reference_with_the_predicted_share_of_adamw_state(tmp_path, monkeypatch, shape,
                                                                            communicator):
    """hetero.comm (vendor groups, host bridge) and plain torch.distributed carry the reduce-scatter
    and all-gather alike."""
    monkeypatch.setenv("HETERO_RUNTIME_COMM", communicator)
    plan = _plan(PLANS[shape], zero_stage=1)
    summary, _ = _launch(tmp_path, GPT, plan)
    _assert_matches(summary, GPT)
    assert summary["communicator"] == {"hetero": "hetero.comm", "torch": "torch.distributed"}[communicator]
    predicted = _predicted_optimizer_bytes(tmp_path, plan)
    unsharded = _predicted_optimizer_bytes(tmp_path, {**plan, "zero_stage": 0})
    for r in summary["ranks"]:
        key = (r["pipeline"], r["stage"])
        measured = r["optimizer_state_bytes"]
        # the predictor's count plus AdamW's 4-byte step counter per optimized tensor
        assert measured == pytest.approx(predicted[key], rel=1e-3), (r, predicted[key])
        if r["tp_size"] == 1:   # every parameter has 3 or more holders: at most 1/2 of the state remains
            assert measured < 0.55 * unsharded[key], (r, unsharded[key])
        else:   # 12 bytes (moments + the slice's copy) over 3 holders: what 8 bytes over tp 2 took
            assert measured <= unsharded[key] * 1.001, (r, unsharded[key])


@pytest.mark.timeout(300)
def test_a_zero1_checkpoint_resumes_under_other_plans_with_or_without_zero(tmp_path):
    """Saved sharded (tp2 beside tp1), the full AdamW states are gathered into the plan-independent
    checkpoint; resumed sharded over other holder sets, and unsharded, both continue the reference."""
    ckpt = str(tmp_path / "ckpt")
    runs = {}
    old = test_runtime.STEPS
    try:
        for name, steps, plan, extra in (
                ("save", 2, _plan(PLANS["tp2_beside_tp1"], zero_stage=1), ("--save", ckpt)),
                ("zero", 3, _plan(PLANS["staggered"], zero_stage=1), ("--load", ckpt)),
                ("plain", 3, _plan(PLANS["staggered"]), ("--load", ckpt))):
            (tmp_path / name).mkdir()
            test_runtime.STEPS = steps
            runs[name], _ = _launch(tmp_path / name, GPT, plan, *extra)
    finally:
        test_runtime.STEPS = old
    losses, _ = _reference(GPT)
    assert len(losses) == STEPS == 5
    assert runs["save"]["losses"] + runs["zero"]["losses"] == pytest.approx(losses, rel=1e-3)
    assert runs["save"]["losses"] + runs["plain"]["losses"] == pytest.approx(losses, rel=1e-3)
