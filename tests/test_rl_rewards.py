"""Reward functions (hetero.rl.rewards): imported by file or module, called in worker processes,
and a bad value or an exception ends the run with one line naming the function and the prompt."""
from __future__ import annotations

import pytest

from hetero.rl.prompts import PromptRecord
from hetero.rl.rewards import RewardError, RewardPool, load_reward, parse_reward_ref

REWARDS = '''
import os

def exact(prompt, completion, answer):
    return 1.0 if completion.strip() == answer else 0.0

def pid(prompt, completion, answer):
    return float(os.getpid())

def raises(prompt, completion, answer):
    raise ValueError("no digits in " + completion)

def text(prompt, completion, answer):
    return "1.0"

def nan(prompt, completion, answer):
    return float("nan")

def boolean(prompt, completion, answer):
    return True

def dies(prompt, completion, answer):
    os._exit(3)

def hangs(prompt, completion, answer):
    import time
    time.sleep(60)
'''


@pytest.fixture
def rewards_file(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    return tmp_path


def _records(n=4):
    return [PromptRecord(f"{i}+1=", {"answer": str(i + 1)}, line=i + 1, source="prompts.jsonl") for i in range(n)]


def test_file_and_module_refs(rewards_file):
    ref = parse_reward_ref("my_rewards.py:exact", str(rewards_file))
    assert ref.path == str(rewards_file / "my_rewards.py") and ref.module is None
    assert load_reward(ref)("1+1=", "2\n", answer="2") == 1.0
    assert load_reward(ref) is load_reward(ref)   # imported once per process
    module_ref = parse_reward_ref("os.path:join", str(rewards_file))
    assert module_ref.module == "os.path" and load_reward(module_ref)("a", "b") == "a/b"


def test_in_process_scores_and_failures_name_the_prompt_line(rewards_file):
    def score(function, completions):
        with RewardPool(parse_reward_ref(f"my_rewards.py:{function}", str(rewards_file)), workers=0) as pool:
            return pool.score(_records(), completions)

    assert score("exact", ["1\n", "5", "3", " 4 "]) == [1.0, 0.0, 1.0, 1.0]
    for function, expect in (("raises", "raised ValueError: no digits in 1"), ("text", "returned '1.0' (str), not a number"),
                             ("nan", "returned nan, not a finite number"), ("boolean", "returned True (bool)")):
        with pytest.raises(RewardError) as e:
            score(function, ["1", "2", "3", "4"])
        line = str(e.value)
        assert "\n" not in line
        assert line.startswith(f"reward my_rewards.py:{function} on prompts.jsonl line 1 (completion '1') ")
        assert expect in line


@pytest.mark.timeout(60)
def test_worker_processes_score_in_order_and_report_failures(rewards_file):
    import os

    with RewardPool(parse_reward_ref("my_rewards.py:pid", str(rewards_file)), workers=2, timeout_s=30) as pool:
        pids = pool.score(_records(8), ["x"] * 8)
    assert os.getpid() not in pids and 1 <= len(set(pids)) <= 2
    with RewardPool(parse_reward_ref("my_rewards.py:exact", str(rewards_file)), workers=1, timeout_s=30) as pool:
        assert pool.score(_records(), ["1", "2", "9", "4"]) == [1.0, 1.0, 0.0, 1.0]
    with RewardPool(parse_reward_ref("my_rewards.py:raises", str(rewards_file)), workers=1, timeout_s=30) as pool:
        with pytest.raises(RewardError, match=r"on prompts.jsonl line 1 \(completion '1'\) raised ValueError"):
            pool.score(_records(), ["1", "2", "3", "4"])
    with RewardPool(parse_reward_ref("my_rewards.py:dies", str(rewards_file)), workers=1, timeout_s=30) as pool:
        with pytest.raises(RewardError, match="a reward worker process died"):
            pool.score(_records(), ["1", "2", "3", "4"])
    with RewardPool(parse_reward_ref("my_rewards.py:hangs", str(rewards_file)), workers=1, timeout_s=1) as pool:
        with pytest.raises(RewardError, match="took more than 1 s"):
            pool.score(_records(1), ["1"])

