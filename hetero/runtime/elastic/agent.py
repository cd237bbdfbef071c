"""The launcher of a machine other than node slot 0's in an elastic run over several machines.

``hetero launch --elastic --node-rank R`` (R > 0) starts node slot R's workers itself, as the
in-process path does on one machine (:mod:`.processes`), pointed at the coordinator's store on node
slot 0's machine (the rendezvous address, port + :data:`~.protocol.COORDINATOR_PORT_OFFSET`),
where node slot 0's launcher decides for every machine (:class:`~.live.LiveRun`). This launcher
only watches and reports, through that store:

- each worker's process id, and when it ends its error report (if it left one) and its exit status,
  and the run summary when it finished as rank 0;
- a heartbeat every :data:`BEAT_S` (a lost machine is one whose heartbeat stops:
  :class:`~.remote.RemoteWorker`);

and does what the coordinator asks: a signal to one of its workers (the lost-peer signal, a kill).
A call whose node slot the running plan does not have is a machine that joins: it beats and waits
for the coordinator to put ranks there (:func:`~.protocol.join_key`, :mod:`.joiners`), then starts
them as joining workers of the new plan.
It returns when the coordinator says the run is over, ending its workers; when the coordinator's
store is gone without saying so (node slot 0's machine was lost), it ends its workers and fails.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import time

from hetero.errors import HeteroError
from hetero.runtime.elastic.processes import WorkerStarter, end_processes
from hetero.runtime.elastic.protocol import (INITIAL_SLOTS_KEY, JOIN_ENV, RUN_OVER_KEY, SUMMARY_KEY, agent_key,
                                             generation_dir, join_key, worker_key)

BEAT_S = 0.2
"""How often this launcher raises its heartbeat counter."""
POLL_S = 0.01


class NodeAgent:
    """Node slot ``slot``'s launcher (see the module docstring)."""

    def __init__(self, launch, slot: int, host: str, port: int, print_fn=print, options=None, model=None):
        """``launch``: this slot's prepared launch, or None for a machine that may join (then
        ``options`` and ``model`` prepare the new plan's launch once the coordinator names it)."""
        from hetero.runtime.reshard.live import connect

        self.launch, self.slot, self.print_fn, self.model = launch, slot, print_fn, model
        self.options = launch.spec.options if launch is not None else options
        self.host, self.port = host, port
        self.store = connect(port, max(60.0, self.options.timeout_s), host)
        self.procs: dict = {}            # wid -> Popen (or a ForkedWorker)
        self.starter = WorkerStarter(self.options.run_dir)
        if launch is not None and slot < len(launch.nodes):   # the fork server imports while this call sets up
            self.starter.prestart(launch.nodes[slot])
        self.signals_seen: dict[int, int] = {}
        self.published: set[int] = set()   # workers whose process id the coordinator was told
        self.reported: set[int] = set()

    def run(self) -> None:
        """Start this slot's workers and serve the coordinator until the run is over."""
        from hetero.runtime.launcher import catch_termination, teardown_then_restore

        previous = catch_termination()
        try:
            if self.launch is None or self.slot not in self._initial_slots():
                self._join()
            else:
                self._start()
            self._serve()
        finally:
            teardown_then_restore(previous, self._teardown)

    def _start(self) -> None:
        cmd = self.launch.nodes[self.slot]
        world = self.launch.layout.world_size
        for local in range(cmd.num_ranks):
            wid = cmd.first_rank + local
            self.procs[wid] = self.starter.start(cmd, local, world, self.launch.spec_path, self.options.extra,
                                                 self.port, host=self.host)

    def _initial_slots(self) -> list[int]:
        self.store.wait([INITIAL_SLOTS_KEY])
        return json.loads(self.store.get(INITIAL_SLOTS_KEY))

    def _join(self) -> None:
        """A machine that joins: beat while waiting (up to ``--timeout``) for a change of the cluster
        file that puts ranks on this node slot, then start them as joining workers of the new plan,
        prepared here from the plan the coordinator sends."""
        import hetero
        from hetero.runtime.launcher import prepare

        self.print_fn(f"elastic: node slot {self.slot} joins the running run; waiting for the cluster file to "
                      f"put ranks here")
        key, beat, deadline = join_key(self.slot), 0, time.monotonic() + self.options.timeout_s
        while not self.store.check([key]):
            if self.store.check([RUN_OVER_KEY]):
                raise HeteroError("elastic: the run ended before this machine was taken in")
            if time.monotonic() > deadline:
                raise HeteroError(f"elastic: node slot {self.slot} was not taken in within --timeout "
                                  f"{self.options.timeout_s:g} s (fix: add its node to the cluster file that node "
                                  f"slot 0's launcher watches, with a device the planner uses)")
            beat += 1
            self.store.set(agent_key(self.slot, "beat"), str(beat))
            time.sleep(BEAT_S)
        join = json.loads(self.store.get(key))
        cluster = hetero.load_cluster(join["cluster"], "the coordinator's cluster")
        plan = hetero.load_plan(join["plan"], cluster, self.model)
        self.options = dataclasses.replace(self.options, inject_failure=None, load=None)   # as the joiners there
        self.launch = prepare(cluster, self.model, plan, self.options, master_addr=self.host,
                              run_dir=generation_dir(self.options.run_dir, join["gen"]), separate=True)
        cmd = self.launch.nodes[self.slot]
        for local, wid in ((int(k), v) for k, v in join["ids"].items()):
            self.procs[wid] = self.starter.start(cmd, local, self.launch.layout.world_size, self.launch.spec_path,
                                                 self.options.extra, self.port, {JOIN_ENV: f"{join['gen']}:{wid}"},
                                                 host=self.host)

    def _serve(self) -> None:
        beat, next_beat = 0, 0.0
        while True:
            now = time.monotonic()
            try:
                if now >= next_beat:
                    beat += 1
                    self.store.set(agent_key(self.slot, "beat"), str(beat))
                    next_beat = now + BEAT_S
                if self.store.check([RUN_OVER_KEY]):
                    over = self.store.get(RUN_OVER_KEY).decode()
                    self.store.set(agent_key(self.slot, "bye"), "1")
                    if over != "ok":
                        raise HeteroError("elastic: the run ended with a failure (see node slot 0's launcher)")
                    return
                for wid, p in self.procs.items():
                    # a forked worker's id is known once its fork server has its imports: told from
                    # here, so that the heartbeat goes on meanwhile
                    if wid not in self.published:
                        if not getattr(p, "started", True):
                            continue   # signals asked for meanwhile wait in the store
                        self.store.set(worker_key(wid, "pid"), str(p.pid))
                        self.published.add(wid)
                    self._forward_signals(wid, p)
                    if wid not in self.reported and p.poll() is not None:
                        self._report_exit(wid, p.returncode)
            except HeteroError:
                raise
            except Exception as e:  # noqa: BLE001 - the store is gone: node slot 0's machine was lost
                raise HeteroError(f"elastic: lost the coordinator at {self.host}:{self.port} (node slot 0's "
                                  f"machine): {str(e).splitlines()[0][:200]}; this machine's workers are ended "
                                  f"(fix: restart the run from a --save checkpoint)") from None
            time.sleep(POLL_S)

    def _forward_signals(self, wid: int, p) -> None:
        asked = self.store.add(worker_key(wid, "signals"), 0)
        seen = self.signals_seen.get(wid, 0)
        for n in range(seen + 1, asked + 1):
            key = worker_key(wid, f"signal/{n}")
            self.store.wait([key])
            if p.poll() is None:
                p.send_signal(int(self.store.get(key)))
        self.signals_seen[wid] = max(seen, asked)

    def _report_exit(self, wid: int, code: int) -> None:
        """The worker's error report, then its exit status. The report is the one in this machine's
        run directory that names the worker's process: a reconfiguration gives it another rank and
        a generation folder (``gen<g>/rank<r>.error.json``)."""
        pid = self.procs[wid].pid
        for path in sorted(glob.glob(os.path.join(self.options.run_dir, "**", "rank*.error.json"), recursive=True)):
            try:
                with open(path) as f:
                    report = json.load(f)
            except (OSError, ValueError):
                continue
            if report.get("pid") == pid:
                self.store.set(worker_key(wid, "report"), json.dumps(report))
                break
        if code == 0 and self.options.summary and os.path.exists(self.options.summary):   # it finished as rank 0
            with open(self.options.summary) as f:
                self.store.set(SUMMARY_KEY, f.read())
        self.store.set(worker_key(wid, "exit"), str(code))
        self.reported.add(wid)

    def _teardown(self, grace_s: float = 3.0) -> None:
        end_processes(self.procs.values(), grace_s)
        self.starter.close()
