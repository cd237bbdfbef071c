"""Devices that join an in-process elastic run: their processes start while training goes on.

When the ``--cluster`` file grows and the new plan puts ranks on devices that run no process, the
launcher's :class:`~hetero.runtime.elastic.live.LiveRun` holds the pause request back
(:attr:`hetero.runtime.elastic.watch.ClusterWatch.hold`) and :class:`Joiners`

1. starts one worker per new rank at once, with the coordinator's port and :data:`~.protocol.JOIN_ENV`
   (``<generation>:<id>``; the id is the new rank plus the old world size, so it never meets an old
   rank). Each imports what it will need, connects to the store, allocates and touches the regions
   the new plan gives it, and checks in as ready (:func:`~.protocol.ready_key`) while the running ranks keep
   training; the running ranks are told the new plan too (:func:`~.protocol.prepare_key`) and prepare their
   new regions the same way at their next step boundary, so no rank's exchange writes into memory
   mapped in the downtime;
2. once every joiner is ready and every running rank prepared (or :data:`PREPARE_WAIT_S` passed),
   asks the ranks to pause at the next step boundary (the request file
   of :mod:`~hetero.runtime.elastic.watch`); the pause-request -> first-step time then covers only
   the step under way, agree, regroup, transfer and rebuild, not the joiners' start-up. A lone rank
   is stopped at once instead (the launcher's signal, as after a failure): the step under way is
   trained again under the new plan;
3. when every rank paused, publishes the decision: the running ranks keep their devices (the n-th
   of a group takes the new plan's n-th rank there), the joiners take the ranks left, and all of
   them reshard in-process as after a failure, the joiners holding no state
   (:func:`hetero.runtime.elastic.joining.join_run`).

Over several machines (``--node-rank`` calls) a joining rank on another machine than node slot
0's is started by that machine's call (:mod:`.agent`, asked through :func:`~.protocol.join_key`)
and seen through :class:`~.remote.RemoteWorker`.

A joiner that dies before it is ready, or a change replaced meanwhile, drops the joiners: the
pause is then asked for at once and the change goes through the handoff and a restart. The
``reconfigurations`` entry gets the fields of a leave plus ``joiner_start_s`` (start -> every joiner
ready, overlapped with training) and ``reshard_time_s`` measured from the pause request.
"""
from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import time

from hetero.errors import HeteroError
from hetero.runtime.elastic.plans import Ahead, keep_devices, live_applies
from hetero.runtime.elastic.protocol import (JOIN_ENV, PEER_LOST_SIGNAL, generation_dir, prepare_key, prepared_key,
                                             ready_key)
from hetero.runtime.launcher import prepare

PREPARE_WAIT_S = 30.0
"""How long the pause waits, once every joiner is ready, for the running ranks to prepare their new
regions (at their next step boundary); past it they pause unprepared (their exchange then maps its
memory in the downtime)."""


class Joiners:
    """The joining processes of one pending change (see the module docstring)."""

    def __init__(self, run):
        self.run = run   # the LiveRun
        self.change = None
        self.procs: dict[int, subprocess.Popen] = {}   # new rank -> process
        self.members: dict[int, int] = {}
        self.gen = None
        self.started_at = self.ready_at = self.asked_at = None
        self.layout = None

    def holds(self, change) -> bool:
        """The watch's hold: every change waits for :meth:`poll` (a change that needs no new process
        is released there at once)."""
        return True

    # ---------------------------------------------------------------- before the pause
    def poll(self) -> None:
        """One look, from the launcher's watch loop: start the joiners of a new pending change, ask
        for the pause once all are ready, drop them when the change went away."""
        watch, run = self.run.watch, self.run
        change = watch.pending
        if self.change is not None and (change is not self.change or self.gen != run.gen_no + 1):
            self.drop()
        if change is None or self.asked_at is not None:
            return
        if self.change is None:
            if not self._start(change):
                watch.release()   # no new process needed (or not startable here): the pause as before
            return
        store = run.coordinator.store
        for nr, p in self.procs.items():
            if p.poll() is not None:
                run.print_fn(f"elastic: the process for the new plan's rank {nr} ended while starting (exit "
                             f"{p.returncode}): the ranks hand off their state and every worker restarts")
                self.drop()
                self.change, self.gen, self.asked_at = change, run.gen_no + 1, time.time()   # not started again
                watch.release()
                return
        if self.ready_at is None and store.check([ready_key(self.gen, self.id(nr)) for nr in self.procs]):
            self.ready_at = time.time()
        if self.ready_at is not None and (
                store.check([prepared_key(self.gen, r) for r in self.members])
                or time.time() - self.ready_at > PREPARE_WAIT_S):
            self.asked_at = time.time()
            watch.release()
            if len(run.now.procs) == 1:
                # a lone rank agrees with no one: it stops at once (anywhere but in its optimizer update,
                # :meth:`~hetero.runtime.elastic.reconfig.LiveReconfig.recover`) rather than at the end of the
                # step under way, which the new plan trains again; ranks that train together pause at a step
                # boundary, which they all-reduce, so that they pause after the same update
                (p,) = run.now.procs.values()
                if p.poll() is None:
                    p.send_signal(getattr(signal, PEER_LOST_SIGNAL))

    def id(self, new_rank: int) -> int:
        return self.run.now.layout.world_size + new_rank

    def _start(self, change) -> bool:
        from hetero.layout import build_layout

        run, now = self.run, self.run.now
        self.change, self.gen = change, run.gen_no + 1
        layout = build_layout(change.cluster, change.result.plan)
        members = keep_devices(now.layout, layout, sorted(now.procs))
        joining = [i.rank for i in layout.ranks if i.rank not in members.values()]
        if not joining:
            self.asked_at = time.time()
            return False
        opts = dataclasses.replace(run.options, inject_failure=None, load=None)
        try:
            launch = prepare(change.cluster, run.model, change.result.plan, opts,
                             master_addr=run.launch.master_addr, run_dir=generation_dir(run.options.run_dir, self.gen))
        except HeteroError as e:
            run.print_fn(f"elastic: the joining devices' processes cannot be started ({e}): the ranks hand off "
                         f"their state and every worker restarts")
            self.asked_at = time.time()
            return False
        # over several machines (run.slots) the new plan's slots are on other machines too: their ranks are
        # started there, by a call of that machine that joins (.agent)
        if run.slots is None and live_applies(change.result.plan, opts, launch) is not None:
            self.asked_at = time.time()
            return False
        self.layout, self.members = layout, members
        self.started_at = time.time()
        here = run.launch.nodes[0].machine
        for cmd in launch.nodes:
            local_ranks = [(local, cmd.first_rank + local) for local in range(cmd.num_ranks)
                           if cmd.first_rank + local in joining]
            if run.slots is not None and cmd.machine != here and local_ranks:
                self._start_remote(cmd, local_ranks, change)
                continue
            for local, nr in local_ranks:
                self.procs[nr] = run.starter.start(cmd, local, layout.world_size, launch.spec_path, opts.extra,
                                                   run.coordinator.port, {JOIN_ENV: f"{self.gen}:{self.id(nr)}"})
        with open(launch.spec_path) as f:   # its content, not its path: running ranks on other machines read it
            spec = json.load(f)
        for old, nr in members.items():   # the running ranks prepare their new regions while they train
            run.coordinator.store.set(prepare_key(self.gen, old), json.dumps({"spec": spec, "rank": nr,
                                                                             "at": self.started_at}))
        run.print_fn(f"elastic: starting {len(self.procs)} process(es) for the joining devices while training goes "
                     f"on; the ranks pause once they are ready")
        return True

    def _start_remote(self, cmd, local_ranks, change) -> None:
        """Ask the launcher of node slot ``cmd.slot``'s machine (a call that joins) to start these
        ranks; they are seen through the coordinator's store (:class:`~.remote.RemoteWorker`), its
        launcher given ``--timeout`` to be there."""
        from hetero.runtime.elastic.protocol import join_key
        from hetero.runtime.elastic.remote import RemoteWorker

        run = self.run
        run.coordinator.store.set(join_key(cmd.slot), json.dumps({
            "gen": self.gen, "cluster": change.cluster.to_dict(), "plan": change.result.plan.to_dict(),
            "ids": {str(local): self.id(nr) for local, nr in local_ranks}}))
        for _, nr in local_ranks:
            self.procs[nr] = RemoteWorker(run.coordinator.store, self.id(nr), cmd.slot,
                                          lost_after_s=run.options.machine_lost_after_s,
                                          first_beat_s=run.options.timeout_s)
        if cmd.slot not in run.joined_slots:
            run.joined_slots.append(cmd.slot)

    def drop(self) -> None:
        """End the joiners (the change went away, or one of them failed to start)."""
        for p in self.procs.values():
            if p.poll() is None:
                _kill(p)
        self.__init__(self.run)

    def all_procs(self) -> list:
        return list(self.procs.values())

    # ---------------------------------------------------------------- the pause
    def ready_for(self, change, gen: int) -> bool:
        return (change is self.change and self.gen == gen and self.ready_at is not None
                and all(p.poll() is None for p in self.procs.values()))

    def switch(self, step: int, checked_in: float) -> None:
        """Every rank paused: publish the decision with the joiners' ranks and make the new plan current."""
        from hetero.runtime.reshard.live import alive_key, decision_for

        run, now, change, gen = self.run, self.run.now, self.run.watch.take(), self.gen
        ranks = sorted(now.procs)
        members = {**self.members, **{self.id(nr): nr for nr in self.procs}}
        ahead = Ahead(change.cluster, change.result, self.layout)
        transition = run.transition(now, ahead, members, ranks)
        store = run.coordinator.store   # the running ranks' check-ins say where their state is
        transport = run.transport({r: json.loads(store.get(alive_key(gen, r))) for r in ranks})
        pids = {**{r: now.procs[r].pid for r in ranks}, **{self.id(nr): p.pid for nr, p in self.procs.items()}}
        run.coordinator.publish(gen, members, decision_for(
            run.model.to_dict(), (now.cluster.to_dict(), now.plan.to_dict()),
            (change.cluster.to_dict(), change.result.plan.to_dict()), ranks, step, None, transport=transport,
            pids=pids))
        decided = time.time()
        run.print_fn(f"elastic: {now.layout.world_size} rank(s) paused after step {step}; {len(self.procs)} joining "
                     f"process(es) ready; in-process reshard onto {change.result.one_line}")
        rc = {"step": step + 1, "reason": change.reason, "world_size_before": now.layout.world_size,
              "world_size_after": self.layout.world_size, "devices_left": change.cluster.num_devices,
              "devices_added": change.added, "devices_removed": change.removed, "_failed_at": self.asked_at,
              "_launched_at": decided, "handoff_time_s": checked_in - self.asked_at,
              "replan_time_s": change.replan_time_s, "plan": change.result.plan.to_dict(),
              "predicted_tokens_per_s": change.result.tokens_per_s, "path": "in-process", "transport": transport,
              "intersection_bytes": transition.intersection_bytes,
              "predicted_downtime_s": self._predict(transition, members, ranks, change.cluster),
              "joiner_start_s": self.ready_at - self.started_at, "prepare_wait_s": self.asked_at - self.ready_at,
              "joiners": len(self.procs)}
        joiners = [self.id(nr) for nr in self.procs]
        for nr, p in self.procs.items():   # the new plan's processes: the running ones and the joiners
            now.procs[self.id(nr)] = p
        self.__init__(run)
        run.switch(rc, gen, ranks, members, set(), ahead, joiners)

    def _predict(self, transition, members, survivors, cluster) -> float | None:
        from hetero.runtime.reshard.live import exchange_ranks
        from hetero.runtime.reshard.predict import predict_transfer_s

        now = self.run.now
        try:
            world = exchange_ranks(members, survivors)
            infos = {world[r]: (now.layout.ranks[r] if r < now.layout.world_size else self.layout.ranks[world[r]])
                     for r in world}
            return predict_transfer_s(transition, cluster, infos)["transfer_s"]
        except Exception:  # noqa: BLE001 - a prediction must not end a reconfiguration
            return None


def _kill(p) -> None:
    """SIGKILL to a worker: a process here, or one on another machine through its launcher
    (:class:`~.remote.RemoteWorker`); ``Popen.send_signal`` is a no-op for a process already gone."""
    p.send_signal(signal.SIGKILL)
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
