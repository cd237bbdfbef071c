"""RL job files (hetero.rl.job): the shipped examples load; every kind of mistake is named."""
from __future__ import annotations

import shutil

import pytest
import yaml

from hetero.rl.job import load_rl_job
from hetero.specs.cluster import load_cluster
from hetero.specs.errors import SpecError

from conftest import CONFIGS

RL = CONFIGS / "rl"


@pytest.fixture(scope="module")
def cluster():
    return load_cluster(CONFIGS / "clusters" / "local-cpu.yaml")


@pytest.fixture
def job_dir(tmp_path):
    """A copy of configs/rl to edit."""
    shutil.copytree(RL, tmp_path / "rl")
    return tmp_path / "rl"


def _edit(job_dir, name="grpo-collocated.yaml", **changes):
    path = job_dir / name
    data = yaml.safe_load(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(yaml.safe_dump(data))
    return path


def _problems(path, cluster=None) -> str:
    with pytest.raises(SpecError) as e:
        load_rl_job(path, cluster)
    return str(e.value)


def test_shipped_jobs_load_and_describe_their_placement(cluster):
    job = load_rl_job(RL / "grpo-disaggregated.yaml", cluster)
    assert (job.algorithm, job.group_size, job.prompts_per_step, job.stop) == ("grpo", 8, 8, "\n")
    assert job.samples_per_step == job.actor_plan.global_batch_size == 64
    assert job.model == str(RL / "model.yaml") and job.model_spec.vocab_size == 256
    # each prompt's tokens, counted once while loading (the bytes tokenizer: UTF-8 bytes)
    assert job.prompt_lengths == tuple(len(r.prompt.encode("utf-8")) for r in job.prompt_records)
    assert len(job.prompt_records) == 320 and len(job.eval_records) == 80
    first = job.prompt_records[0]
    assert first.line == 1 and set(first.fields) == {"answer"}
    assert job.reward_ref.function == "exact"
    assert job.placement_dict()["rollout"] == {"groups": ["slow"]}
    assert job.placement_dict()["actor"]["groups"] == ["fast"]
    collocated = load_rl_job(RL / "grpo-collocated.yaml", cluster)
    assert collocated.rollout_groups == ["fast"] and collocated.placement.mode == "collocated"
    assert load_rl_job(RL / "grpo-random-reward.yaml").reward_ref.function == "random_reward"


def test_unknown_field_has_a_did_you_mean(job_dir):
    path = _edit(job_dir, group_sise=4)
    assert "group_sise: unknown field 'group_sise'" in _problems(path)
    assert "did you mean 'group_size'?" in _problems(path)


def test_ranges(job_dir):
    text = _problems(_edit(job_dir, group_size=1, temperature=0.0, staleness=-1, algorithm="ppo"))
    assert "algorithm: 'ppo' is not one of 'grpo'" in text
    text = _problems(_edit(job_dir, algorithm=None, group_size=1, temperature=0.0, staleness=-1))
    assert "group_size: must be >= 2, got 1" in text
    assert "temperature: must be > 0" in text and "staleness: must be >= 0" in text


def test_missing_prompts_file_and_bad_lines(job_dir):
    assert "grpo-collocated.yaml: prompts: " in _problems(_edit(job_dir, prompts="nowhere.jsonl"))
    assert "nowhere.jsonl: not found" in _problems(_edit(job_dir, prompts="nowhere.jsonl"))
    (job_dir / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n\nnot json\n{"answer": "3"}\n')
    text = _problems(_edit(job_dir, prompts="bad.jsonl"))
    assert "bad.jsonl line 3: not JSON" in text
    assert 'bad.jsonl line 4: has no "prompt" string' in text
    (job_dir / "long.jsonl").write_text('{"prompt": "' + "1" * 20 + '"}\n')
    assert "long.jsonl line 1: the prompt is 20 tokens" in _problems(_edit(job_dir, eval_prompts="long.jsonl"))


def test_reward_that_does_not_import(job_dir):
    assert "no function 'nope' in" in _problems(_edit(job_dir, reward="rewards.py:nope"))
    (job_dir / "broken.py").write_text("import no_such_module_here\n")
    text = _problems(_edit(job_dir, reward="broken.py:exact"))
    assert "reward: reward broken.py:exact: importing" in text and "ModuleNotFoundError" in text
    assert "missing.py" in _problems(_edit(job_dir, reward="missing.py:exact"))
    assert "no_such_package" in _problems(_edit(job_dir, reward="no_such_package.mod:f"))
    assert "is not FILE.py:function" in _problems(_edit(job_dir, reward="rewards.py"))


def test_groups_must_be_in_the_cluster(job_dir, cluster):
    placement = {"mode": "disaggregated", "actor": {"plan": "actor-plan.yaml"}, "rollout": {"groups": ["slwo"]}}
    text = _problems(_edit(job_dir, placement=placement), cluster)
    assert "placement.rollout.groups: unknown group 'slwo'" in text and "did you mean 'slow'?" in text


def test_disaggregated_rollout_needs_devices_the_actor_does_not_use(job_dir, cluster):
    placement = {"mode": "disaggregated", "actor": {"plan": "actor-plan.yaml"}, "rollout": {"groups": ["fast"]}}
    text = _problems(_edit(job_dir, placement=placement), cluster)
    assert "group fast has 2 devices and the actor uses 2: 0 left for the rollout" in text
    # without a cluster the fit is not judged
    load_rl_job(job_dir / "grpo-collocated.yaml")
    collocated_elsewhere = {"mode": "collocated", "actor": {"plan": "actor-plan.yaml"}, "rollout": {"groups": ["slow"]}}
    assert "not among the actor's groups" in _problems(_edit(job_dir, placement=collocated_elsewhere), cluster)
    both = {"mode": "collocated", "actor": {"plan": "actor-plan.yaml", "groups": ["fast"]}}
    assert "give exactly one of 'plan' and 'groups'" in _problems(_edit(job_dir, placement=both))


def test_actor_plan_batch_must_be_the_step(job_dir):
    text = _problems(_edit(job_dir, group_size=4))
    assert "global_batch_size=64" in text and "8 x 4 = 32" in text


def test_load_must_be_a_checkpoint(job_dir):
    assert "load: " in _problems(_edit(job_dir, load="nowhere"))
    (job_dir / "empty").mkdir()
    assert "is not a checkpoint" in _problems(_edit(job_dir, load="empty"))
    assert "has no config.json" in _problems(_edit(job_dir, load="hf:empty"))


def test_prompt_lengths_are_counted_in_the_jobs_tokenizer(job_dir):
    """A Hugging Face tokenizer's prompt is its tokens (special ones included, as the run encodes
    it), not its bytes: five words are 6 tokens with the start token and fit; as many words as there is room do not."""
    import json

    from helpers.hf import word_tokenizer

    word_tokenizer(job_dir / "tok", 30)
    seq = yaml.safe_load((job_dir / "model.yaml").read_text())["seq_length"]
    room = seq - yaml.safe_load((job_dir / "grpo-collocated.yaml").read_text())["max_new_tokens"]
    words = " ".join(f"w{i % 30}" for i in range(room))          # room words + <s>: one token too many
    (job_dir / "hf.jsonl").write_text(json.dumps({"prompt": "w1 w2 w3 w4 w5"}) + "\n"
                                      + json.dumps({"prompt": words}) + "\n")
    text = _problems(_edit(job_dir, tokenizer="tok", eval_prompts="hf.jsonl"))
    assert f"hf.jsonl line 2: the prompt is {room + 1} tokens" in text, text
    assert "hf.jsonl line 1" not in text
