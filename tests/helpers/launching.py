"""``hetero launch`` from a test: write the cluster, model and plan to YAML, run the launcher in a
session of its own (a timeout ends its whole process tree), check that nothing of the run is left
running, and read its summary; and the single-device reference a launch's losses are checked against.

Every launch trains :data:`STEPS` steps with seed 0 and learning rate :data:`LR`, so any two launches
(and the reference) of one model see the same batches and must produce the same losses and gradient
norms, to :data:`RTOL`, whatever the plan.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import yaml

from _spawn import run_launcher

from .processes import assert_no_leftover
from .specs import CLUSTER

__all__ = ["ROOT", "LR", "STEPS", "RTOL", "write_yaml", "launch", "launch_summary", "reference",
           "assert_matches_reference", "live_run"]

ROOT = Path(__file__).resolve().parents[2]
LR = 1e-2  # large enough that a wrong gradient shows in the losses within 5 steps
STEPS = 5  # read at each launch: a test may set it for a few launches (and put it back)
RTOL = 1e-3


def write_yaml(folder: Path, name: str, data: dict) -> str:
    """``data`` as YAML in ``folder/name``; returns the path as a string (for a command line)."""
    path = Path(folder) / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def launch(tmp_path: Path, model: dict, plan: dict, *extra: str, timeout: float = 150, check: bool = True,
           cluster: dict = CLUSTER):
    """Run ``hetero launch`` on ``cluster`` (default: :data:`~helpers.specs.CLUSTER`) with ``model`` and
    ``plan`` for :data:`STEPS` steps, its run directory ``tmp_path/run`` and its summary
    ``tmp_path/summary.json``; ``extra``: more flags (a later ``--steps`` wins). Returns ``(summary,
    process)`` (``process.elapsed``: its wall time in seconds); with ``check`` a non-zero exit fails
    the test, without it the summary is None. Any process of the run still alive afterwards fails
    the test (:func:`~helpers.processes.assert_no_leftover`)."""
    summary = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "hetero", "launch", "--cluster", write_yaml(tmp_path, "cluster.yaml", cluster),
           "--model", write_yaml(tmp_path, "model.yaml", model), "--plan", write_yaml(tmp_path, "plan.yaml", plan),
           "--steps", str(STEPS), "--seed", "0", "--lr", str(LR), "--summary", str(summary), "--timeout", "20",
           "--run-dir", str(tmp_path / "run"), "--quiet", *extra]
    t0 = time.time()
    proc = run_launcher(cmd, timeout, marker=str(tmp_path / "run"), cwd=ROOT)   # a timeout ends the whole tree
    proc.elapsed = time.time() - t0
    assert_no_leftover(tmp_path / "run")
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads(summary.read_text()), proc
    return None, proc


def launch_summary(tmp_path: Path, model: dict, plan: dict, *extra: str, **kwargs) -> dict:
    """The parsed summary of a :func:`launch` that must succeed (same arguments, ``check`` aside)."""
    return launch(tmp_path, model, plan, *extra, check=True, **kwargs)[0]


_REFERENCE: dict = {}


def reference(model: dict, gbs: int = 8, steps: int | None = None, lr: float = LR):
    """``(losses, grad_norms)`` of ``steps`` (default :data:`STEPS`) steps of ``model`` at learning
    rate ``lr`` in one process on one device, the batch of ``gbs`` samples whole (computed once per
    model name, batch size, steps and rate)."""
    steps = STEPS if steps is None else steps
    key = (model["name"], gbs, steps, lr)
    if key not in _REFERENCE:
        from hetero.runtime.reference import reference_run

        _REFERENCE[key] = reference_run(model, 0, steps, gbs, lr=lr)
    return _REFERENCE[key]


def assert_matches_reference(summary: dict, model: dict, gbs: int = 8, steps: int | None = None,
                             lr: float = LR) -> None:
    """A launch's summary trained ``steps`` (default :data:`STEPS`) steps at ``lr`` with the
    reference's losses and gradient norms."""
    steps = STEPS if steps is None else steps
    losses, norms = reference(model, gbs, steps, lr)
    assert summary["steps"] == steps
    assert summary["losses"] == pytest.approx(losses, rel=RTOL), (summary["losses"], losses)
    assert summary["grad_norms"] == pytest.approx(norms, rel=RTOL), (summary["grad_norms"], norms)


def live_run(tmp_path: Path, plan: str = "tiny-local-cpu-replicated.yaml"):
    """The launcher's in-process elastic controller (:class:`hetero.runtime.elastic.live.LiveRun`) for
    configs/models/tiny.yaml on configs/clusters/local-cpu.yaml with ``configs/plans/<plan>``, its
    workers not started (a test calls its planning and publishing directly; it closes
    ``run.coordinator``). Returns ``(run, cluster, model, plan, launch)``."""
    import hetero
    from hetero.runtime import launcher
    from hetero.runtime.elastic.live import LiveRun
    from hetero.runtime.spec import RunOptions

    cluster = hetero.load_cluster(str(ROOT / "configs/clusters/local-cpu.yaml"))
    model = hetero.load_model(str(ROOT / "configs/models/tiny.yaml"))
    loaded = hetero.load_plan(str(ROOT / "configs/plans" / plan), cluster, model)
    prepared = launcher.prepare(cluster, model, loaded, RunOptions(elastic=True), run_dir=str(tmp_path / "run"))
    return LiveRun(prepared, cluster, model, loaded, [], print_fn=lambda *_: None), cluster, model, loaded, prepared
