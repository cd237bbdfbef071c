"""What a first user meets: a plan that cannot fit is stopped (validate, launch) or flagged
(predict's exit status); dry runs on clusters without hosts; node slots on loopback hosts."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from conftest import CONFIGS


def _cli(capsys, *argv: str):
    """``hetero ARGV`` in this process: (exit status, stdout, stderr)."""
    from types import SimpleNamespace

    from hetero.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

TINY_MEMORY = {"name": "small", "devices": {"tinyemu": {"base": "cpu", "vendor": "emu-a", "memory": "1 MiB"}},
               "groups": [{"name": "fast", "device": "tinyemu", "nodes": 1, "devices_per_node": 2}]}
PLAN = {"global_batch_size": 8, "micro_batch_size": 4,
        "pipelines": [{"replicas": 2, "micro_batches": 1, "stages": [{"group": "fast", "layers": [0, 4]}]}]}


def _write(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_a_plan_that_cannot_fit_is_refused_by_validate_and_launch_and_flagged_by_predict(tmp_path, capsys):
    cluster, plan = _write(tmp_path / "c.yaml", TINY_MEMORY), _write(tmp_path / "p.yaml", PLAN)
    model = str(CONFIGS / "models" / "tiny.yaml")
    need = "p.yaml: pipelines[0].stages[0]: does not fit: the stage (fast, tp 1, layers [0, 4)) needs "
    proc = _cli(capsys, "validate", "--cluster", cluster, "--model", model, plan)
    assert proc.returncode == 1 and need in proc.stderr and "holds 1 MiB" in proc.stderr, proc.stdout + proc.stderr
    assert "fits" not in proc.stdout.split("p.yaml")[1].splitlines()[0]
    inputs = ["--cluster", cluster, "--model", model, "--plan", plan]
    run_dir = tmp_path / "run"
    for extra in (["--dry-run"], ["--steps", "1", "--run-dir", str(run_dir)]):
        proc = _cli(capsys, "launch", *inputs, *extra)
        assert proc.returncode == 1 and need in proc.stderr and "nothing was started" in proc.stderr, proc.stderr
        assert "--skip-memory-check" in proc.stderr and "Traceback" not in proc.stderr and not run_dir.exists()
    proc = _cli(capsys, "launch", *inputs, "--dry-run", "--skip-memory-check", "--run-dir", str(run_dir))
    assert proc.returncode == 0 and "--nproc-per-node=2" in proc.stdout, proc.stderr
    proc = _cli(capsys, "predict", *inputs)   # the full report, then the verdict on its last line and in the status
    assert proc.returncode == 3 and "iteration" in proc.stdout, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("does not fit: 1 stage(s)")
    proc = _cli(capsys, "predict", *inputs, "--json")
    assert proc.returncode == 3 and json.loads(proc.stdout)["fits_memory"] is False
    # the same files with room: every command is content
    roomy = _write(tmp_path / "roomy.yaml", {**TINY_MEMORY, "devices": {"tinyemu": {"base": "cpu", "vendor": "emu-a"}}})
    assert _cli(capsys, "predict", "--cluster", roomy, "--model", model, "--plan", plan).returncode == 0
    proc = _cli(capsys, "validate", "--cluster", roomy, "--model", model, plan)
    assert proc.returncode == 0 and "fits small / tiny" in proc.stdout, proc.stderr
