"""Elastic runs (``hetero launch --elastic``): a lost device, a handoff of the survivors' live state,
a new plan on the remaining devices, and the same losses as a run that lost nothing."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from _spawn import end_launcher
from helpers import CLUSTER, GPT, LLAMA, LR, ROOT, STEPS, local_cluster
from helpers import assert_matches_reference as _assert_matches, launch as _launch, leftover as _leftover
from helpers import plan_dict as _plan, reference as _reference, write_yaml as _write

REPLICATED = _plan([{"replicas": 2, "micro_batches": 2, "stages": [{"group": "fast", "layers": [0, 2]},
                                                                   {"group": "slow", "layers": [2, 4]}]}])


# ---------------------------------------------------------------------------- in-process units


def _cluster(groups):
    import hetero

    return hetero.load_cluster({**CLUSTER, "groups": groups})


def _lost(group, node):
    from types import SimpleNamespace

    return SimpleNamespace(group=group, node=node)


def test_without_devices_shrinks_a_one_node_group_and_drops_an_empty_one():
    from hetero.specs.cluster import without_devices

    c = _cluster([{"name": "fast", "device": "cpu-emu-a", "nodes": 1, "devices_per_node": 2},
                  {"name": "slow", "device": "cpu-emu-b", "nodes": 1, "devices_per_node": 1}])
    out = without_devices(c, [_lost("fast", 0), _lost("slow", 0)])
    assert [(g.name, g.nodes, g.devices_per_node) for g in out.groups] == [("fast", 1, 1)]
    assert out.device_type("fast").slowdown == c.device_type("fast").slowdown


def test_without_devices_splits_the_node_that_lost_devices_into_a_group_of_its_own():
    from hetero.specs.cluster import without_devices

    c = _cluster([{"name": "fast", "device": "cpu-emu-a", "nodes": 3, "devices_per_node": 4,
                   "hosts": ["h0", "h1", "h2"]}])
    out = without_devices(c, [_lost("fast", 1), _lost("fast", 1), _lost("fast", 2)])
    got = [(g.name, g.nodes, g.devices_per_node, list(g.hosts)) for g in out.groups]
    assert got == [("fast", 1, 4, ["h0"]), ("fast-n1", 1, 2, ["h1"]), ("fast-n2", 1, 3, ["h2"])]
    assert out.num_devices == c.num_devices - 3


def test_without_devices_refuses_when_nothing_is_left():
    from hetero.errors import HeteroError
    from hetero.specs.cluster import without_devices

    c = _cluster([{"name": "fast", "device": "cpu-emu-a", "nodes": 1, "devices_per_node": 1}])
    with pytest.raises(HeteroError, match="no device is left"):
        without_devices(c, [_lost("fast", 0)])


def _handoffs(tmp_path, steps: dict):
    """Handoff files of the REPLICATED plan's ranks: ``steps``: (replica, stage) -> the step that rank's
    state is at (absent: lost). Each rank holds its stage's one parameter, valued at its step.
    Returns Survivors and the holders (parameter -> ranks)."""
    import hetero
    from hetero.layout import build_layout
    from hetero.runtime.handoff import Survivors

    layout = build_layout(hetero.load_cluster(CLUSTER), hetero.load_plan(REPLICATED))
    holders: dict[str, list[int]] = {}
    for info in layout.ranks:
        name = f"layers.{2 * info.stage}.w"
        holders.setdefault(name, []).append(info.rank)
        step = steps.get((info.replica, info.stage))
        if step is None:
            continue
        torch.save({f"model/{name}": torch.full((2,), float(step))}, tmp_path / f"rank{info.rank}.handoff.pt")
        (tmp_path / f"rank{info.rank}.handoff.json").write_text(json.dumps(
            {"rank": info.rank, "applied_step": step, "results": [], "shards": {}, "loss_scale": None}))
    return Survivors(str(tmp_path), layout), {k: tuple(v) for k, v in holders.items()}


@pytest.mark.parametrize("steps, expected", [
    ({(0, 0): 4, (0, 1): 4, (1, 0): 4}, 4),          # the usual case: one step
    ({(0, 0): 4, (0, 1): 3, (1, 0): 3}, 3),          # stage 1 only at 3: the model of step 3
    ({(0, 0): 3, (0, 1): 4, (1, 0): 4}, 4),          # every stage has a copy at 4: the model of step 4
])
def test_survivors_at_different_steps_give_the_newest_whole_model(tmp_path, steps, expected):
    """A rank lost inside a step's gradient-norm all-reduce leaves some survivors one update ahead:
    the newest step at which every parameter has a copy is the model handed on."""
    survivors, holders = _handoffs(tmp_path, steps)
    step, state = survivors.assemble(holders)
    assert step == expected
    assert {k: float(v[0]) for k, v in state.items()} == {"model/layers.0.w": expected, "model/layers.2.w": expected}


def test_survivors_with_no_whole_model_at_any_step_are_refused(tmp_path):
    from hetero.errors import HeteroError

    survivors, holders = _handoffs(tmp_path, {(0, 0): 4, (1, 1): 3})   # stage 1 only at 3, stage 0 only at 4
    with pytest.raises(HeteroError, match="different steps .* at none of them"):
        survivors.assemble(holders)


# ---------------------------------------------------------------------------- launches


def _elastic(tmp_path, plan, *extra, timeout=200, check=True):
    return _launch(tmp_path, GPT, plan, "--elastic", *extra, timeout=timeout, check=check)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_lost_rank_is_replanned_around_with_the_losses_of_a_run_that_lost_nothing(tmp_path):
    summary, proc = _elastic(tmp_path, REPLICATED, "--inject-failure", "3:3", "--save", str(tmp_path / "ckpt"),
                             "--trace", str(tmp_path / "trace.json"))
    _assert_matches(summary, GPT)    # the single-device reference's losses and norms, all 5 steps
    assert (tmp_path / "ckpt" / ".metadata").exists()   # --save: written by the plan that finished
    (rc,) = summary["reconfigurations"]
    assert rc["step"] == 3 and rc["world_size_before"] == 4 and 1 <= rc["world_size_after"] <= 3
    assert "rank 3 (group slow" in rc["reason"] and "step 3" in rc["reason"]
    assert 0 < rc["handoff_time_s"] < rc["reshard_time_s"] < 60
    # the final summary describes the new plan's ranks, none of them on the lost device's slot
    assert len(summary["ranks"]) == rc["world_size_after"]
    assert "elastic: replanned for the 3 device(s) left" in proc.stdout
    # the line names the ranks the new plan uses, as the table's row does (ranks 4 -> 2 (of 3 devices left))
    assert f"a plan on {'all 3' if rc['world_size_after'] == 3 else str(rc['world_size_after']) + ' of them'}, " \
        in proc.stdout, proc.stdout
    # the survivors say once, briefly, that they lost a peer: no timeout that was never waited for
    assert "timed out" not in proc.stderr and "within its timeout" not in proc.stderr, proc.stderr
    # in-process: the survivors kept their processes and moved exactly the transition's intersections
    assert rc["path"] == "in-process" and rc["pids_kept"] is True
    run = tmp_path / "run" / "attempt0"
    pids = {r: int((run / f"rank{r}.pid").read_text()) for r in range(3)}
    assert {int(p) for p in rc["survivor_pids"].values()} == set(pids.values())
    assert summary["pid"] in pids.values()   # the new plan's rank 0 is a process of the first plan
    for r in range(rc["world_size_after"]):   # each rank of the new plan: one of the first plan's processes
        assert int((run / "gen1" / f"rank{r}.pid").read_text()) in pids.values()
    assert rc["bytes_moved"] == rc["intersection_bytes"] > 0
    from hetero.runtime.reshard import cma   # one machine: the receivers read the senders' memory

    assert rc["transport"] == ("same-host" if cma.usable() else "p2p")
    for key in ("detect_s", "agree_replan_s", "regroup_s", "transfer_s", "rebuild_s"):
        assert 0 <= rc[key] < rc["reshard_time_s"], (key, rc)
    assert rc["predicted_downtime_s"] > 0
    _assert_live_trace(tmp_path / "trace.json", rc["step"], ranks=rc["world_size_after"],
                       left=3 - rc["world_size_after"])


def _assert_live_trace(path, step: int, ranks: int, left: int = 0):
    """--trace of an in-process reshard: the new plan's ranks (the same processes) with their events of
    every step, the ``left`` survivors the new plan left out with theirs up to the reconfiguration,
    and a marker at the reconfiguration."""
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    work = [e for e in events if e.get("ph") == "X"]
    gone = {pid for pid, name in names.items() if "left at reconfiguration 1" in name}
    assert len(gone) == left, names
    assert {e["args"]["step"] for e in work if e["pid"] not in gone} == set(range(1, STEPS + 1))
    assert len({e["pid"] for e in work if e["pid"] not in gone}) == ranks
    for pid in gone:   # a process that left: its steps before the reconfiguration, none after
        steps = {e["args"]["step"] for e in work if e["pid"] == pid}
        assert steps and max(steps) <= step, (names[pid], steps)
    (mark,) = [e for e in events if e.get("ph") == "i"]
    assert mark["name"].startswith(f"reconfiguration before step {step}")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_lost_during_the_reshard_ends_the_run_naming_it(tmp_path, monkeypatch):
    """Rank 0 is to die right after checking in after rank 3's loss: the run ends at once with an
    error that names it, or (when rank 0 had not checked in within the timeout) it is counted lost
    and the run recovers, saying so; never a hang, no process left behind (_launch checks)."""
    from hetero.runtime.elastic.reconfig import FAIL_IN_RESHARD_ENV

    monkeypatch.setenv(FAIL_IN_RESHARD_ENV, "0")
    _, proc = _elastic(tmp_path, REPLICATED, "--inject-failure", "2:3", timeout=100, check=False)
    if proc.returncode == 0:
        # the other allowed outcome: rank 0 was already counted lost at the check-in (it had not
        # checked in within the timeout) and the run recovered on the devices left, saying so
        assert "rank 0 (group fast" in proc.stdout and "lost too" in proc.stdout, proc.stdout[-2000:]
    else:
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "rank 0 (group fast" in proc.stderr and "during the reconfiguration before step 2" in proc.stderr, \
            proc.stderr
    assert "Traceback" not in proc.stderr and proc.elapsed < 60


def _assert_merged_trace(path, step: int, ranks_before: int, ranks_after: int):
    """--trace of an elastic run: every attempt's ranks, their steps on one time axis, and a marker at
    the reconfiguration. ``ranks_before``: the ranks of the first attempt that left events."""
    from hetero.runtime.trace import PIDS_PER_ATTEMPT

    events = json.loads(path.read_text())["traceEvents"]
    work = [e for e in events if e.get("ph") == "X"]
    by_attempt = {a: [e for e in work if e["pid"] // PIDS_PER_ATTEMPT == a] for a in (0, 1)}
    assert {e["args"]["step"] for e in by_attempt[0]} == set(range(1, step))
    assert {e["args"]["step"] for e in by_attempt[1]} == set(range(step, STEPS + 1))
    assert len({e["pid"] for e in by_attempt[0]}) == ranks_before
    assert len({e["pid"] for e in by_attempt[1]}) == ranks_after
    (mark,) = [e for e in events if e.get("ph") == "i"]
    assert mark["name"].startswith(f"reconfiguration before step {step}")
    # one time axis: the failure or change comes before the new plan's first event, and that after the
    # old plan's last
    start1 = min(e["ts"] for e in by_attempt[1])
    assert mark["ts"] < start1 and max(e["ts"] + e["dur"] for e in by_attempt[0]) < start1
    names = [e["args"]["name"] for e in events if e.get("name") == "process_name"]
    assert any(n.startswith("attempt 0: rank 0") for n in names) and any(n.startswith("attempt 1:") for n in names)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tp_shards_of_the_survivors_are_assembled(tmp_path):
    """Two pipelines at tp 2 in different groups: one loses a tp rank, the other's shards rebuild
    every tensor (split dims concatenated in mesh order)."""
    plan = _plan([{"micro_batches": 2, "stages": [{"group": "fast", "tp": 2, "layers": [0, 4]}]},
                  {"micro_batches": 2, "stages": [{"group": "slow", "tp": 2, "layers": [0, 4]}]}])
    summary, _ = _elastic(tmp_path, plan, "--inject-failure", "2:3")
    _assert_matches(summary, GPT)
    assert [rc["step"] for rc in summary["reconfigurations"]] == [2]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fp16_hands_off_its_loss_scale_and_keeps_every_step_in_the_summary(tmp_path):
    """A start scale of 2^40 overflows fp16 gradients at every step: each step is skipped and the scale
    halves. The new plan goes on from the handed-off scale, not from the one given at launch."""
    summary, _ = _launch(tmp_path, {**LLAMA, "dtype": "fp16"}, REPLICATED, "--elastic", "--inject-failure", "3:2",
                         "--loss-scale", str(2.0 ** 40), timeout=200)
    assert summary["steps"] == 5 and [rc["step"] for rc in summary["reconfigurations"]] == [3]
    assert summary["loss_scales"] == [2.0 ** (40 - i) for i in range(5)], summary["loss_scales"]
    assert summary["skipped_steps"] == [1, 2, 3, 4, 5]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stage_without_a_replica_ends_the_run_naming_its_layers(tmp_path):
    plan = _plan([{"micro_batches": 4, "stages": [{"group": "fast", "layers": [0, 2]},
                                                   {"group": "slow", "layers": [2, 4]}]}])
    _, proc = _elastic(tmp_path, plan, "--inject-failure", "2:1", check=False)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no surviving rank holds a whole copy" in proc.stderr and "layer 2" in proc.stderr, proc.stderr
    assert "replicas" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "summary.json").exists()


def test_a_change_the_running_plan_absorbs_needs_no_pause(tmp_path):
    """A slow device joins that the best plan leaves idle: the cluster is taken in, nothing pauses.
    It is 100x slower, so no plausible profile of this machine's CPU makes it worth a share of the
    batch (at 2x, a profile measured on a loaded machine does: the planner gives it a micro-batch)."""
    import hetero
    from hetero.runtime.elastic.watch import ClusterWatch
    from hetero.runtime.elastic.policy import replan

    crawl = {"base": "cpu", "vendor": "emu-b", "slowdown": 100.0}
    with_slow = {**ONE_FAST, "devices": {**ONE_FAST["devices"], "cpu-crawl": crawl},
                 "groups": [*ONE_FAST["groups"], {"name": "slow", "device": "cpu-crawl", "nodes": 1,
                                                  "devices_per_node": 1}]}
    model = hetero.load_model(GPT)
    best = replan(hetero.load_cluster(with_slow), model,
                  hetero.load_plan(_plan([{"micro_batches": 4, "stages": [{"group": "fast", "layers": [0, 4]}]}])))
    assert set(best.plan.devices_by_group()) == {"fast"}, best.one_line     # the premise: slow stays idle
    printed: list = []
    path = _write(tmp_path, "cluster.yaml", ONE_FAST)
    watch = ClusterWatch(path, hetero.load_cluster(ONE_FAST), model, best.plan, print_fn=printed.append)
    _write(tmp_path, "cluster.yaml", with_slow)
    assert watch.poll() is None and watch.pending is None
    assert any("no pause" in line for line in printed), printed
    assert watch.attach(None).num_devices == 2      # a later failure is replanned on the cluster as it is


def test_a_change_while_another_is_pending_replaces_it(tmp_path):
    """Devices join (a pause is asked for), then the file goes back before the ranks paused: the ranks
    may already be pausing, so the second change replaces the first instead of cancelling it."""
    from hetero.runtime.elastic.protocol import PAUSE_REQUEST

    printed: list = []
    path, watch = _watch(tmp_path, ONE_FAST, printed)
    run_dir = tmp_path / "attempt"
    run_dir.mkdir()
    watch.attach(str(run_dir))
    _write(tmp_path, "cluster.yaml", CLUSTER)
    first = watch.poll()
    assert first is not None and (run_dir / PAUSE_REQUEST).exists()
    time.sleep(0.01)
    _write(tmp_path, "cluster.yaml", ONE_FAST)
    second = watch.poll()
    assert second is not None and watch.take() is second and second.cluster.num_devices == 1
    assert (run_dir / PAUSE_REQUEST).exists() and not any("no pause" in line for line in printed), printed


def _launch_and_act(tmp_path, cluster: dict, plan: dict, steps: int, marker: str, act, *extra: str,
                    lr: float = LR):
    """An elastic launch of ``steps`` steps; once ``run/attempt0/<marker>`` exists, ``act(run_dir, output)``
    where ``output`` is the list of stdout lines read so far (a thread keeps appending to it, so ``act``
    can wait for the run to reach a step). Returns the process's return code, stdout and stderr (no
    process may be left behind)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hetero", "launch", "--cluster", _write(tmp_path, "cluster.yaml", cluster),
           "--model", _write(tmp_path, "model.yaml", GPT), "--plan", _write(tmp_path, "plan.yaml", plan),
           "--steps", str(steps), "--seed", "0", "--lr", str(lr), "--summary", str(tmp_path / "summary.json"),
           "--timeout", "20", "--run-dir", str(run_dir), "--elastic", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)   # so a timeout can end its whole tree
    output: list[str] = []
    errors: list[str] = []
    readers = [threading.Thread(target=lambda pipe=pipe, into=into: into.extend(pipe), daemon=True)
               for pipe, into in ((proc.stdout, output), (proc.stderr, errors))]
    for reader in readers:
        reader.start()
    try:
        path = run_dir / "attempt0" / marker
        deadline = time.time() + 120
        while not path.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert path.exists(), f"{marker} never appeared"
        act(run_dir, output)
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:   # the launcher, its node launchers (sessions of their own) and workers
            end_launcher(proc, str(run_dir))
        for reader in readers:
            reader.join(timeout=10)
    assert not _leftover(run_dir), "worker or launcher processes left behind"
    return proc.returncode, "".join(output), "".join(errors)


def _wait_for_step(output: list[str], step: int, timeout: float = 120.0) -> None:
    """Until rank 0 has printed ``step <step>`` (its per-step line) to the launch's stdout."""
    deadline = time.time() + timeout
    while not any(line.split()[:2] == ["step", str(step)] for line in list(output)):
        assert time.time() < deadline, f"step {step} was never printed:\n" + "".join(output)[-2000:]
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_worker_is_a_lost_device(tmp_path):
    """SIGKILL, no report: the device is removed, the run finishes every step."""
    steps = 150   # the kill lands a step or two after step 5 is printed: well before the end

    def kill_rank2(run_dir, output):
        _wait_for_step(output, 5)   # mid-run on any machine, however slow its start
        os.kill(int((run_dir / "attempt0" / "rank2.pid").read_text()), signal.SIGKILL)

    rc_, out, err = _launch_and_act(tmp_path, CLUSTER, REPLICATED, steps, "rank2.training", kill_rank2, lr=1e-3)
    assert rc_ == 0, out[-2000:] + err[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    (rc,) = summary["reconfigurations"]
    assert "rank 2" in rc["reason"] and "died without reporting" in rc["reason"]
    assert summary["steps"] == steps and len(summary["iteration_times_s"]) == steps
    # at most one step's loss is unknown: updated everywhere, its closing all-reduce lost with rank 2
    assert sum(loss is None for loss in summary["losses"]) <= 1
    assert 1 < rc["step"] < steps


@pytest.mark.parametrize("extra, words", [
    (("--engine", "deepspeed"), "--elastic with --engine deepspeed"),
])
def test_what_elastic_cannot_recover_is_refused_up_front(tmp_path, extra, words):
    _, proc = _elastic(tmp_path, REPLICATED, *extra, timeout=60, check=False)
    assert proc.returncode == 1 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_zero_run_that_loses_a_rank_goes_on_in_process_with_the_losses_of_a_run_that_lost_nothing(tmp_path):
    """ZeRO-1 keeps each optimizer slice on one rank, and a copy of it in the next rank's host memory
    (hetero.runtime.elastic.slice_copies): rank 1 is lost, the survivors rebuild its slices from its
    peer's copy and reshard in-process (same processes), and the losses are those of a run that lost
    nothing; no process is left behind (``_launch`` checks)."""
    summary, proc = _elastic(tmp_path, {**REPLICATED, "zero_stage": 1}, "--inject-failure", "2:1", timeout=200)
    _assert_matches(summary, GPT)
    (rc,) = summary["reconfigurations"]
    assert rc["step"] == 2 and rc["path"] == "in-process" and rc["pids_kept"] is True, rc
    assert rc["bytes_moved"] == rc["intersection_bytes"] and None not in summary["losses"], rc
    assert "going on from the checkpoint" not in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_zero_run_that_loses_a_rank_goes_on_from_its_checkpoint_and_trains_the_lost_steps_again(tmp_path,
                                                                                                   monkeypatch):
    """A loss the peers' copies cannot cover (rank 1 never sends its copies, as when it is lost during
    a transfer), with a checkpoint to go on from (the one the run was ``--load``-ed from): the
    survivors say why and take the whole state from it in-process, the lost steps are said, and the
    run trains them again, continuing the single-device reference."""
    from hetero.runtime.elastic.slice_copies import WITHHOLD_ENV

    plan = {**REPLICATED, "zero_stage": 1}
    ckpt = str(tmp_path / "ckpt")
    for d in ("save", "resume"):
        (tmp_path / d).mkdir()
    _launch(tmp_path / "save", GPT, plan, "--steps", "2", "--save", ckpt)
    monkeypatch.setenv(WITHHOLD_ENV, "1")
    summary, proc = _elastic(tmp_path / "resume", plan, "--load", ckpt, "--steps", str(STEPS - 2),
                             "--inject-failure", "4:1")
    (rc,) = summary["reconfigurations"]
    assert rc["step"] == 4 and rc["path"] == "in-process" and rc["pids_kept"] is True, rc
    assert "going on from the checkpoint" in proc.stdout and "steps 3-3 are lost" in proc.stdout, proc.stdout
    assert "holds no copy of lost rank 1's optimizer slices as of step 3" in proc.stdout, proc.stdout
    losses, _ = _reference(GPT)
    got = summary["losses"]   # the steps before the --load are not this run's
    assert got[:2] == [None, None] and got[2:] == pytest.approx(losses[2:], rel=1e-3), (got, losses)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_zero_runs_take_in_devices_that_join(tmp_path):
    """Every rank is alive at a pause, so each ZeRO rank gathers its stage's moments whole and the
    devices that join are taken in in-process (the running ranks keep their processes), with the
    losses of a run that changed nothing."""
    plan = _plan([{"replicas": 2, "micro_batches": 2, "stages": [{"group": "fast", "layers": [0, 4]}]}],
                 zero_stage=1)
    summary, out = _launch_then_edit(tmp_path, TWO_FAST, plan, CLUSTER, "--trace", str(tmp_path / "trace.json"))
    _assert_matches(summary, GPT, steps=EDIT_STEPS, lr=EDIT_LR)
    (rc,) = summary["reconfigurations"]
    assert (rc["devices_added"], rc["world_size_before"]) == (2, 2) and None not in summary["losses"]
    assert "the run goes on only from a" in " ".join(out.split())   # the caveat (wrapped to the terminal)
    assert rc["path"] == "in-process" and rc["pids_kept"] is True, rc
    assert rc["bytes_moved"] == rc["intersection_bytes"] and 0 < rc["reshard_time_s"] < 60
    pids = {int((tmp_path / "run" / "attempt0" / f"rank{r}.pid").read_text()) for r in range(2)}
    assert {int(p) for p in rc["survivor_pids"].values()} == pids
    run_files = [str(p) for p in (tmp_path / "run").rglob("*")]
    assert not [f for f in run_files if "handoff" in f or "paused" in f], run_files
    assert "reconfigurations" in out and "+2 / -0" in out     # the launcher's closing table


# ---------------------------------------------------------------------------- devices that come and go on purpose

ONE_FAST = local_cluster(devices=(1, 0))
TWO_FAST = local_cluster(devices=(2, 0))


def _watch(tmp_path, loaded: dict, printed: list):
    import hetero
    from hetero.runtime.elastic.watch import ClusterWatch

    path = _write(tmp_path, "cluster.yaml", loaded)
    plan = hetero.load_plan(_plan([{"micro_batches": 4, "stages": [{"group": "fast", "layers": [0, 4]}]}]))
    return path, ClusterWatch(path, hetero.load_cluster(loaded), hetero.load_model(GPT), plan,
                              print_fn=printed.append)


def test_a_changed_cluster_file_is_planned_for_and_asks_the_attempt_to_pause(tmp_path):
    from hetero.runtime.elastic.protocol import PAUSE_REQUEST

    printed: list = []
    path, watch = _watch(tmp_path, ONE_FAST, printed)
    run_dir = tmp_path / "attempt"
    run_dir.mkdir()
    watch.attach(str(run_dir))
    assert watch.poll() is None and not (run_dir / PAUSE_REQUEST).exists()    # the file says what was loaded
    _write(tmp_path, "cluster.yaml", CLUSTER)
    change = watch.poll()
    assert change is not None and (run_dir / PAUSE_REQUEST).exists()
    assert (change.added, change.removed) == (3, 0) and change.cluster.num_devices == 4
    assert "group 'fast' 1 -> 2, group 'slow' 0 -> 2" in change.reason and path in change.reason
    assert sum(change.result.plan.devices_by_group().values()) >= 2    # the new plan uses what joined
    assert watch.take() is change and watch.take() is None


def test_a_file_still_being_written_is_read_once_it_settles(tmp_path):
    """A writer that is not done yet (here: one whole cluster, then another 50 ms later) is waited
    for: the change is the final file's, not the first version's."""
    import threading

    printed: list = []
    _, watch = _watch(tmp_path, ONE_FAST, printed)
    watch.settle_s = 0.5     # the rest comes 50 ms after the first part: a wide margin on a loaded machine
    _write(tmp_path, "cluster.yaml", TWO_FAST)
    rest = threading.Timer(0.05, lambda: _write(tmp_path, "cluster.yaml", CLUSTER))
    rest.start()
    change = watch.poll()
    rest.join()
    assert change is not None and (change.added, change.removed) == (3, 0), printed


@pytest.mark.parametrize("text, words", [
    ("groups: [", "cannot be used"),                                            # not YAML
    (None, "cannot be used"),                                                   # a field wrong
    ("same", None),                                                             # reformatted only
])
def test_an_unusable_or_unchanged_cluster_file_leaves_the_run_as_it_was(tmp_path, text, words):
    import yaml

    printed: list = []
    path, watch = _watch(tmp_path, ONE_FAST, printed)
    watch.poll()
    if text == "same":   # the same cluster written otherwise (flow style): not a change
        text = yaml.safe_dump(ONE_FAST, default_flow_style=True)
    elif text is None:
        text = yaml.safe_dump({**ONE_FAST, "groups": [{**ONE_FAST["groups"][0], "devices_per_node": 0}]})
    time.sleep(0.01)
    with open(path, "w") as f:
        f.write(text)
    assert watch.poll() is None and watch.pending is None
    if words:
        assert any(words in line for line in printed), printed
    else:
        assert printed == []


def test_a_cluster_file_that_no_plan_fits_is_said_and_ignored(tmp_path):
    import hetero
    from hetero.runtime.elastic.watch import ClusterWatch

    printed: list = []
    path = _write(tmp_path, "cluster.yaml", ONE_FAST)
    big = hetero.load_plan(_plan([{"micro_batches": 4, "stages": [{"group": "fast", "layers": [0, 4]}]}], gbs=8))
    watch = ClusterWatch(path, hetero.load_cluster(ONE_FAST), hetero.load_model(GPT), big, print_fn=printed.append)
    tiny_memory = {**ONE_FAST, "devices": {**ONE_FAST["devices"],
                                          "cpu-emu-a": {**ONE_FAST["devices"]["cpu-emu-a"], "memory": "1 MiB"}}}
    _write(tmp_path, "cluster.yaml", tiny_memory)
    assert watch.poll() is None and watch.pending is None
    assert any("no plan fits" in line and "goes on as it was" in line for line in printed), printed


EDIT_STEPS, EDIT_LR = 100, 1e-3
"""Steps of a run whose cluster file is edited once its first worker has started: the watch sees the
edit within its poll (0.5 s) and plans for it while the run trains, so the run must train for
seconds after its workers start (forked workers start within a second; steps take about 30 ms);
and its learning rate, smaller than the suite's so that two layouts' reduction orders stay within
the reference's tolerance over every step."""


def _launch_then_edit(tmp_path, start: dict, plan: dict, edited: dict, *extra: str):
    """Launch on ``start``; once the launcher has prepared the first attempt, write ``edited`` over its
    cluster file. Returns the summary and the launcher's output."""
    code, out, err = _launch_and_act(tmp_path, start, plan, EDIT_STEPS, "rank0.pid",
                                     lambda _run_dir, _output: _write(tmp_path, "cluster.yaml", edited), *extra,
                                     lr=EDIT_LR)
    assert code == 0, out[-3000:] + err[-3000:]
    return json.loads((tmp_path / "summary.json").read_text()), out


JOIN_STEPS = 120
"""Steps of the join test: the joiners' start-up (forked from the launcher's fork server, then their
model, process groups and regions: about a second) overlaps training, so the run must still be
training when they are ready (about 4 s of steps on the idle machine)."""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_devices_that_join_are_taken_in_in_process_with_the_losses_of_a_run_that_changed_nothing(tmp_path):
    """One device, then the cluster file grows to four: the joining processes start while the rank
    trains, then the rank pauses and every rank reshards in-process (the old rank keeps its process;
    nothing is handed off through the disk), with the losses of a run on the one device."""
    plan = _plan([{"micro_batches": 4, "stages": [{"group": "fast", "layers": [0, 4]}]}])
    code, out, err = _launch_and_act(tmp_path, ONE_FAST, plan, JOIN_STEPS, "rank0.training",
                                     lambda _run_dir, _output: _write(tmp_path, "cluster.yaml", CLUSTER),
                                     "--quiet", lr=1e-3)
    assert code == 0, out[-3000:] + err[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    (rc,) = summary["reconfigurations"]
    assert rc["path"] == "in-process" and rc["pids_kept"] is True, rc
    assert rc["world_size_before"] == 1 and rc["world_size_after"] >= 2 and rc["joiners"] >= 1
    assert (rc["devices_added"], rc["devices_removed"], rc["devices_left"]) == (3, 0, 4)
    assert rc["bytes_moved"] == rc["intersection_bytes"] > 0
    # the joiners started while training went on; the pause request came once they were ready
    assert rc["joiner_start_s"] > 0 and 0 <= rc["detect_s"] <= rc["reshard_time_s"] < 60
    # ... and the running rank had prepared its new regions at a step boundary (not the wait's bound)
    from hetero.runtime.elastic.joiners import PREPARE_WAIT_S

    assert 0 <= rc["prepare_wait_s"] < PREPARE_WAIT_S
    for k in ("agree_replan_s", "regroup_s", "transfer_s", "rebuild_s"):
        assert 0 <= rc[k] <= rc["reshard_time_s"], (k, rc)
    first = int((tmp_path / "run" / "attempt0" / "rank0.pid").read_text())
    assert [int(p) for p in rc["survivor_pids"].values()] == [first]
    run_files = [str(p) for p in (tmp_path / "run").rglob("*")]
    assert not [f for f in run_files if "handoff" in f or f.endswith(".paused")], run_files
    assert len(summary["ranks"]) == rc["world_size_after"] and None not in summary["losses"]
    # the same steps on the one device (a launch: the reference process would take far longer); a
    # smaller learning rate than the other tests': over hundreds of steps at 1e-2 the reduction order
    # alone makes runs drift apart
    (tmp_path / "clean").mkdir()
    clean, _ = _launch(tmp_path / "clean", GPT, plan, "--steps", str(JOIN_STEPS), "--lr", "1e-3", cluster=ONE_FAST)
    assert summary["steps"] == clean["steps"] == JOIN_STEPS, rc
    assert summary["losses"] == pytest.approx(clean["losses"], rel=1e-3), rc["step"]
    assert summary["grad_norms"] == pytest.approx(clean["grad_norms"], rel=1e-3), rc["step"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_device_removed_from_the_file_is_drained_without_losing_a_step(tmp_path):
    plan = _plan([{"replicas": 2, "micro_batches": 2, "stages": [{"group": "fast", "layers": [0, 4]}]}])
    summary, _ = _launch_then_edit(tmp_path, TWO_FAST, plan, ONE_FAST)
    _assert_matches(summary, GPT, steps=EDIT_STEPS, lr=EDIT_LR)
    (rc,) = summary["reconfigurations"]
    assert (rc["world_size_before"], rc["world_size_after"]) == (2, 1)
    assert (rc["devices_added"], rc["devices_removed"]) == (0, 1)
    assert None not in summary["losses"]      # a pause loses no step result, unlike a failure
    # a device that leaves is taken out in-process: the processes stay, the state moves rank to rank
    assert rc["path"] == "in-process" and rc["pids_kept"] is True
    assert rc["bytes_moved"] == rc["intersection_bytes"]
    pids = {int((tmp_path / "run" / "attempt0" / f"rank{r}.pid").read_text()) for r in range(2)}
    assert {int(p) for p in rc["survivor_pids"].values()} == pids and summary["pid"] in pids

