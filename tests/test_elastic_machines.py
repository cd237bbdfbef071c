"""An elastic run over several machines: ``hetero launch --elastic --node-rank R`` on each.

Two loopback hosts (127.0.0.1 and 127.0.0.2) stand for two machines, one call each, as
tests/test_first_use.py does. Node slot 0's call runs the controller and hosts the coordinator's
store; node slot 1's call starts and watches its own workers and reports through that store
(:mod:`hetero.runtime.elastic.agent`). Both runs train data-parallel replicas of the tiny GPT, one
per machine, so that either machine's loss leaves a whole copy of the state on the other.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from _spawn import end_launcher, free_port, processes_naming
from helpers import GPT, LR, ROOT, local_cluster, write_yaml

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

PLAN = {"global_batch_size": 8, "micro_batch_size": 2,
        "pipelines": [{"micro_batches": 2, "stages": [{"group": "fast", "layers": [0, 4]}]},
                      {"micro_batches": 2, "stages": [{"group": "slow", "layers": [0, 4]}]}]}


HOSTS = (["127.0.0.1"], ["127.0.0.2"])


def _calls(tmp_path, steps: int, *extra: str, lr: float = LR, clusters=(None, None),
           plan: dict = PLAN) -> list[subprocess.Popen]:
    """Both hosts' calls; ``clusters``: each call's cluster file (default: both hosts, one device each)."""
    default = write_yaml(tmp_path, "cluster.yaml", local_cluster(devices=1, slowdown=None, hosts=HOSTS, name="loop"))
    model, plan, port = write_yaml(tmp_path, "model.yaml", GPT), write_yaml(tmp_path, "plan.yaml", plan), free_port()
    return [subprocess.Popen(
        [sys.executable, "-m", "hetero", "launch", "--cluster", clusters[r] or default, "--model", model,
         "--plan", plan, "--steps", str(steps), "--seed", "0", "--lr", str(lr), "--timeout", "30", "--quiet",
         "--elastic", "--node-rank", str(r), "--master-port", str(port), "--run-dir", str(tmp_path / f"run{r}"),
         "--summary", str(tmp_path / f"s{r}.json"), *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for r in (0, 1)]


def _outputs(tmp_path, procs, between=lambda: None) -> list[tuple[str, str]]:
    """Both calls' (stdout, stderr) once they ended (``between``: done first); whatever is left of
    them is ended either way."""
    try:
        between()
        return [p.communicate(timeout=200) for p in procs]
    finally:
        for r, p in enumerate(procs):
            end_launcher(p, str(tmp_path / f"run{r}"))


def _reference(steps: int, lr: float = LR) -> list[float]:
    from hetero.runtime.reference import reference_run

    return reference_run(GPT, 0, steps, 8, lr=lr)[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lost", [1, 0], ids=["on the other machine", "on node slot 0's machine"])
def test_a_lost_worker_is_survived_in_process_on_the_other_machine(tmp_path, lost):
    """Rank 1 (the second host's worker) or rank 0 (the first host's) lost at step 3: the other
    trains on in its process; when rank 0 is lost the survivor finishes as rank 0 on the second host,
    whose launcher sends the summary to node slot 0's call, which writes it."""
    procs = _calls(tmp_path, 5, "--inject-failure", f"3:{lost}")
    outs = _outputs(tmp_path, procs)
    assert [p.returncode for p in procs] == [0, 0], outs
    summary = json.loads((tmp_path / "s0.json").read_text())
    (rc,) = summary["reconfigurations"]
    assert rc["path"] == "in-process" and rc["world_size_before"] == 2 and rc["world_size_after"] == 1
    assert rc["pids_kept"] and f"rank {lost}" in rc["reason"]
    assert summary["losses"] == pytest.approx(_reference(5), rel=1e-3)
    assert not processes_naming(str(tmp_path / "run0")) and not processes_naming(str(tmp_path / "run1"))


@pytest.mark.timeout(300)
def test_the_other_machine_lost_whole_is_survived_in_process(tmp_path):
    """Node slot 1's call and its workers killed at once (its session): slot 0's launcher sees its
    heartbeat stop, and its rank trains on alone with the losses of a run that lost nothing."""
    # long enough for the kill to land while it trains; a smaller learning rate than the suite's, so
    # that two replicas and one device (another reduction order) stay within RTOL over every step
    steps, lr = 150, 1e-3
    lost_after = 3.5   # --machine-lost-after: above the 2 s default, so that honouring it shows
    procs = _calls(tmp_path, steps, "--machine-lost-after", str(lost_after), lr=lr)
    try:
        deadline = time.monotonic() + 150
        while not (tmp_path / "run1" / "attempt0" / "rank1.ready").exists():
            assert procs[1].poll() is None and time.monotonic() < deadline, procs[1].stderr.read()[-3000:]
            time.sleep(0.05)
        time.sleep(0.2)   # a few steps in
        killed_at = time.monotonic()
        os.killpg(procs[1].pid, signal.SIGKILL)
        out, err = procs[0].communicate(timeout=200)
        ended_at = time.monotonic()
    finally:
        for r, p in enumerate(procs):
            end_launcher(p, str(tmp_path / f"run{r}"))
    assert procs[0].returncode == 0, err[-3000:]
    summary = json.loads((tmp_path / "s0.json").read_text())
    (rc,) = summary["reconfigurations"]
    assert rc["path"] == "in-process" and rc["world_size_after"] == 1, rc
    assert 0 < rc["step"] < steps, "the machine was lost after the run ended: nothing was survived"
    reference = _reference(steps, lr)
    # at most one step's loss is unknown: updated everywhere, its closing all-reduce lost with the machine
    losses = summary["losses"]
    assert len(losses) == steps and sum(loss is None for loss in losses) <= 1
    assert [x for x in losses if x is not None] == pytest.approx(
        [r for x, r in zip(losses, reference) if x is not None], rel=1e-3)
    # the loss is seen once the heartbeat has stood still for --machine-lost-after seconds
    assert lost_after <= rc["reshard_time_s"] < lost_after + 5, rc
    assert ended_at - killed_at < 120
    assert not processes_naming(str(tmp_path / "run0")) and not processes_naming(str(tmp_path / "run1"))


@pytest.mark.timeout(300)
def test_a_lost_coordinator_machine_ends_the_others_without_orphans(tmp_path):
    """Node slot 0's call killed with its workers (its session): nothing decides any more, so node
    slot 1's launcher says it lost the coordinator, ends its workers and fails."""
    procs = _calls(tmp_path, 300, lr=1e-3)
    try:
        deadline = time.monotonic() + 150
        while not (tmp_path / "run1" / "attempt0" / "rank1.ready").exists():
            assert procs[1].poll() is None and time.monotonic() < deadline, procs[1].stderr.read()[-3000:]
            time.sleep(0.05)
        os.killpg(procs[0].pid, signal.SIGKILL)
        _, err = procs[1].communicate(timeout=120)
    finally:
        for r, p in enumerate(procs):
            end_launcher(p, str(tmp_path / f"run{r}"))
    assert procs[1].returncode == 1 and "lost the coordinator" in err and "Traceback" not in err, err[-3000:]
    assert not processes_naming(str(tmp_path / "run0")) and not processes_naming(str(tmp_path / "run1"))


@pytest.mark.timeout(300)
def test_a_machine_that_joins_is_taken_in_while_training_goes_on(tmp_path):
    """The run starts on the first host alone; the cluster file then gets a group on the second host
    and a call with --node-rank 1 starts there: node slot 0's launcher replans, that call starts the
    new plan's rank as a joiner while the first trains on, and both reshard in-process, with the
    losses of a run that changed nothing."""
    # The join must land while the run trains: the joiner starts in about 6 s on a loaded machine,
    # less on an idle one, where the steps are faster too. Both devices compute 3x slower (the
    # waits are not compute: the losses are unchanged), so the join lands near step 50 of 160
    # whatever the machine's speed, rather than near the end.
    steps, lr, slow = 160, 1e-3, (3.0, 3.0)
    cluster = write_yaml(tmp_path, "alone.yaml", local_cluster(devices=(1, 0), slowdown=slow, hosts=HOSTS,
                                                               name="loop"))
    grown = write_yaml(tmp_path, "grown.yaml", local_cluster(devices=1, slowdown=slow, hosts=HOSTS, name="loop"))
    # the second host's call starts with the grown cluster file (its slot is in it) and waits to be taken
    # in; the first host's file grows once its run trains (replaced whole, as an editor saving it does)
    procs = _calls(tmp_path, steps, lr=lr, clusters=(cluster, grown), plan={
        "global_batch_size": 8, "micro_batch_size": 2,
        "pipelines": [{"micro_batches": 4, "stages": [{"group": "fast", "layers": [0, 4]}]}]})

    def grow():
        deadline = time.monotonic() + 150
        while not (tmp_path / "run0" / "attempt0" / "rank0.ready").exists():
            assert procs[0].poll() is None and time.monotonic() < deadline, procs[0].stderr.read()[-3000:]
            time.sleep(0.05)
        edit = tmp_path / "edit.yaml"
        shutil.copyfile(grown, edit)
        os.replace(edit, cluster)

    outs = _outputs(tmp_path, procs, grow)
    assert [p.returncode for p in procs] == [0, 0], outs
    summary = json.loads((tmp_path / "s0.json").read_text())
    (rc,) = summary["reconfigurations"]
    assert rc["path"] == "in-process" and rc["world_size_before"] == 1 and rc["world_size_after"] == 2, rc
    assert rc["devices_added"] == 1 and rc["joiners"] == 1 and 0 < rc["step"] < steps, rc
    assert summary["losses"] == pytest.approx(_reference(steps, lr), rel=1e-3)
    assert not processes_naming(str(tmp_path / "run0")) and not processes_naming(str(tmp_path / "run1"))
