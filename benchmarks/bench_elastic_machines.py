"""Elastic benchmark across machines: a lost worker and a lost machine, survived in-process.

Two loopback hosts stand for two machines (127.0.0.1 and 127.0.0.2, as tests/test_elastic_machines.py
does), one ``hetero launch --elastic --node-rank R`` call each, in sessions of their own. The cluster
is configs/clusters/local-cpu.yaml with group ``fast`` (emu-a, 2 devices) on 127.0.0.1 and ``slow``
(emu-b, 2 devices) on 127.0.0.2, both at full speed (no slowdown: two machines alike). The model is
the 109M GPT of bench_elastic.py ``--launch-live`` (8 layers, hidden 1024, vocab 8192, seq 64;
``--quick``: the tests' tiny GPT); the plan is one two-stage pipeline per machine (layers 0-3 and 4-7
on ``fast``, the same on ``slow``: two data-parallel replicas, one per machine, 4 workers), global
batch 8 of micro-batch 1, AdamW at lr 1e-3, seed 0, 6 steps. Each round runs, in this order:

1. the same two transitions through torch.distributed.checkpoint: bench_reshard_live.py's round on
   this cluster and plan (four processes build their stage and take one AdamW step; the lost ranks
   exit; the survivors ``dcp.save`` their state to /dev/shm and each rank of the new plan
   ``dcp.load``s its own: ``dcp_s`` = save + load, ``dcp_save_s`` the save alone), once losing rank 3
   (the worker) and once losing ranks 2 and 3 (the machine), with the live exchange over
   torch.distributed (``HETERO_RESHARD_TRANSPORT=p2p``, as across machines); on one machine, so
   /dev/shm stands for a shared file system as fast as memory;
2. *a lost worker*: both calls with ``--inject-failure 3:3`` (rank 3, node slot 1's stage-1 worker,
   dies at step 3); its machine's launcher reports the exit through the coordinator's store;
3. *a lost machine*: both calls; once node slot 0's call prints step 2, node slot 1's call and its
   workers are SIGKILLed at once (``os.killpg`` of its session). Node slot 0's launcher counts them
   lost once that machine's heartbeat has stood still for ``--machine-lost-after`` (2.0 s, the
   default, unless given).

Per scenario it reads the ``reconfigurations`` entry of node slot 0's summary: detect (the failure ->
the last survivor out of its step), failure -> loss declared and every survivor checked in
(``handoff_time_s``: for a lost machine, the heartbeat's silence reaching ``--machine-lost-after``),
agree + replan, regroup, transfer, rebuild, and the downtime (``reshard_time_s``: the failure -> the
last survivor ready for its first step; for a lost machine the failure is its launcher's last
heartbeat, at most 0.2 s before the kill, so the detection is all in it); the bytes moved against the
intersection volume, the transport, the survivors' process ids, the new plan, and the losses against
one run of the whole model on one device (the step a lost machine took with it has no loss; at most
one). After each launch it checks that no process naming either call's run directory is left.
Medians over the rounds (default 3). Prints the issue's targets (lost worker's downtime <= 2.0 s,
lost machine's <= 3.0 s, both including detection), the DCP save + load of the same transition
beside each downtime and each live transition (regroup + transfer), and exits 1 when a target is
missed, a loss differs by more than 1e-3 relative, bytes moved differ from the intersection volume,
a reconfiguration was not in-process, or a process was left, after writing
benchmarks/results/elastic_machines.json (``--quick``: nothing written unless ``--out``).

    .venv/bin/python benchmarks/bench_elastic_machines.py [--rounds 3] [--machine-lost-after 2.0] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import bench_reshard_live  # noqa: E402
from _spawn import end_launcher, free_port, processes_naming  # noqa: E402
from bench_elastic import CLUSTER, GPT109, _gpt109_files, _gpt109_launch, _targets  # noqa: E402

TINY = {"name": "tiny", "architecture": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
        "vocab_size": 512, "seq_length": 32, "dtype": "fp32", "tie_embeddings": True}
HOSTS = {"fast": "127.0.0.1", "slow": "127.0.0.2"}
LOST_WORKER = 3            # node slot 1's stage-1 worker
LOST_MACHINE = (2, 3)      # node slot 1's workers
FAIL_AT = 3
KILL_AFTER_STEP = 2
STEPS = 6
TARGETS = {"worker": 2.0, "machine": 3.0}
LOSS_RTOL = 1e-3
KEYS = ("detect_s", "handoff_time_s", "agree_replan_s", "regroup_s", "transfer_s", "rebuild_s", "reshard_time_s")


def machines_cluster() -> dict:
    """local-cpu.yaml with each group on a host of its own, both at full speed."""
    cluster = yaml.safe_load(CLUSTER.read_text())
    cluster["name"] = "local-cpu-two-hosts"
    for device in cluster["devices"].values():
        device.pop("slowdown", None)
    for group in cluster["groups"]:
        group["hosts"] = [HOSTS[group["name"]]]
    return cluster


def machines_plan(layers: int) -> dict:
    """One two-stage pipeline per machine: two data-parallel replicas, one on each host."""
    half = layers // 2
    return {"global_batch_size": 8, "micro_batch_size": 1, "schedule": "1f1b", "recompute": "none", "zero_stage": 0,
            "pipelines": [{"micro_batches": 4, "stages": [{"group": g, "layers": [0, half]},
                                                          {"group": g, "layers": [half, layers]}]}
                          for g in ("fast", "slow")]}


class Cluster:
    """The files of one benchmark run under ``tmp`` and the two calls' commands."""

    def __init__(self, tmp: Path, model_d: dict, lost_after_s: float):
        self.tmp, self.model_d, self.lost_after_s = tmp, model_d, lost_after_s
        self.model, self.one_cluster, self.one_plan = _gpt109_files(tmp, model_d)
        self.cluster_d, self.plan_d = machines_cluster(), machines_plan(model_d["num_layers"])
        self.cluster, self.plan = tmp / "two-hosts.yaml", tmp / "two-hosts-plan.yaml"
        self.cluster.write_text(yaml.safe_dump(self.cluster_d))
        self.plan.write_text(yaml.safe_dump(self.plan_d))

    def reference(self) -> list[float]:
        """The losses of the whole model on one device (same seed, data and learning rate)."""
        out = self.tmp / "reference.json"
        proc = subprocess.run(_gpt109_launch(self.one_cluster, self.model, self.one_plan, STEPS, out),
                              capture_output=True, text=True, cwd=ROOT, timeout=900)
        if proc.returncode:
            sys.exit(f"single-device run failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())["losses"]

    def start(self, name: str, *extra: str, quiet_slot0: bool = True) -> list[subprocess.Popen]:
        """Both calls of scenario ``name``, each in a session of its own, output to files under tmp."""
        port = free_port()
        procs = []
        for slot in (0, 1):
            cmd = _gpt109_launch(self.cluster, self.model, self.plan, STEPS, self.tmp / f"{name}-s{slot}.json",
                                 "--elastic", "--node-rank", str(slot), "--master-port", str(port), "--run-dir",
                                 str(self.run_dir(name, slot)), "--machine-lost-after", str(self.lost_after_s),
                                 *extra)
            if slot == 0 and not quiet_slot0:   # its step lines time the machine's loss
                cmd.remove("--quiet")
            with open(self.tmp / f"{name}-{slot}.out", "w") as out, open(self.tmp / f"{name}-{slot}.err", "w") as err:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, start_new_session=True))
        return procs

    def run_dir(self, name: str, slot: int) -> Path:
        return self.tmp / f"{name}-run{slot}"

    def stderr(self, name: str, slot: int) -> str:
        return (self.tmp / f"{name}-{slot}.err").read_text()[-3000:]

    def finish(self, name: str, procs: list[subprocess.Popen], expect: tuple) -> int:
        """Wait for both calls (their exit statuses must be ``expect``: None for one killed); returns how
        many processes naming either run directory outlived them (waited for up to 10 s: a worker
        whose launcher was killed takes a moment to go), then ends whatever is left."""
        try:
            for slot, p in enumerate(procs):
                code = p.wait(timeout=900)
                if expect[slot] is not None and code != expect[slot]:
                    sys.exit(f"{name}: node slot {slot}'s call exited {code}:\n{self.stderr(name, slot)}")
            deadline = time.monotonic() + 10
            while True:
                left = [pid for slot in (0, 1) for pid in processes_naming(str(self.run_dir(name, slot)))]
                if not left or time.monotonic() > deadline:
                    return len(left)
                time.sleep(0.1)
        finally:
            for slot, p in enumerate(procs):
                end_launcher(p, str(self.run_dir(name, slot)))

    def lost_worker(self) -> dict:
        procs = self.start("worker", "--inject-failure", f"{FAIL_AT}:{LOST_WORKER}")
        left = self.finish("worker", procs, (0, 0))
        return {**self._summary("worker"), "processes_left": left}

    def lost_machine(self) -> dict:
        procs = self.start("machine", quiet_slot0=False)
        out = self.tmp / "machine-0.out"
        try:
            deadline = time.monotonic() + 600
            while not re.search(rf"^\s*step\s+{KILL_AFTER_STEP}\b", out.read_text(), re.M):
                if procs[0].poll() is not None or procs[1].poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"machine: no step {KILL_AFTER_STEP} before a call ended or 600 s passed:\n"
                             f"{self.stderr('machine', 0)}\n{self.stderr('machine', 1)}")
                time.sleep(0.02)
            os.killpg(procs[1].pid, signal.SIGKILL)   # its launcher and, through their lifelines, its workers
        except BaseException:
            for slot, p in enumerate(procs):
                end_launcher(p, str(self.run_dir("machine", slot)))
            raise
        left = self.finish("machine", procs, (0, None))
        return {**self._summary("machine"), "processes_left": left}

    def _summary(self, name: str) -> dict:
        summary = json.loads((self.tmp / f"{name}-s0.json").read_text())
        (rc,) = summary["reconfigurations"]
        return {"losses": summary["losses"], "rc": rc}


def _row(i: int, scenario: dict, reference: list[float], dcp: dict) -> dict:
    rc, losses = scenario["rc"], scenario["losses"]
    known = [(x, r) for x, r in zip(losses, reference) if x is not None]
    r = {"round": i, **{k: rc.get(k) for k in KEYS}, "step": rc["step"], "path": rc.get("path"),
         "transport": rc.get("transport"), "world_size_before": rc["world_size_before"],
         "world_size_after": rc["world_size_after"], "bytes_moved": rc.get("bytes_moved"),
         "intersection_bytes": rc.get("intersection_bytes"), "pids_kept": rc.get("pids_kept"), "plan_after": rc["plan"],
         "reason": rc["reason"], "losses_unknown": len(losses) - len(known), "steps": len(losses),
         "max_rel_loss_diff": max(abs(x - ref) / abs(ref) for x, ref in known), "processes_left": scenario["processes_left"],
         "dcp_s": dcp["dcp_s"], "dcp_save_s": dcp["dcp_save_s"], "dcp_new_plan": dcp["new_plan"],
         "standalone_downtime_s": dcp["downtime_s"],
         "standalone_transition_s": dcp["regroup_s"] + dcp["transfer_s"]}
    r["transition_s"] = r["regroup_s"] + r["transfer_s"]
    r["same_new_plan_as_dcp"] = r["plan_after"] == dcp["new_plan"]
    r["dcp_over_downtime"] = r["dcp_s"] / r["reshard_time_s"]
    r["dcp_over_transition"] = r["dcp_s"] / r["transition_s"] if r["transition_s"] > 0 else None
    return r


def _print_row(name: str, r: dict) -> None:
    ratio = f"{r['dcp_over_transition']:.1f}x" if r["dcp_over_transition"] else "n/a"
    print(f"round {r['round']} lost {name}: downtime {r['reshard_time_s']:.2f} s (detect {r['detect_s']:.2f}, loss "
          f"declared and check-ins {r['handoff_time_s']:.2f}, agree+replan {r['agree_replan_s']:.2f}, regroup "
          f"{r['regroup_s']:.2f}, transfer {r['transfer_s']:.2f}, rebuild {r['rebuild_s']:.2f}); before step "
          f"{r['step']}, world {r['world_size_before']} -> {r['world_size_after']}, {r['path']} over "
          f"{r['transport']}; {(r['bytes_moved'] or 0) / 1e6:.0f} MB moved (intersection "
          f"{(r['intersection_bytes'] or 0) / 1e6:.0f} MB); pids kept {r['pids_kept']}; losses vs one device "
          f"{r['max_rel_loss_diff']:.1e} ({r['losses_unknown']} unknown); processes left {r['processes_left']}; "
          f"DCP via /dev/shm {r['dcp_s']:.2f} s (save {r['dcp_save_s']:.2f}; {r['dcp_over_downtime']:.1f}x the "
          f"downtime, {ratio} the live transition; same new plan {r['same_new_plan_as_dcp']})", flush=True)


def _cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _dcp_round(i: int, tmp: Path, setup: Cluster, lost: tuple[int, ...]) -> dict:
    """bench_reshard_live's round of the same transition, its exchange over torch.distributed."""
    from hetero.runtime.reshard.live import TRANSPORT_ENV

    tmp.mkdir()
    before = os.environ.get(TRANSPORT_ENV)
    os.environ[TRANSPORT_ENV] = "p2p"
    try:
        return bench_reshard_live.one_round(i, tmp, setup.cluster_d, setup.model_d, setup.plan_d, lost)
    finally:
        if before is None:
            os.environ.pop(TRANSPORT_ENV, None)
        else:
            os.environ[TRANSPORT_ENV] = before


def run(rounds: int, model_d: dict, lost_after_s: float) -> dict:
    load_before = os.getloadavg()[0]
    rows: dict[str, list[dict]] = {"worker": [], "machine": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        setup = Cluster(tmp, model_d, lost_after_s)
        reference = setup.reference()
        for i in range(rounds):
            # DCP first in each round: on a machine that has just freed the launches' memory, the fresh
            # pages DCP's files take cost more (docs/elastic.md)
            dcp = {"worker": _dcp_round(i, tmp / f"dcp-worker{i}", setup, (LOST_WORKER,)),
                   "machine": _dcp_round(i, tmp / f"dcp-machine{i}", setup, LOST_MACHINE)}
            for name, scenario in (("worker", setup.lost_worker), ("machine", setup.lost_machine)):
                r = _row(i, scenario(), reference, dcp[name])
                rows[name].append(r)
                _print_row(name, r)
    keys = (*KEYS, "transition_s", "dcp_s", "dcp_save_s", "dcp_over_downtime", "standalone_downtime_s",
            "standalone_transition_s")
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in rows.items()}
    for name, rs in rows.items():   # none where nothing moved and no world was formed
        ratios = [r["dcp_over_transition"] for r in rs if r["dcp_over_transition"] is not None]
        med[name]["dcp_over_transition"] = statistics.median(ratios) if ratios else None
    keys = (*keys, "dcp_over_transition")
    print(f"\nacross two machines (127.0.0.1, 127.0.0.2), medians over {rounds} rounds ({model_d['name']}, one "
          f"two-stage pipeline per machine; a worker: rank {LOST_WORKER} at step {FAIL_AT}; the machine: node slot 1 "
          f"killed after step {KILL_AFTER_STEP}, --machine-lost-after {lost_after_s:g} s):")
    print(f"    {'':28s} {'lost worker':>12s} {'lost machine':>13s}")
    for k in keys:
        print(f"    {k:28s} {_cell(med['worker'][k]):>12s} {_cell(med['machine'][k]):>13s}")
    everything = rows["worker"] + rows["machine"]
    checks = {"in_process": all(r["path"] == "in-process" for r in everything),
              "bytes_exact": all(r["bytes_moved"] == r["intersection_bytes"] for r in everything),
              "max_rel_loss_diff": max(r["max_rel_loss_diff"] for r in everything),
              "losses_unknown_at_most_one": all(r["losses_unknown"] <= 1 for r in everything)
              and all(r["losses_unknown"] == 0 for r in rows["worker"]),
              "processes_left": sum(r["processes_left"] for r in everything),
              "pids_kept": all(r["pids_kept"] for r in everything),
              "same_new_plan_as_dcp": all(r["same_new_plan_as_dcp"] for r in everything)}
    print(f"    every reconfiguration in-process: {checks['in_process']}; bytes moved == intersection volume: "
          f"{checks['bytes_exact']}; survivors kept their pids: {checks['pids_kept']}; largest relative loss "
          f"difference vs one device: {checks['max_rel_loss_diff']:.1e}; processes left: {checks['processes_left']}; "
          f"DCP timed on the launched runs' new plan: {checks['same_new_plan_as_dcp']}")
    targets = _targets({
        "lost worker: downtime incl. detection, median (s)": (med["worker"]["reshard_time_s"], "<=", TARGETS["worker"]),
        "lost machine: downtime incl. detection, median (s)": (med["machine"]["reshard_time_s"], "<=",
                                                              TARGETS["machine"])})
    return {"method": __doc__.strip(), "model": model_d, "cluster": machines_cluster(),
            "plan": machines_plan(model_d["num_layers"]), "steps": STEPS, "fail_at": FAIL_AT,
            "lost_worker": LOST_WORKER, "lost_machine_ranks": list(LOST_MACHINE), "kill_after_step": KILL_AFTER_STEP,
            "machine_lost_after_s": lost_after_s, "rounds": rows, "medians": med, "checks": checks, "targets": targets,
            "machine": f"{os.cpu_count()} cores; load average {load_before:.2f} when it started"}


def passed(result: dict) -> bool:
    c = result["checks"]
    return (c["in_process"] and c["bytes_exact"] and c["max_rel_loss_diff"] <= LOSS_RTOL
            and c["losses_unknown_at_most_one"] and c["processes_left"] == 0
            and all(t["met"] for t in result["targets"].values()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--machine-lost-after", type=float, default=2.0, metavar="SEC",
                    help="the calls' --machine-lost-after (default 2.0, the launcher's default)")
    ap.add_argument("--quick", action="store_true", help="the tests' tiny GPT instead of the 109M one (a smoke run)")
    ap.add_argument("--out", type=Path, help="the JSON file (default benchmarks/results/elastic_machines.json; "
                                             "with --quick none unless given)")
    args = ap.parse_args()
    result = run(args.rounds, TINY if args.quick else GPT109, args.machine_lost_after)
    out = args.out or (None if args.quick else ROOT / "benchmarks/results/elastic_machines.json")
    if out:
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return 0 if passed(result) else 1


if __name__ == "__main__":
    sys.exit(main())
