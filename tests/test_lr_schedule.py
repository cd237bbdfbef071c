"""The learning-rate schedule (hetero.runtime.lr_schedule): warm-up, constant / cosine / linear decay to
min_lr at the last step; its options checked like the others; a launch applies and reports it, and a
run resumed with --load continues it from the checkpoint's step."""
from __future__ import annotations

import math

import pytest

from helpers import GPT, LR, launch as _launch
from helpers import plan_dict as _plan

ONE_PROCESS = _plan([{"micro_batches": 2, "stages": [{"group": "fast", "layers": [0, 4]}]}], gbs=4)


def test_warmup_ramps_linearly_from_zero_to_lr():
    from hetero.runtime.lr_schedule import lr_at

    for schedule in ("constant", "cosine", "linear"):
        got = [lr_at(t, 10, 0.1, schedule, 4, 0.01) for t in range(4)]
        assert got == pytest.approx([0.025, 0.05, 0.075, 0.1]), schedule
    assert [lr_at(t, 6, 0.1, "constant", 2) for t in range(6)] == pytest.approx([0.05, 0.1, 0.1, 0.1, 0.1, 0.1])


def test_cosine_and_linear_decay_from_lr_to_min_lr_at_the_last_step():
    from hetero.runtime.lr_schedule import lr_at

    T, W, top, low = 12, 2, 0.1, 0.01
    cos = [lr_at(t, T, top, "cosine", W, low) for t in range(T)]
    lin = [lr_at(t, T, top, "linear", W, low) for t in range(T)]
    for values in (cos, lin):
        assert values[W] == pytest.approx(top) and values[-1] == pytest.approx(low)
        assert all(a > b for a, b in zip(values[W:], values[W + 1:]))   # falls every step after the warm-up
    # linear: equal steps; cosine: half way (p = 1/2) at the mean of lr and min_lr
    assert [a - b for a, b in zip(lin[W:], lin[W + 1:])] == pytest.approx([(top - low) / (T - W - 1)] * (T - W - 1))
    assert lr_at(6, 11, top, "cosine", 2, low) == pytest.approx((top + low) / 2)
    assert lr_at(4, 11, top, "cosine", 2, low) == pytest.approx(low + (top - low) * (1 + math.cos(math.pi * 2 / 8)) / 2)
    assert lr_at(0, 1, top, "cosine", 0, low) == pytest.approx(low)   # a one-step decay is its last step


def test_bad_schedule_options_are_named_with_their_fix(capsys):
    from hetero.cli import main
    from hetero.runtime.options import OptionsError, RunOptions

    with pytest.raises(OptionsError) as e:
        RunOptions(lr_schedule="step", warmup_steps=-1, min_lr=float("nan"))
    assert {p.path for p in e.value.problems} == {"lr_schedule", "warmup_steps", "min_lr"}
    assert "one of constant, cosine, linear" in str(e.value)
    with pytest.raises(OptionsError, match=r"min_lr=0.5: above lr 0.1: the decay would raise the rate"):
        RunOptions(lr=0.1, lr_schedule="cosine", min_lr=0.5)
    with pytest.raises(OptionsError, match=r"min_lr=0.01: set with the constant schedule"):
        RunOptions(lr=0.1, min_lr=0.01)
    RunOptions(lr=0.1, lr_schedule="linear", warmup_steps=3, min_lr=0.1)   # a floor equal to lr: in range
    from conftest import CONFIGS

    files = [str(CONFIGS / "clusters" / "local-cpu.yaml"), str(CONFIGS / "models" / "tiny.yaml"),
             str(CONFIGS / "plans" / "local-cpu-tiny.yaml")]
    rc = main(["launch", "--cluster", files[0], "--model", files[1], "--plan", files[2], "--dry-run",
               "--lr", "0.1", "--lr-schedule", "cosine", "--warmup-steps", "-2", "--min-lr", "0.2"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    assert "error: --warmup-steps -2: out of range (fix: give a number of steps >= 0" in err
    assert "error: --min-lr 0.2: above lr 0.1" in err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_launch_applies_the_schedule_and_a_resumed_run_continues_it(tmp_path):
    """One process: the summary's lrs are the schedule's, and the losses are the single-device reference's
    under that schedule (not the constant rate's); --load of a 3-step checkpoint with --steps 2 runs steps
    4 and 5 of a 5-step schedule."""
    from hetero.runtime.lr_schedule import lr_at
    from hetero.runtime.reference import reference_losses

    flags = ("--lr-schedule", "cosine", "--warmup-steps", "2", "--min-lr", str(LR / 10))
    for run in "abc":
        (tmp_path / run).mkdir()
    summary, _ = _launch(tmp_path / "a", GPT, ONE_PROCESS, *flags)
    want = [lr_at(t, 5, LR, "cosine", 2, LR / 10) for t in range(5)]
    assert summary["lrs"] == pytest.approx(want) and summary["lrs"][-1] == pytest.approx(LR / 10)
    scheduled = reference_losses(GPT, 0, 5, 4, lr=LR, lr_schedule="cosine", warmup_steps=2, min_lr=LR / 10)
    constant = reference_losses(GPT, 0, 5, 4, lr=LR)
    assert summary["losses"] == pytest.approx(scheduled, rel=1e-3)
    assert summary["losses"][1:] != pytest.approx(constant[1:], rel=1e-3)   # the schedule changed the updates
    ckpt = tmp_path / "ckpt"
    _launch(tmp_path / "b", GPT, ONE_PROCESS, *flags, "--steps", "3", "--save", str(ckpt))
    resumed, _ = _launch(tmp_path / "c", GPT, ONE_PROCESS, *flags, "--steps", "2", "--load", str(ckpt))
    assert resumed["lrs"] == pytest.approx([lr_at(t, 5, LR, "cosine", 2, LR / 10) for t in (3, 4)])
