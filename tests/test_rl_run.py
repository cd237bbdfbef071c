"""The multi-process RL run (hetero.rl.run.run_rl) on the emulated two-vendor cluster: placement does
not change what is learned, and every weight sync lands bit for bit across vendors.

The job is tiny (a 2-layer byte-level Llama, 2 prompts x 4 completions a step, 2 steps) with a reward
that varies between completions (the parity of the completion's bytes), so advantages, losses and the
second step's weights are not trivially zero, and a learning rate large enough that step 2's samples
depend on step 1's update.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from _spawn import run_launcher
from helpers.launching import ROOT, write_yaml
from helpers.processes import assert_no_leftover

CLUSTER = str(ROOT / "configs" / "clusters" / "local-cpu.yaml")
MODEL = {"name": "rl-tiny", "architecture": "llama", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
         "num_kv_heads": 2, "vocab_size": 256, "seq_length": 16, "dtype": "fp32"}
PP2 = {"global_batch_size": 8, "micro_batch_size": 2, "schedule": "1f1b",
       "pipelines": [{"micro_batches": 4, "stages": [{"group": "fast", "layers": [0, 1]},
                                                      {"group": "fast", "layers": [1, 2]}]}]}
TP2 = {"global_batch_size": 8, "micro_batch_size": 4,
       "pipelines": [{"micro_batches": 2, "stages": [{"group": "fast", "tp": 2, "layers": [0, 2]}]}]}
REWARD = '''
def parity(prompt, completion, answer):
    return float(sum(completion.encode()) % 2)
'''
DRIVER = """
import json, sys, types
import hetero
from hetero.rl.job import load_rl_job
from hetero.rl.run import run_rl
job_path, run_dir, out = sys.argv[1:4]
cluster = hetero.load_cluster({cluster!r})
job = load_rl_job(job_path, cluster=cluster)
summary = run_rl(job, cluster, types.SimpleNamespace(run_dir=run_dir, timeout_s=30, quiet=True, reward_workers=0))
open(out, "w").write(json.dumps(summary))
""".format(cluster=CLUSTER)


def _job(tmp_path: Path, plan: dict, mode: str, staleness: int = 0, kl_coef: float = 0.0) -> str:
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                                    for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))))
    (tmp_path / "rewards.py").write_text(REWARD)
    placement = {"mode": mode, "actor": {"plan": write_yaml(tmp_path, "plan.yaml", plan)}}
    if mode == "disaggregated":
        placement["rollout"] = {"groups": ["slow"]}
    return write_yaml(tmp_path, "job.yaml", {
        "model": write_yaml(tmp_path, "model.yaml", MODEL), "prompts": "prompts.jsonl",
        "eval_prompts": "prompts.jsonl", "reward": "rewards.py:parity", "steps": 2, "prompts_per_step": 2,
        "group_size": 4, "max_new_tokens": 4, "stop": "\n", "temperature": 1.0, "lr": 0.05, "seed": 3,
        "staleness": staleness, "kl_coef": kl_coef, "placement": placement})


def run_job(tmp_path: Path, plan: dict, mode: str, staleness: int = 0, kl_coef: float = 0.0) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    job, run_dir, out = _job(tmp_path, plan, mode, staleness, kl_coef), tmp_path / "run", tmp_path / "summary.json"
    proc = run_launcher([sys.executable, "-c", DRIVER, job, str(run_dir), str(out)], 240, marker=str(run_dir),
                        cwd=ROOT)
    assert_no_leftover(run_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _synced(summary: dict, steps: int = 2) -> None:
    sync = summary["weight_sync"]
    assert sync["checksums_match"] is True
    assert sync["syncs"] == steps + 1   # one before each step and the final weights for the evaluation
    assert sync["pieces_checked"] > 0 and sync["bytes_per_sync"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_collocated_and_disaggregated_give_the_same_steps(tmp_path):
    # with a KL penalty: the reference log-probs come from the ranks that generate, placed differently
    co = run_job(tmp_path / "co", PP2, "collocated", kl_coef=0.1)
    dis = run_job(tmp_path / "dis", PP2, "disaggregated", kl_coef=0.1)
    for s in (co, dis):
        _synced(s)
        assert [r["policy_version"] for r in s["rl_steps"]] == [0, 1]
        assert [r["max_staleness"] for r in s["rl_steps"]] == [0, 0]
    fields = ("reward_mean", "loss", "kl", "completion_tokens")
    assert [[r[f] for f in fields] for r in co["rl_steps"]] == [[r[f] for f in fields] for r in dis["rl_steps"]]
    assert co["eval"] == dis["eval"]
    # the reward varies within the groups, so the advantages and the update are not zero (the loss value
    # itself is about 0 on-policy: the ratio is 1 and a group's advantages sum to 0)
    assert all(0 < r["reward_mean"] < 1 for r in co["rl_steps"])
    assert co["rl_steps"][0]["kl"] < 1e-6 < co["rl_steps"][1]["kl"]   # the first update moved off the reference


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tensor_parallel_actor_syncs_bit_for_bit_across_vendors_with_staleness(tmp_path):
    s = run_job(tmp_path, TP2, "disaggregated", staleness=1)
    _synced(s)
    assert s["placement"]["mode"] == "disaggregated" and s["placement"]["rollout"]["groups"] == ["slow"]
    # staleness 1: step 1 is generated with the initial weights while step 0 trains
    assert [r["policy_version"] for r in s["rl_steps"]] == [0, 0]
    assert [r["max_staleness"] for r in s["rl_steps"]] == [0, 1]
