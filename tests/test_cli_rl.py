"""``hetero rl`` without running a job: --dry-run, refused outputs, bad jobs; ``hetero validate`` of job files."""
from __future__ import annotations

import shutil

import pytest

from hetero.cli import main

from conftest import CONFIGS

RL = CONFIGS / "rl"
CLUSTER = str(CONFIGS / "clusters" / "local-cpu.yaml")


def test_dry_run_prints_the_placement_and_sizes(capsys):
    assert main(["rl", str(RL / "grpo-disaggregated.yaml"), "--cluster", CLUSTER, "--dry-run", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "placement: disaggregated" in out
    assert "stage 1: group fast (emu-a), layers [1, 2), tp 1" in out
    assert "rollout: group slow (emu-b, 2 devices): 2 copies of the whole model" in out
    assert "3 steps x 8 prompts x 8 completions = 64 samples a step" in out


def test_outputs_that_name_an_input_are_refused_before_any_work(tmp_path, capsys):
    shutil.copytree(RL, tmp_path / "rl")
    job = tmp_path / "rl" / "grpo-collocated.yaml"
    prompts = tmp_path / "rl" / "prompts.jsonl"
    before = prompts.read_text()
    assert main(["rl", str(job), "--cluster", CLUSTER, "--summary", str(prompts)]) == 1
    assert "--summary" in capsys.readouterr().err and prompts.read_text() == before
    assert main(["rl", str(job), "--cluster", CLUSTER, "--summary", str(job)]) == 1
    assert "is the JOB file" in capsys.readouterr().err
    assert main(["rl", str(job), "--cluster", CLUSTER, "--save", str(tmp_path / "rl")]) == 1
    assert "--save" in (err := capsys.readouterr().err) and "holds the JOB file" in err, err
    notes = tmp_path / "notes"   # no input inside, yet files that are not a checkpoint: replaced whole
    notes.mkdir()
    (notes / "keep.txt").write_text("mine")
    assert main(["rl", str(job), "--cluster", CLUSTER, "--save", str(notes)]) == 1
    assert "not a checkpoint" in capsys.readouterr().err and (notes / "keep.txt").read_text() == "mine"


def test_bad_inputs_are_one_line_each(tmp_path, capsys):
    assert main(["rl", str(RL / "grpo-collocated.yaml"), "--cluster", CLUSTER, "--json"]) == 1
    assert "--json goes with --predict" in capsys.readouterr().err
    assert main(["rl", str(RL / "grpo-collocated.yaml"), "--cluster", CLUSTER, "--load", str(tmp_path)]) == 1
    assert "--load" in capsys.readouterr().err
    bad = tmp_path / "job.yaml"
    bad.write_text((RL / "grpo-collocated.yaml").read_text().replace("group_size: 8", "group_size: 1"))
    assert main(["rl", str(bad), "--cluster", CLUSTER, "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "group_size: must be >= 2, got 1" in err and "Traceback" not in err


@pytest.mark.parametrize("job", ["grpo-collocated.yaml", "grpo-random-reward.yaml"])
def test_validate_recognises_rl_jobs(job, capsys):
    assert main(["validate", str(RL / job), "--cluster", CLUSTER]) == 0
    assert "(rl job) fits cluster local-cpu" in capsys.readouterr().out
