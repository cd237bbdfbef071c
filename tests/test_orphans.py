"""``kill -9`` of a launcher leaves no process of its job behind (:mod:`hetero.runtime.lifeline`).

A SIGKILL runs no handler: the launcher cannot end its node launchers, which run in sessions of
their own, nor they their workers. Each of those ends itself when its parent dies. The runs here
train long enough to still be training when the kill lands; each test ends whatever is left on
the way out, pass or fail.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _spawn import end_launcher, free_port, processes_naming
from helpers import GPT, ROOT, local_cluster, write_yaml

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

GONE_WITHIN_S = 10.0
"""How long the job's processes may take to end after the kill (the kernel's signal takes milliseconds)."""
PLAN = {"global_batch_size": 8, "micro_batch_size": 2,
        "pipelines": [{"micro_batches": 4, "stages": [{"group": "fast", "layers": [0, 2]},
                                                      {"group": "slow", "layers": [2, 4]}]}]}


def _launch(tmp_path: Path, cluster: str, run: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """``hetero launch`` of a two-stage pipeline (two node slots) that trains for far longer than a test."""
    cmd = [sys.executable, "-m", "hetero", "launch", "--cluster", cluster,
           "--model", write_yaml(tmp_path, "model.yaml", GPT), "--plan", write_yaml(tmp_path, "plan.yaml", PLAN),
           "--steps", "100000", "--timeout", "30", "--quiet", "--run-dir", str(tmp_path / run), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})


def _wait_training(proc: subprocess.Popen, run_dir: Path, ranks: list[int], timeout: float = 150.0) -> None:
    """Until every rank in ``ranks`` has formed its process group (``rank<r>.ready``; an elastic run
    keeps its files in a folder per attempt)."""
    deadline = time.monotonic() + timeout
    while not all(next(run_dir.rglob(f"rank{r}.ready"), None) for r in ranks):
        assert proc.poll() is None, f"the launch ended before training: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"ranks {ranks} not ready within {timeout:g} s"
        time.sleep(0.1)


def _left_after_kill(run_dir: Path) -> list[int]:
    """The run's processes still alive :data:`GONE_WITHIN_S` after the kill (none, as soon as they are gone)."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while (left := processes_naming(str(run_dir))) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("flags", [(), ("--elastic",)], ids=["torchrun", "elastic"])
def test_kill_9_of_the_launcher_ends_its_node_launchers_and_workers(tmp_path, flags):
    """Two node slots on this machine (configs/clusters/local-cpu-pair.yaml), started by one call:
    workers forked from their node launchers, or (``--elastic``) started by the launcher itself.
    SIGKILL to the call ends all of them."""
    run_dir = tmp_path / "run"
    proc = _launch(tmp_path, str(ROOT / "configs/clusters/local-cpu-pair.yaml"), "run", *flags)
    try:
        _wait_training(proc, run_dir, [0, 1])
        assert len(processes_naming(str(run_dir))) >= 2   # what must end: node launchers and workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        left = _left_after_kill(run_dir)
        assert not left, f"processes of the job alive {GONE_WITHIN_S:g} s after kill -9 of its launcher: {left}"
    finally:
        end_launcher(proc, str(run_dir))


@pytest.mark.timeout(300)
def test_a_node_slot_whose_call_and_node_launcher_are_killed_leaves_no_worker(tmp_path):
    """Node slots started by one ``--node-rank`` call each (two loopback hosts, as two machines):
    SIGKILL to slot 1's call and its node launcher at once (nothing is left to end its workers but
    themselves) ends slot 1's workers, started as fresh interpreters; slot 0's call then fails on
    its lost peer and ends its own."""
    cluster = write_yaml(tmp_path, "cluster.yaml", local_cluster(
        devices=1, slowdown=None, hosts=(["127.0.0.1"], ["127.0.0.2"]), name="loop"))
    port = str(free_port())
    procs = [_launch(tmp_path, cluster, f"run{r}", "--node-rank", str(r), "--master-port", port,
                     env={"HETERO_WORKER_START": "spawn"}) for r in (0, 1)]
    try:
        _wait_training(procs[1], tmp_path / "run1", [1])
        _wait_training(procs[0], tmp_path / "run0", [0])
        (node_launcher,) = _children(procs[1].pid)
        for pid in (procs[1].pid, node_launcher):
            os.kill(pid, signal.SIGKILL)
        procs[1].wait(timeout=10)
        left = _left_after_kill(tmp_path / "run1")
        assert not left, f"slot 1's workers alive {GONE_WITHIN_S:g} s after its node launcher was killed: {left}"
        _, err = procs[0].communicate(timeout=120)
        assert procs[0].returncode == 1, err[-3000:]
        assert not processes_naming(str(tmp_path / "run0"))
    finally:
        for r, p in enumerate(procs):
            end_launcher(p, str(tmp_path / f"run{r}"))
