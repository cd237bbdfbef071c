"""``hetero rl`` learns from its reward, and only from it: the fast variant of the RL example
(configs/rl/fast, docs/rl.md) on the emulated two-vendor cluster, disaggregated (the actor trains on
``fast``, vendor emu-a; two rollout copies generate on ``slow``, emu-b; the weights cross vendors
after every step).

From random initialisation, 20 GRPO steps of 8 prompts x 8 completions with the reward "share of the
completion's characters that are digits" (the first thing the sums' answers need) take the held-out
greedy completions of the 80 eval.jsonl prompts from mostly non-digits to digits. The same job with a
reward that ignores the completion (the control) must not: its saved actor's greedy completions,
from ``hetero generate``, are scored with the same reward. Measured, seeds 0 / 1 / 2 (start -> end):
0.066 / 0.256 / 0.169 -> 1.000 / 1.000 / 1.000, control 0.000 / 0.000 / 0.000; the test runs seed 0
and asks for a gain of at least :data:`MARGIN` in one and less than that in the other.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from _spawn import run_launcher
from helpers.launching import ROOT
from helpers.processes import assert_no_leftover

FAST = ROOT / "configs" / "rl" / "fast"
CLUSTER = ROOT / "configs" / "clusters" / "local-cpu.yaml"
EVAL = ROOT / "configs" / "rl" / "eval.jsonl"
MARGIN = 0.5   # of the digit share of greedy completions, which lies in [0, 1]


def _digits():
    spec = importlib.util.spec_from_file_location("rl_example_rewards", ROOT / "configs" / "rl" / "rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.digits


def _hetero(tmp_path: Path, *args: str, timeout: float = 150) -> str:
    """Run ``hetero ARGS``; its run directories go under ``tmp_path/runs`` (TMPDIR), so a timeout ends
    every process naming them and the test checks none is left."""
    runs = tmp_path / "runs"
    runs.mkdir(exist_ok=True)
    proc = run_launcher([sys.executable, "-m", "hetero", *args], timeout, marker=str(runs), cwd=ROOT,
                        env={**os.environ, "TMPDIR": str(runs)})
    assert_no_leftover(runs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _greedy_digit_share(tmp_path: Path, checkpoint: Path) -> float:
    """The digits reward of the checkpoint's greedy completions of eval.jsonl, each cut after its
    first newline (the job's stop string), as the run's own evaluation scores them."""
    out = _hetero(tmp_path, "generate", "--model", str(ROOT / "configs" / "rl" / "model.yaml"), "--load",
                  str(checkpoint), "--prompts", str(EVAL), "--max-new-tokens", "4", "--json", timeout=60)
    digits = _digits()
    texts = [c["completion"] for c in json.loads(out)["completions"]]
    assert len(texts) == sum(1 for line in EVAL.read_text().splitlines() if line.strip())
    return sum(digits("", t.split("\n")[0] + "\n" if "\n" in t else t, "") for t in texts) / len(texts)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_grpo_learns_from_the_reward_and_not_from_a_random_one(tmp_path):
    learned = tmp_path / "learned.json"
    _hetero(tmp_path, "rl", str(FAST / "grpo-digits.yaml"), "--cluster", str(CLUSTER), "--summary", str(learned),
            "--quiet")
    summary = json.loads(learned.read_text())
    assert summary["placement"]["mode"] == "disaggregated"
    assert summary["weight_sync"]["checksums_match"] is True
    start, end = summary["eval"]["before"]["reward_mean"], summary["eval"]["after"]["reward_mean"]
    assert end - start >= MARGIN, f"the digits reward did not teach: held-out greedy {start:.3f} -> {end:.3f}"

    control = tmp_path / "control-ckpt"
    _hetero(tmp_path, "rl", str(FAST / "grpo-random-reward.yaml"), "--cluster", str(CLUSTER), "--save", str(control),
            "--quiet")
    # the same seed and model: the control starts from the weights the learned run started from
    after_control = _greedy_digit_share(tmp_path, control)
    assert after_control - start < MARGIN, (
        f"a reward that ignores the completion taught digits: held-out greedy {start:.3f} -> {after_control:.3f}")
