"""``hetero launch``: per-node torchrun invocations from the cluster and the rank layout.

Each node slot of the layout (a node of a group that runs at least one rank) gets one torchrun
with its own ``--nproc-per-node`` (so node types may run different process counts), static
rendezvous with an explicit ``--node-rank`` (torchrun then numbers ranks node by node in
node-rank order, which is the layout's order), the vendor's visible-devices variable, and the run
file (the rank -> group / pipeline / stage map) in ``HETERO_RUN_SPEC``.

Every node slot runs torchrun through :mod:`hetero.runtime.torchrun_loopback` (slot 0 hosts the
rendezvous store and keeps it until the others are done; failures are said in one line, not in
torchelastic's tracebacks).

One machine or several (:func:`machine_keys`): node slots on named hosts are on those hosts (this
machine by any of its names counts once); slots of emulated (``base: cpu``) device types without
hosts run on the launching machine; every node of accelerators without hosts is a machine of its
own, except a single one, which is taken to be this machine (a GPU beside emulated CPU groups).

On one machine the launcher runs all node slots itself, each in its own session, rendezvous on
127.0.0.1 (a free port unless given). A launch over several machines runs one node slot per call
(``--node-rank R`` on each), rendezvous at node slot 0's host or ``--master-addr``, port 29500 (as
torchrun) unless ``--master-port``: every call must arrive at the same address and port. The
launcher watches the workers' pid / ready / done / error files: a rank that fails, dies, or never
arrives ends the job with an error that names the rank and its stage, and every process of the
job is ended (by process id) before returning. A launcher that dies without returning (``kill -9``)
takes its node launchers with it, and they their workers (:mod:`hetero.runtime.lifeline`).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from hetero.backends import registry
from hetero.errors import HeteroError, Problem, clip
from hetero.layout import RankLayout, build_layout
from hetero.runtime.host_memory import huge_pages_env
from hetero.runtime.lifeline import child_env
from hetero.runtime.spec import SLOT_ENV, SPEC_ENV, RunOptions, RunSpec, describe_rank
from hetero.runtime.torchrun_loopback import FORK_ENV, WORKER_MODULE
from hetero.specs.cluster import is_loopback
from hetero.specs.units import plural

NODE_LAUNCHER_MODULE = "hetero.runtime.torchrun_loopback"
DEFAULT_PORT = 29500
"""Rendezvous port of a launch whose node slots start in calls of their own (torchrun's default)."""
THIS_MACHINE = "localhost"
"""The machine key of node slots that run on the launching machine."""


ADDRESS_PLACEHOLDER = "<address of node slot 0>"
"""A dry run's rendezvous address when the cluster names no host for node slot 0 and no
``--master-addr`` is given: the commands are shown, the address left for the user to fill in."""


STARTUP_GRACE_S = 30.0
"""Seconds a node launcher may take to start its first worker before the arrival timeout counts."""


class LaunchError(HeteroError):
    """The job failed; the message names the rank(s) and their stage."""


class RankFailure(LaunchError):
    """An elastic run lost devices: ``lost`` ranks died or were ended (``--inject-failure``) at ``time``,
    and every other rank has reported or is gone (:func:`_lost_devices`)."""

    def __init__(self, message: str, lost: list[int], reason: str, at: float):
        super().__init__(message)
        self.lost, self.reason, self.time = lost, reason, at


@dataclass
class NodeCommand:
    """One node slot's torchrun: its ranks, environment and arguments."""

    slot: int
    group: str
    node: int
    host: str | None
    first_rank: int
    num_ranks: int
    env: dict[str, str]
    """Variables this node's launcher sets (on top of the caller's environment)."""
    torchrun_args: list[str]
    family: str = "cpu"
    """Vendor family of the group's device type (whose backend its workers use)."""
    machine: str | None = THIS_MACHINE
    """Where it runs: its host, ``localhost`` (this machine), or None (a node the cluster names no host for)."""

    def argv(self) -> list[str]:
        """torchrun through :mod:`hetero.runtime.torchrun_loopback` (slot 0 hosts the rendezvous store:
        on a loopback address it listens there only, where torchrun's own would bind every interface),
        run by this interpreter (on another machine: the same path, with hetero and torch installed)."""
        return [sys.executable, "-m", NODE_LAUNCHER_MODULE] + self.torchrun_args

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{env} {shlex.join(self.argv())}".strip()


@dataclass
class Launch:
    """What :func:`prepare` built: the run file, the rank layout and every node's command."""

    spec: RunSpec
    spec_path: str
    layout: RankLayout
    nodes: list[NodeCommand]
    master_addr: str
    master_port: int
    local: bool
    """Every node slot runs on this machine (else one call per slot, ``--node-rank``, on its machine)."""
    owns_run_dir: bool = False
    """The run directory was made for this launch (no ``run_dir`` given): :meth:`remove_run_dir` removes it."""

    def remove_run_dir(self) -> None:
        """Remove the run directory when this launch made it: it holds only the run file and the workers'
        pid / ready / done / error files (summaries, traces and checkpoints go where the options say)."""
        if self.owns_run_dir:
            shutil.rmtree(self.spec.options.run_dir, ignore_errors=True)


def is_this_machine(host: str | None) -> bool:
    """Whether a node's ``host`` (None: not named) is the machine running this process: any loopback
    name or address (``localhost``, 127.0.0.2: node slots on them are started here, one call each
    with ``--node-rank`` or all in one call), or this machine's own name."""
    return host is None or is_loopback(host) or host == socket.gethostname() or host == socket.getfqdn()


def machine_keys(nodes, families: list[str]) -> list:
    """Per node slot, the machine it runs on: :data:`THIS_MACHINE` for a host that is this machine
    (whatever its alias) and for an emulated (CPU) group without hosts, the host name for another
    host, and ``(group, node)`` for a node of accelerators that the cluster does not name, which is
    a machine of its own, unless it is the only one (then it is this machine: a GPU node beside
    emulated groups)."""
    keys: list = []
    for node, family in zip(nodes, families):
        if node.host is not None:
            keys.append(THIS_MACHINE if is_this_machine(node.host) else node.host)
        elif family == "cpu":
            keys.append(THIS_MACHINE)
        else:
            keys.append((getattr(node, "group", None), getattr(node, "node", None)))
    unnamed = {k for k in keys if isinstance(k, tuple)}
    if len(unnamed) == 1:
        keys = [THIS_MACHINE if isinstance(k, tuple) else k for k in keys]
    return keys


def _machine_text(key) -> str:
    """A machine key in words: its host, or ``group/node`` for a node the cluster names no host for."""
    return key if isinstance(key, str) else f"{key[0]}/{key[1]}"


def _rendezvous(cluster, layout: RankLayout, machines: list, master_addr: str | None, master_port: int | None,
                separate: bool, dry_run: bool = False) -> tuple[str, int]:
    """(address, port) of the static rendezvous. One machine: 127.0.0.1 and a free port unless given
    (:data:`DEFAULT_PORT` when the slots start in calls of their own, which must agree on it). Several:
    ``--master-addr`` or the host of node slot 0, never a loopback address, port :data:`DEFAULT_PORT`;
    a dry run without either shows :data:`ADDRESS_PLACEHOLDER` where a launch would refuse."""
    distinct = list(dict.fromkeys(machines))
    if len(distinct) == 1:
        return master_addr or "127.0.0.1", master_port or (DEFAULT_PORT if separate else free_port())
    port = master_port or DEFAULT_PORT
    names = [_machine_text(k) for k in distinct]
    spans = f"the plan runs on {len(names)} machines ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''})"
    first = layout.nodes[0]
    where = f"node slot 0 ({first.group}/{first.node})"
    if master_addr:
        if is_loopback(master_addr):
            raise HeteroError(f"--master-addr {master_addr}: {spans}, which cannot reach a loopback address "
                              f"(fix: give the address of {where}'s machine that the others reach)")
        return master_addr, port
    index = cluster.group_names.index(first.group)
    if first.host is None and dry_run:
        return ADDRESS_PLACEHOLDER, port
    if first.host is None:
        raise HeteroError(str(Problem(
            f"groups[{index}].hosts",
            f"{spans} and the cluster names no host for {where}, where the rendezvous listens",
            f"list each group's machines under 'hosts:', one per node, or give --master-addr with the address "
            f"of {where}'s machine (port {DEFAULT_PORT} unless --master-port)", cluster.source)))
    if is_loopback(first.host):
        raise HeteroError(str(Problem(
            f"groups[{index}].hosts[{first.node}]", f"{first.host!r} holds the rendezvous ({where}), but {spans}, "
            f"which cannot reach a loopback address", "name that machine by an address the others reach, "
            "or give --master-addr", cluster.source)))
    return first.host, port


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port free on ``addr`` now (loopback by default)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def prepare(cluster, model, plan, options: RunOptions, *, master_addr: str | None = None,
            master_port: int | None = None, run_dir: str | None = None, separate: bool = False,
            dry_run: bool = False) -> Launch:
    """Check the plan (and the ``--data`` file), lay out ranks, write the run file and build every
    node's command. ``separate``: each node slot is started by a call of its own (``--node-rank``);
    ``dry_run``: the commands are only shown (an address no file names becomes a placeholder)."""
    from hetero.specs.plan import check_plan, cross_node_tp

    check_plan(plan, cluster, model)
    spanning = cross_node_tp(plan, cluster)
    if spanning:   # predicted and validated (Megatron runs it); this runtime keeps tp inside a node
        pi, si, tp, nodes = spanning[0]
        raise HeteroError(f"pipelines[{pi}].stages[{si}]: tp={tp} spans {nodes} nodes, which hetero predict and "
                          f"validate model but this runtime does not run: its tensor parallelism stays inside a "
                          f"node (fix: tp of at most devices_per_node, with more pipeline stages)")
    from hetero.runtime.moe_checks import check_moe_run

    check_moe_run(plan, model, options.engine)
    if options.engine == "deepspeed":
        from hetero.runtime.ds_engine import check_deepspeed_plan

        check_deepspeed_plan(plan)
    if options.data:
        from hetero.runtime.data import check_data

        check_data(options.data, model.vocab_size, model.seq_length, options.tokenizer)
    layout = build_layout(cluster, plan)
    families = [cluster.device_type(n.group).family for n in layout.nodes]
    machines = machine_keys(layout.nodes, families)
    local = len(set(machines)) == 1
    addr, port = _rendezvous(cluster, layout, machines, master_addr, master_port, separate, dry_run)
    owns_run_dir = not run_dir
    run_dir = run_dir or tempfile.mkdtemp(prefix="hetero-run-")
    os.makedirs(run_dir, exist_ok=True)
    options.run_dir = os.path.abspath(run_dir)
    spec = RunSpec(cluster=cluster.to_dict(), model=model.to_dict(), plan=plan.to_dict(),
                   layout=[r.to_dict() for r in layout.ranks], nodes=[asdict(n) for n in layout.nodes],
                   options=options)
    spec_path = os.path.join(options.run_dir, "run.json")
    spec.save(spec_path)
    commands = []
    first_device = device_offsets(layout.nodes, families)
    for slot, node in enumerate(layout.nodes):
        env = {SPEC_ENV: spec_path, SLOT_ENV: str(slot)}
        family = cluster.device_type(node.group).family
        var = registry.visible_devices_env(family)
        if var:
            env[var] = ",".join(visible_ids(var, first_device[slot], node.num_ranks))
        if local and addr == "127.0.0.1":
            env["GLOO_SOCKET_IFNAME"] = _loopback_ifname()
        env["OMP_NUM_THREADS"] = str(max(1, options.threads))
        if family == "cpu":   # emulated devices: workers forked from their node launcher (see there)
            env[FORK_ENV] = os.environ.get(FORK_ENV, "fork")
            env.update(huge_pages_env())   # their state in huge pages, as device memory (host_memory)
        # c10d's C++ warnings (a store or socket read that fails once a peer is gone, with dozens of
        # stack-frame lines) would bury hetero's one-line failure reports; its errors still print.
        # A TORCH_CPP_LOG_LEVEL set by the user wins.
        if "TORCH_CPP_LOG_LEVEL" not in os.environ:
            env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        args = [f"--nnodes={len(layout.nodes)}", f"--node-rank={slot}", f"--nproc-per-node={node.num_ranks}",
                "--rdzv-backend=static", f"--master-addr={addr}", f"--master-port={port}",
                "--max-restarts=0", "--monitor-interval=0.05",
                f"--log-dir={os.path.join(options.run_dir, 'torchelastic')}",  # else a torchelastic_* dir in /tmp
                "-m", WORKER_MODULE, "--spec", spec_path,
                *options.extra]
        commands.append(NodeCommand(slot=slot, group=node.group, node=node.node, host=node.host,
                                    first_rank=node.first_rank, num_ranks=node.num_ranks, env=env,
                                    torchrun_args=args, family=family,
                                    machine=node.host or (THIS_MACHINE if machines[slot] == THIS_MACHINE else None)))
    return Launch(spec=spec, spec_path=spec_path, layout=layout, nodes=commands, master_addr=addr,
                  master_port=port, local=local, owns_run_dir=owns_run_dir)


def device_offsets(nodes, families: list[str]) -> list[int]:
    """Per node slot: its first device on its machine (:func:`machine_keys`). Slots of one vendor
    family on the same machine (a multi-node group launched on one machine) take consecutive devices
    instead of all starting at device 0; each slot's workers see theirs renumbered from 0 (the
    visible-devices variable)."""
    used: dict[tuple, int] = {}
    out = []
    for node, family, machine in zip(nodes, families, machine_keys(nodes, families)):
        key = (machine, family)
        out.append(used.get(key, 0))
        used[key] = out[-1] + node.num_ranks
    return out


def visible_ids(var: str, first: int, count: int) -> list[str]:
    """Device ids ``first .. first + count - 1`` of those this launcher may use: positions in its own
    visible-devices list when the user restricted it (``CUDA_VISIBLE_DEVICES=2,3 hetero launch``),
    else plain indices. Positions past the list are left for :func:`check_devices_here` to refuse."""
    allowed = [d.strip() for d in os.environ.get(var, "").split(",") if d.strip()]
    if not allowed:
        return [str(first + i) for i in range(count)]
    return [allowed[i] if i < len(allowed) else str(i) for i in range(first, first + count)]


def _loopback_ifname() -> str:
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        names = []
    return "lo" if "lo" in names or not names else ("lo0" if "lo0" in names else names[0])


def dry_run_text(launch: Launch, relaunch: list[str] | None = None) -> str:
    """``--dry-run``: the rank map and every node's environment and torchrun command, as shell text.
    Over several machines it says what each needs, and with ``relaunch`` (this ``hetero launch``
    call's own argument list, without ``--dry-run``) the call to run on each instead."""
    lines = [f"# {plural(len(launch.nodes), 'node slot')}, world size {launch.layout.world_size}, "
             f"rendezvous static at {launch.master_addr}:{launch.master_port}"
             + ("" if is_loopback(launch.master_addr) else " (non-loopback: reachable from the network)"),
             f"# run file (rank -> group / pipeline / stage map): {launch.spec_path}"]
    if launch.master_addr == ADDRESS_PLACEHOLDER:
        lines.append(f"# the cluster file names no host for node slot 0: put its machine's address where "
                     f"{ADDRESS_PLACEHOLDER} stands (or list the groups' machines under 'hosts:', or give "
                     f"--master-addr); a launch without one is refused")
    if not launch.local:
        lines.append(f"# each machine needs: hetero and torch installed for {sys.executable} (the interpreter "
                     f"named below; edit it where another path holds them), and either the run file at "
                     f"{launch.spec_path} (copy it there) for the torchrun commands, or, simpler, the cluster, "
                     f"model and plan files for the `hetero launch --node-rank R` call shown for its slot "
                     f"(which writes its own run file)")
    for r in launch.layout.ranks:
        lines.append(f"#   {describe_rank(r)}  node {r.group}/{r.node} local_rank {r.local_rank}")
    for cmd in launch.nodes:
        last = cmd.first_rank + cmd.num_ranks - 1
        host = cmd.machine or "not named in the cluster file"
        lines.append(f"\n# node slot {cmd.slot}: group {cmd.group} node {cmd.node} host {host}, "
                     f"ranks {cmd.first_rank}-{last} ({plural(cmd.num_ranks, 'process', 'processes')})")
        for k, v in cmd.env.items():
            lines.append(f"export {k}={shlex.quote(v)}")
        lines.append(shlex.join(cmd.argv()))
        if not launch.local:
            call = shlex.join([*(relaunch or ["hetero", "launch", "..."]), "--master-addr", launch.master_addr,
                               "--master-port", str(launch.master_port), "--node-rank", str(cmd.slot)])
            lines.append(f"# or, on that machine: {call}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- running


class _Job:
    """The node launchers this process started, and the workers they started (from pid files)."""

    def __init__(self, launch: Launch, slots: list[int]):
        self.launch, self.slots = launch, slots
        self.procs: dict[int, subprocess.Popen] = {}
        self.run_dir = launch.spec.options.run_dir
        self.ranks = [r for s in slots for r in range(launch.nodes[s].first_rank,
                                                      launch.nodes[s].first_rank + launch.nodes[s].num_ranks)]

    def start(self) -> None:
        for s in self.slots:
            cmd = self.launch.nodes[s]
            env = {**os.environ, **cmd.env, **child_env()}   # it ends when this process does (lifeline)
            self.procs[s] = subprocess.Popen(cmd.argv(), env=env, start_new_session=True)

    def _file(self, rank: int, suffix: str) -> str:
        return os.path.join(self.run_dir, f"rank{rank}.{suffix}")

    def has(self, rank: int, suffix: str) -> bool:
        return os.path.exists(self._file(rank, suffix))

    def worker_pid(self, rank: int) -> int | None:
        try:
            with open(self._file(rank, "pid")) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def errors(self) -> list[dict]:
        out = []
        for r in self.ranks:
            if self.has(r, "error.json"):
                try:
                    with open(self._file(r, "error.json")) as f:
                        out.append(json.load(f))
                except (OSError, ValueError):
                    pass
        return sorted(out, key=lambda e: e.get("time", 0))

    def dead_ranks(self) -> list[int]:
        """Ranks that started, are gone, and left neither a done nor an error file."""
        dead = []
        for r in self.ranks:
            pid = self.worker_pid(r)
            if pid and not _alive_worker(pid) and not self.has(r, "done") and not self.has(r, "error.json"):
                dead.append(r)
        return dead

    def teardown(self, grace_s: float = 3.0) -> None:
        """End every process of the job, by id: node launchers (their sessions) and their workers."""
        for p in self.procs.values():
            if p.poll() is None:
                _signal_group(p.pid, signal.SIGTERM)
        pids = [pid for r in self.ranks if (pid := self.worker_pid(r)) and _alive_worker(pid)]
        for pid in pids:
            _send_signal(pid, signal.SIGTERM)
        deadline = time.time() + grace_s
        while time.time() < deadline and (any(p.poll() is None for p in self.procs.values())
                                          or any(_alive_worker(pid) for pid in pids)):
            time.sleep(0.05)
        for p in self.procs.values():
            if p.poll() is None:
                _signal_group(p.pid, signal.SIGKILL)
        for pid in pids:
            if _alive_worker(pid):
                _send_signal(pid, signal.SIGKILL)
        for p in self.procs.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _alive_worker(pid: int) -> bool:
    """True while ``pid`` is a live (not zombie) hetero worker process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return WORKER_MODULE.encode() in f.read()
    except OSError:
        if sys.platform.startswith("linux"):
            return False
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def _send_signal(pid: int, sig) -> None:
    """``os.kill``, where a process already gone is no error."""
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _signal_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)  # the node launcher leads its own session
    except OSError:
        _send_signal(pid, sig)


def check_node_rank(launch: Launch, node_rank: int | None) -> None:
    """Raise HeteroError unless ``node_rank`` (``--node-rank``) is None or one of the layout's node slots."""
    if node_rank is not None and not 0 <= node_rank < len(launch.nodes):
        raise HeteroError(f"--node-rank {node_rank}: the layout has {len(launch.nodes)} node slots "
                          f"(fix: give 0..{len(launch.nodes) - 1})")


def run(launch: Launch, node_rank: int | None = None, print_fn=print) -> None:
    """Run this machine's node slots to completion; raise LaunchError naming failed ranks."""
    check_node_rank(launch, node_rank)
    if node_rank is not None:
        slots = [node_rank]
    elif launch.local:
        slots = list(range(len(launch.nodes)))
    else:
        machines = list(dict.fromkeys(n.machine or f"{n.group}/{n.node}" for n in launch.nodes))
        raise HeteroError(f"this run spans machines {', '.join(machines)}: run `hetero launch ... --node-rank R` "
                          f"on each, node slot R's machine (see --dry-run for every node's command)")
    check_devices_here(launch, slots)
    if not is_loopback(launch.master_addr):
        where = ("node slot 0's store runs here and listens on every interface" if 0 in slots
                 else "node slot 0's machine")
        print_fn(f"rendezvous on {launch.master_addr}:{launch.master_port} (non-loopback: {where})")
    job = _Job(launch, slots)
    timeout = launch.spec.options.timeout_s
    layout = launch.layout
    previous = catch_termination()
    try:
        job.start()  # inside the try: a node launcher that fails to start ends the ones already started
        started_at, first_seen = time.time(), None
        all_arrived_at = None
        while True:
            time.sleep(0.1)
            codes = {s: p.poll() for s, p in job.procs.items()}
            errors = job.errors()
            failed = {s: c for s, c in codes.items() if c not in (None, 0)}
            if errors or failed:
                time.sleep(0.3)  # let simultaneous reports land, then name the first
                raise _lost_devices(job, layout, timeout) or LaunchError(
                    _failure_message(job, layout, job.errors(), failed))
            if all(c == 0 for c in codes.values()):
                return
            if all(job.has(r, "paused") for r in job.ranks):
                return   # every rank handed off for a cluster change: no need to wait for the exits
            started = [r for r in job.ranks if job.has(r, "pid")]
            now = time.time()
            if started and first_seen is None:
                first_seen = now
            # The clock starts at the first rank's arrival; while none has arrived it runs from the
            # job's start, with STARTUP_GRACE_S for interpreter + torch import (a node launcher that
            # never spawns its workers, e.g. a rendezvous that never completes, must not hang us).
            waited = now - first_seen if first_seen else now - started_at - STARTUP_GRACE_S
            if len(started) < len(job.ranks) and waited > timeout:
                missing = [r for r in job.ranks if r not in started]
                raise LaunchError("ranks never arrived within the timeout ({:g} s): {}".format(
                    timeout, "; ".join(describe_rank(layout.ranks[r]) for r in missing)))
            if len(started) == len(job.ranks) and all_arrived_at is None:
                all_arrived_at = now
            if all_arrived_at and now - all_arrived_at > timeout + 10 and \
                    not all(job.has(r, "ready") for r in job.ranks):
                missing = [r for r in job.ranks if not job.has(r, "ready")]
                raise LaunchError("process group not formed within the timeout ({:g} s); not ready: {}".format(
                    timeout, "; ".join(describe_rank(layout.ranks[r]) for r in missing)))
            dead = job.dead_ranks()
            if dead:
                time.sleep(0.3)
                raise _lost_devices(job, layout, timeout) or LaunchError(
                    _failure_message(job, layout, job.errors(), {}, dead))
    finally:
        teardown_then_restore(previous, job.teardown)


def _lost_devices(job: _Job, layout: RankLayout, timeout: float) -> RankFailure | None:
    """Elastic runs: the ranks whose devices left (ended by ``--inject-failure``, or gone without a
    report), once every other rank has handed off its state and reported, or is gone (at most the
    communicator timeout plus the node launcher's 30 s stop grace). None when the run is not elastic
    or no device left (a rank that raised on a working device ends the run as usual)."""
    if not job.launch.spec.options.elastic:
        return None
    dead = set(job.dead_ranks())   # gone before the survivors' reports: not the cascade that follows
    first_seen = time.time()
    deadline = first_seen + timeout + 30.0
    while time.time() < deadline:
        pending = [r for r in job.ranks if not (job.has(r, "error.json") or job.has(r, "done"))
                   and (pid := job.worker_pid(r)) and _alive_worker(pid)]
        if not pending:
            break
        time.sleep(0.1)
    errors = job.errors()
    injected = [e for e in errors if e.get("kind") == "injected"]
    lost = sorted({e["rank"] for e in injected} | dead)
    if not lost:
        return None
    if injected:
        e = injected[0]
        reason, at = f"failed at step {e.get('step')}: {e.get('message')}", float(e.get("time", first_seen))
    else:
        reason, at = "died without reporting (killed or crashed)", first_seen
    return RankFailure(_failure_message(job, layout, errors, {}, sorted(dead)), lost, reason, at)


def catch_termination() -> dict:
    """SIGTERM / SIGHUP to the launcher raise a LaunchError, so the job is torn down like any failure
    (the node launchers run in sessions of their own: the default action would leave them running).
    Returns the handlers it replaced (none off the main thread, where Python cannot set handlers)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, _frame):
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        raise LaunchError(f"stopped by {signal.Signals(signum).name}: every process of the job was ended")

    previous = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            previous[sig] = signal.signal(sig, handler)
    return previous


def teardown_then_restore(previous: dict, teardown) -> None:
    """Run ``teardown`` with the signals :func:`catch_termination` caught ignored (a second one must
    not cut it short), then put back the handlers it replaced (``previous``)."""
    for sig in previous:
        signal.signal(sig, signal.SIG_IGN)
    teardown()
    for sig, handler in previous.items():
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def check_devices_here(launch: Launch, slots: list[int]) -> None:
    """Before anything starts: every node slot run here whose group holds CUDA / ROCm / Ascend devices
    finds that vendor's software and enough devices on this machine. (Only ``base: cpu`` device types
    are emulated on CPU; without this check each worker would start, import torch and die.)"""
    from hetero.backends import get_backend

    offsets = device_offsets(launch.nodes, [n.family for n in launch.nodes])
    noted = set()
    for s in slots:
        node = launch.nodes[s]
        if not registry.is_accelerator(node.family):
            continue
        backend = get_backend(node.family)
        ok, detail = backend.detect()
        count = backend.device_count() if ok else 0
        need = offsets[s] + node.num_ranks   # slots of this family before it on this host use the first ones
        if count < need:
            have = detail if not ok else f"only {count} {backend.name} device(s) are visible"
            shared = f" (devices {offsets[s]}-{need - 1}: earlier node slots here use the first {offsets[s]})" \
                if offsets[s] else ""
            raise HeteroError(f"group '{node.group}' needs {node.num_ranks} {node.family} device(s) on this machine "
                              f"(node slot {s}){shared}, but {have} (fix: launch on hosts that have "
                              f"them; to emulate the cluster on CPU, give the group a device type with 'base: cpu' "
                              f"and a vendor tag of its own, as configs/clusters/local-cpu.yaml does)")
        if launch.spec.options.engine == "deepspeed" and node.group not in noted:
            noted.add(node.group)
            # Honest about what runs: the DeepSpeed engine is set up with DeepSpeed's CPU accelerator
            # here, so these ranks compute on this host's CPU.
            print(f"note: group '{node.group}' ({node.family}): --engine deepspeed keeps the model on this "
                  f"host's CPU (the native engine places stages on {node.family} devices); its step times "
                  f"are CPU times", file=sys.stderr, flush=True)


def _failure_message(job: _Job, layout: RankLayout, errors: list[dict], failed: dict, dead=None) -> str:
    dead = dead if dead is not None else job.dead_ranks()
    lines = []
    if errors:
        e = errors[0]
        phase = e.get("phase", "training")
        when = f"at step {e.get('step')}" if phase == "training" else f"while {phase}"
        lines.append(f"{e.get('where', 'rank %s' % e.get('rank'))} failed {when}: {e.get('message')}")

    def slot_of(rank: int) -> int:
        return next(n.slot for n in job.launch.nodes if n.first_rank <= rank < n.first_rank + n.num_ranks)

    # torchrun ends the other workers of a node slot when one fails: those are not deaths to report
    failed_slots = {slot_of(e["rank"]) for e in errors if isinstance(e.get("rank"), int)}
    for r in dead:
        if not any(e.get("rank") == r for e in errors) and slot_of(r) not in failed_slots:
            lines.append(f"{describe_rank(layout.ranks[r])} died without reporting (killed or crashed)")
    if not lines:
        for s, code in failed.items():
            n = job.launch.nodes[s]
            lines.append(f"node slot {s} ({n.group} node {n.node}, ranks {n.first_rank}-{n.first_rank + n.num_ranks - 1}) "
                         f"exited with status {code}")
    # ranks that failed with the first one's message (every rank loading another model's checkpoint)
    # are named, not the message again; the others' messages follow, clipped
    same = [e for e in errors[1:] if e.get("message") == errors[0].get("message")]
    if same:
        lines.append("the same on rank{} {}".format("s" if len(same) > 1 else "",
                                                    ", ".join(str(e.get("rank")) for e in same)))
    others = [e for e in errors[1:] if e not in same]
    if others:
        more = f"; and {len(others) - 4} more" if len(others) > 4 else ""
        lines.append("then: " + "; ".join(f"rank {e['rank']}: {clip(e['message'], 160)}" for e in others[:4]) + more)
    return "training failed: " + "\n  ".join(lines)
