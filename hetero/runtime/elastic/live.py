"""The launcher's side of in-process elastic reconfiguration (``hetero launch --elastic``).

Where it applies (native engine, every node slot on this machine) the launcher
starts each worker itself, one process per rank in a session of its own (not through torchrun,
whose agent ends a node's other workers when one of them fails), and hosts the coordinator's store
(:class:`hetero.runtime.reshard.live.Coordinator`) the workers form their worlds on. The launcher
never holds a tensor; it watches the same processes for the whole run.

When a rank's process ends (a failure, ``--inject-failure``, a kill):

1. *detect*: the survivors' next operation with it fails; each reads its live state and checks in
   under the next generation (:mod:`hetero.runtime.elastic.reconfig`); the launcher waits for every
   process still alive (one silent past the timeout is lost too, and ended);
2. *agree and replan*: the plan for the remaining devices (made for every single loss while the
   first steps trained, so a loss is a look-up), the members and their new ranks (a survivor keeps
   its device), published through the store;
3. *regroup*, *transfer*, *rebuild*: the survivors form the new world in-process, exchange exactly
   the transition's intersections and rebuild their stage, optimizer and engine, then train on from
   the step the state is at. Survivors the new plan leaves out serve their state and exit.

Each survivor puts its timings in the store; the ``reconfigurations`` entry gets them
(docs/formats.md): ``detect_s``, ``agree_replan_s``, ``regroup_s``, ``transfer_s``, ``rebuild_s``,
``bytes_moved`` (every byte sent), ``intersection_bytes`` (the transition's volume),
``predicted_downtime_s`` (:mod:`hetero.runtime.reshard.predict`), the survivors' process ids, and
today's ``handoff_time_s`` (failure -> last check-in), ``replan_time_s``, ``restart_time_s`` (decision
-> last survivor ready) and ``reshard_time_s`` (failure -> last survivor ready: the downtime).

Where no survivor holds a region (a stage without a replica) the ranks go on from the checkpoint the
run was ``--load``-ed from or the ``--save`` directory, if one is there, and the lost steps are
printed; without one the run ends naming the layers. A ZeRO plan (``zero_stage`` 1 or 2) keeps each
optimizer slice on one rank: a change of the cluster file is resharded in-process (every rank gathers
its stage's moments whole before the exchange, :meth:`~hetero.runtime.elastic.reconfig.LiveReconfig.pause`);
after a lost rank the survivors rebuild its slices from the copy a peer keeps in host memory
(:mod:`hetero.runtime.elastic.slice_copies`). A loss those copies cannot cover (a rank and the peer
holding its copy, or a rank lost before its copy of the step's update arrived) goes on from that
checkpoint, or the run ends naming why and the fix.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

from hetero.errors import HeteroError
from hetero.runtime.elastic.plans import Ahead, Generation, assign_ranks
from hetero.runtime.elastic.policy import MAX_RECONFIGURATIONS, refuse_lost_slices, replan
from hetero.runtime.elastic.processes import WorkerStarter, end_processes
from hetero.runtime.elastic.protocol import PEER_LOST_SIGNAL, generation_dir, timing_key
from hetero.runtime.elastic.report import replanned, seconds_cell
from hetero.runtime.launcher import LaunchError, catch_termination, teardown_then_restore

STEP_POLL_S = 0.005


class LiveRun:
    """Run one launch with in-process reconfiguration; see the module docstring."""

    def __init__(self, launch, cluster, model, plan, reconfigurations: list, print_fn=print, on_new_plan=None,
                 watch=None, slots: list[int] | None = None, coordinator_port: int = 0, starter=None):
        """``slots``: the node slots whose workers this process starts (default: all); the others'
        launchers run on their machines (:mod:`.agent`) and their workers are seen through the
        coordinator's store, which listens on ``coordinator_port`` (0: a free one). ``starter``: the
        :class:`~.processes.WorkerStarter` to start workers with, the caller's to close (default:
        one of this run's own, closed at its teardown)."""
        from hetero.runtime.reshard.live import Coordinator

        self.launch, self.model, self.print_fn = launch, model, print_fn
        self.options = launch.spec.options
        self.reconfigurations, self.on_new_plan, self.watch = reconfigurations, on_new_plan, watch
        self.coordinator = Coordinator(coordinator_port, timeout_s=max(60.0, self.options.timeout_s))
        self._own_starter = starter is None
        self.starter = WorkerStarter(self.options.run_dir) if starter is None else starter
        self.slots, self.outcome = slots, "failed"
        self.gen_no = 0
        self.now = Generation(cluster, plan, launch.layout, self.options.run_dir, {})
        self.leaving: list = []
        self.lost_procs: list = []
        self._ahead: dict[frozenset, Ahead] = {}
        self._pending: dict | None = None
        self._plan_after_reshard = False
        self.joiners = None
        self.joined_slots: list[int] = []
        """Node slots of machines that joined (their launchers are told when the run is over too)."""
        if watch is not None:   # devices that join get their processes before the ranks pause
            from hetero.runtime.elastic.joiners import Joiners

            self.joiners = Joiners(self)
            watch.set_hold(self.joiners.holds)

    # ---------------------------------------------------------------- processes
    def start(self) -> None:
        from hetero.runtime.elastic.remote import RemoteWorker

        world = self.launch.layout.world_size
        if self.slots is not None:   # a call with another --node-rank is a machine that joins (.agent)
            from hetero.runtime.elastic.protocol import INITIAL_SLOTS_KEY

            self.coordinator.store.set(INITIAL_SLOTS_KEY, json.dumps([n.slot for n in self.launch.nodes]))
        for cmd in self.launch.nodes:
            for local in range(cmd.num_ranks):
                rank = cmd.first_rank + local
                if self.slots is None or cmd.slot in self.slots:
                    self.now.procs[rank] = self.starter.start(cmd, local, world, self.launch.spec_path,
                                                              self.options.extra, self.coordinator.port)
                else:   # started by its own machine's launcher
                    self.now.procs[rank] = RemoteWorker(self.coordinator.store, rank, cmd.slot,
                                                        lost_after_s=self.options.machine_lost_after_s)
        threading.Thread(target=self._plan_ahead, daemon=True).start()

    def _plan_ahead(self) -> None:
        """The plan for every single loss, made while the workers start and train."""
        from hetero.runtime.reshard import cma

        cma.usable()   # probed once, here, not in a downtime
        now, table, gen = self.now, self._ahead, self.gen_no   # this generation's (a later one starts its own)
        for info in now.layout.ranks:
            try:
                ahead = self._replan({info.rank}, now)
                survivors = [r for r in range(now.layout.world_size) if r != info.rank]
                members = assign_ranks(now.layout, ahead.layout, survivors)
                ahead.transition = self.transition(now, ahead, members, survivors)
                ahead.survivors, ahead.members = tuple(survivors), members
                table.setdefault(frozenset([info.rank]), ahead)
            except Exception:  # noqa: BLE001 - made again (and its error said) when that loss happens
                pass
        # a loss that leaves some region without a copy goes on from a checkpoint: no exchange, nothing
        # to reserve or resolve (said all the same, so that the ranks stop looking)
        aheads = [a for a in table.values() if not a.transition.missing]
        self._publish_reserves(gen, now, aheads)
        self._publish_decisions(gen, now, aheads)

    def _publish_decisions(self, gen: int, now, aheads: list) -> None:
        """The decision for each single loss planned ahead, without what only the loss tells (the
        step, the process ids), for the ranks of generation ``gen`` to resolve at a step boundary
        (:func:`hetero.runtime.reshard.live.resolve`): after a loss their transition is ready."""
        from hetero.runtime.reshard.live import ahead_key, decision_for

        old = (now.cluster.to_dict(), now.plan.to_dict())
        decisions = [{**decision_for(self.model.to_dict(), old, (a.cluster.to_dict(), a.result.plan.to_dict()),
                                     list(a.survivors), 0),
                      "members": {str(k): v for k, v in a.members.items()}} for a in aheads]
        try:
            self.coordinator.store.set(ahead_key(gen), json.dumps(decisions))
        except Exception:  # noqa: BLE001 - the run ended meanwhile: nothing to prepare for
            pass

    def _publish_reserves(self, gen: int, now, aheads: list) -> None:
        """Tell each rank of generation ``gen`` the most state its exchange allocates over the single
        losses planned ahead, for it to keep that much host memory mapped while it trains
        (:meth:`hetero.runtime.elastic.reconfig.LiveReconfig.reserve_ahead`)."""
        from hetero.runtime.reshard.live import reserve_key
        from hetero.runtime.reshard.transfer import reserve_bytes

        space = self._space()
        need = reserve_bytes(space, space.layout_regions(now.plan, now.layout),
                             [(a.members, a.transition, a.result.plan, a.layout) for a in aheads])
        try:
            self.coordinator.store.set(reserve_key(gen), json.dumps(need))
        except Exception:  # noqa: BLE001 - the run ended meanwhile: nothing to prepare for
            pass

    def _file(self, rank: int, suffix: str) -> str:
        return os.path.join(self.now.run_dir, f"rank{rank}.{suffix}")

    def _report(self, rank: int) -> dict | None:
        try:
            with open(self._file(rank, "error.json")) as f:
                return json.load(f)
        except (OSError, ValueError):   # a worker on another machine: its launcher forwarded it
            report = getattr(self.now.procs.get(rank), "report", None)
            return report() if report else None

    def transport(self, checkins: dict) -> str:
        """The exchange's transport: the same-host one only where every worker is on this machine."""
        from hetero.runtime.reshard.live import choose_transport

        return "p2p" if self.slots is not None else choose_transport(checkins)

    def teardown(self, grace_s: float = 3.0) -> None:
        """End every worker still running, by process id."""
        procs = list(self.now.procs.values()) + self.leaving + self.lost_procs
        if self.joiners is not None:
            procs += self.joiners.all_procs()
            self.watch.set_hold(None)
        end_processes(procs, grace_s)
        if self._own_starter:
            self.starter.close()
        if self.slots is not None:   # the other machines' launchers end their workers and return
            self._tell_agents()
        self.coordinator.close()

    remote_summary: dict | None = None
    """The run summary, when rank 0 finished on another machine (its launcher forwarded it)."""

    def _take_remote_summary(self) -> None:
        from hetero.runtime.elastic.protocol import SUMMARY_KEY

        if self.slots is not None and self.coordinator.store.check([SUMMARY_KEY]):
            self.remote_summary = json.loads(self.coordinator.store.get(SUMMARY_KEY))

    def _tell_agents(self, wait_s: float = 5.0) -> None:
        from hetero.runtime.elastic.protocol import RUN_OVER_KEY, agent_key

        store = self.coordinator.store
        store.set(RUN_OVER_KEY, self.outcome)
        others = [n.slot for n in self.launch.nodes if n.slot not in self.slots] + self.joined_slots
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not store.check([agent_key(s, "bye") for s in others]):
            time.sleep(0.01)

    # ---------------------------------------------------------------- the watch
    def run(self) -> Generation:
        """Until every worker of the current plan exited (finished or paused for a cluster change);
        raises HeteroError when the run cannot go on."""
        previous = catch_termination()
        try:
            self.start()
            while True:
                time.sleep(STEP_POLL_S)
                self._collect_timings()
                if self.joiners is not None:
                    self.joiners.poll()
                codes = {r: p.poll() for r, p in self.now.procs.items()}
                lost, errors = [], []
                for r, code in codes.items():
                    if code in (None, 0):
                        continue
                    report = self._report(r)
                    if report is None or report.get("kind") == "injected":
                        lost.append((r, report))
                    else:
                        errors.append(report)
                if errors:
                    e = errors[0]
                    raise LaunchError(f"training failed: {e.get('where', 'rank %s' % e.get('rank'))} failed "
                                      f"{'at step %s' % e.get('step') if e.get('phase') == 'training' else 'while ' + str(e.get('phase'))}: "
                                      f"{e.get('message')}")
                if lost:
                    self._stop_schedules(lost)
                    self._recover(lost)
                    continue
                if self._paused_all():
                    self._reshape()
                    continue
                if all(c == 0 for c in codes.values()):
                    for p in self.leaving:
                        try:
                            p.wait(timeout=10)
                        except subprocess.TimeoutExpired:
                            pass
                    self._collect_timings(wait_s=5.0)
                    self._take_remote_summary()
                    self.outcome = "ok"
                    return self.now
        finally:
            teardown_then_restore(previous, self.teardown)

    # ---------------------------------------------------------------- a lost device
    def _recover(self, lost: list[tuple[int, dict | None]]) -> None:
        from hetero.runtime.handoff import layer_of
        from hetero.runtime.reshard.live import alive_key
        from hetero.runtime.spec import describe_rank

        now = self.now
        # a machine's loss counts from its launcher's last heartbeat (RemoteWorker.lost_at), not from
        # when the heartbeat's silence was long enough to call it lost: the wait is downtime too
        failed_at = min((float(rep["time"]) if rep and rep.get("time")
                         else getattr(now.procs[r], "lost_at", None) or time.time()) for r, rep in lost)
        lost_ranks = {r for r, _ in lost}
        first = lost[0][1]
        why = (f"failed at step {first.get('step')}: {first.get('message')}" if first
               else "died without reporting (killed or crashed)")
        reason = f"{'; '.join(describe_rank(now.layout.ranks[r]) for r in sorted(lost_ranks))} {why}"
        self.print_fn(f"elastic: {reason}")
        if len(self.reconfigurations) >= MAX_RECONFIGURATIONS:
            raise HeteroError(f"elastic: {len(self.reconfigurations)} devices lost already; giving up: {reason}")
        if self._pending is not None:   # lost while the previous reconfiguration was still finishing
            raise LaunchError(f"elastic: {reason}, during the reconfiguration before step {self._pending['rc']['step']}: "
                              f"the run cannot go on (fix: restart from a checkpoint written by --save)")
        gen = self.gen_no + 1
        store = self.coordinator.store
        # 1. every process still alive checks in (one silent past the timeout is lost too)
        waiting = [r for r in now.procs if r not in lost_ranks]
        got: dict[int, dict] = {}
        deadline = time.monotonic() + self.options.timeout_s
        while waiting:
            for r in list(waiting):
                p = now.procs[r]
                if store.check([alive_key(gen, r)]):
                    got[r] = json.loads(store.get(alive_key(gen, r)))
                    waiting.remove(r)
                elif p.poll() is not None:
                    report = self._report(r)
                    if report is not None and report.get("kind") != "injected":
                        raise LaunchError(f"elastic: {reason}; then {report.get('where')} failed while the survivors "
                                          f"checked in: {report.get('message')}")
                    lost_ranks.add(r)
                    waiting.remove(r)
            if waiting and time.monotonic() > deadline:
                for r in waiting:   # silent past the timeout: lost, and ended
                    now.procs[r].send_signal(signal.SIGKILL)
                    lost_ranks.add(r)
                self.print_fn(f"elastic: {'; '.join(describe_rank(now.layout.ranks[r]) for r in waiting)} did not "
                              f"check in within {self.options.timeout_s:g} s: lost too")
                waiting = []
            time.sleep(0.001)
        checked_in = time.time()
        survivors = sorted(got)
        if not survivors:
            raise HeteroError(f"elastic: no rank survived {reason} (fix: restart from a --save checkpoint)")
        steps = {got[r]["applied_step"] for r in survivors}
        # ZeRO: the lost ranks' optimizer slices are rebuilt from their peers' copies, or (why not, in
        # words) the state comes from the checkpoint, whatever step each survivor reached
        if now.plan.zero_stage:
            from hetero.runtime.elastic.slice_copies import uncovered

            lost_slices = uncovered(got, lost_ranks) or False
        else:
            lost_slices = False
        if lost_slices:
            steps = {max(steps)}
        if len(steps) > 1:
            by = ", ".join(f"rank {r}: {got[r]['applied_step']}" for r in survivors)
            raise HeteroError(f"elastic: the surviving ranks stopped at different steps ({by}), so their live state "
                              f"is not one model (fix: restart from a checkpoint written by --save)")
        step = steps.pop()
        # 2. the new plan (made ahead for a single loss) and the members
        t0 = time.perf_counter()
        ahead = self._ahead.get(frozenset(lost_ranks)) or self._replan(lost_ranks)
        members = assign_ranks(now.layout, ahead.layout, survivors)
        checkpoint = self._checkpoint()
        if lost_slices and not checkpoint:
            refuse_lost_slices(now.plan, reason, lost_slices)
        transition = (ahead.transition if ahead.survivors == tuple(survivors)
                      else self.transition(now, ahead, members, survivors))
        if transition.missing and not checkpoint:
            names = sorted({reg.name for _, reg in transition.missing})
            region = next((reg for _, reg in transition.missing if reg.name.startswith("layers.")),
                          transition.missing[0][1])
            holders = [i for i in now.layout.ranks if region.name in self._space().rank_regions(now.plan, i)]
            where = "; ".join(describe_rank(i) for i in holders[:3])
            raise HeteroError(f"elastic: no surviving rank holds a whole copy of {layer_of(region.name)} "
                              f"({region.name}; {len(names)} parameter(s) in all), held only by {where}: "
                              f"the live state cannot be rebuilt (fix: a plan whose stages have data-parallel "
                              f"replicas, 'replicas: 2' or a second pipeline, or restart from a --save checkpoint)")
        from hetero.runtime.reshard.live import decision_for

        transport = self.transport(got)
        self.coordinator.publish(gen, members, decision_for(
            self.model.to_dict(), (now.cluster.to_dict(), now.plan.to_dict()),
            (ahead.cluster.to_dict(), ahead.result.plan.to_dict()), survivors, step,
            checkpoint if transition.missing or lost_slices else None, transport=transport,
            pids={r: now.procs[r].pid for r in survivors}, lost_slices=lost_slices))
        decided = time.time()
        replan_s = time.perf_counter() - t0
        self.print_fn(f"{replanned(ahead.cluster.num_devices, ahead.layout.world_size, f'{replan_s:.2f} s')}, "
                      f"{ahead.result.one_line} (predicted {ahead.result.tokens_per_s:,.0f} tokens/s); "
                      f"{len(survivors)} surviving rank(s) at step {step} reshard in-process")
        rc = {"step": step + 1, "reason": reason, "world_size_before": now.layout.world_size,
              "world_size_after": ahead.layout.world_size, "devices_left": ahead.cluster.num_devices,
              "devices_added": 0, "devices_removed": len(lost_ranks), "_failed_at": failed_at,
              "_launched_at": decided, "handoff_time_s": checked_in - failed_at, "replan_time_s": replan_s,
              "plan": ahead.result.plan.to_dict(), "predicted_tokens_per_s": ahead.result.tokens_per_s,
              "path": "in-process", "transport": transport, "intersection_bytes": transition.intersection_bytes,
              "predicted_downtime_s": self._predict(now, transition, members, survivors)}
        self.switch(rc, gen, survivors, members, lost_ranks, ahead)

    def switch(self, rc: dict, gen: int, survivors: list[int], members: dict, lost_ranks, ahead, joiners=()) -> None:
        """Record ``rc`` and make generation ``gen`` (``ahead``'s plan, ``members``' processes) current;
        ``joiners``: the ids of processes that joined in it (their timings are waited for too)."""
        now = self.now
        self.reconfigurations.append(rc)
        self._pending = {"rc": rc, "gen": gen, "survivors": survivors, "decided": rc["_launched_at"],
                         "pids": {r: now.procs[r].pid for r in survivors}, "joiners": list(joiners)}
        # the processes of the new plan: the same ones, under their new ranks
        for r in lost_ranks:
            if now.procs[r].poll() is None:
                now.procs[r].send_signal(signal.SIGKILL)
            self.lost_procs.append(now.procs[r])
        self.leaving += [now.procs[r] for r in survivors if r not in members]
        self.gen_no = gen
        self.now = Generation(ahead.cluster, ahead.result.plan, ahead.layout, generation_dir(self.options.run_dir, gen),
                              {members[r]: now.procs[r] for r in members})
        os.makedirs(self.now.run_dir, exist_ok=True)
        self._ahead = {}
        self._plan_after_reshard = True   # not now: the planner would take a core from the exchange
        if self.on_new_plan:
            self.on_new_plan(self.now)

    # ---------------------------------------------------------------- a change of the cluster file
    def _paused_all(self) -> bool:
        """Whether every rank paused for a pending change of the cluster file and checked in."""
        from hetero.runtime.reshard.live import alive_key

        if self.watch is None or self.watch.pending is None:
            return False
        return self.coordinator.store.check([alive_key(self.gen_no + 1, r) for r in self.now.procs])

    def _reshape(self) -> None:
        """Every rank paused at a step boundary for the pending change: devices that leave (the new
        plan's ranks all on devices that run a process) are taken out in-process, as after a failure
        but with every rank serving its state; a change that needs new processes (devices that join)
        is answered with a handoff: the ranks write their state and exit, and the launch restarts on
        the new plan (:mod:`hetero.runtime.elastic`)."""
        from hetero.layout import build_layout
        from hetero.runtime.reshard.live import alive_key, decision_for

        now, gen, store = self.now, self.gen_no + 1, self.coordinator.store
        change = self.watch.pending
        ranks = sorted(now.procs)
        got = {r: json.loads(store.get(alive_key(gen, r))) for r in ranks}
        checked_in = time.time()
        step = max(g["applied_step"] for g in got.values())
        layout = build_layout(change.cluster, change.result.plan)
        try:
            members = assign_ranks(now.layout, layout, ranks)
        except HeteroError:   # ranks on devices that run no process: a join
            if self.joiners is not None and self.joiners.ready_for(change, gen):   # their processes are ready
                self.joiners.switch(step, checked_in)
                return
            self.coordinator.publish(gen, {}, {"handoff": True})
            self.print_fn("elastic: the new plan puts ranks on devices that run no process: the ranks hand off "
                          "their state and every worker restarts")
            self.gen_no = gen
            return
        self.watch.take()
        ahead = Ahead(change.cluster, change.result, layout)
        transition = self.transition(now, ahead, members, ranks)
        transport = self.transport(got)
        self.coordinator.publish(gen, members, decision_for(
            self.model.to_dict(), (now.cluster.to_dict(), now.plan.to_dict()),
            (change.cluster.to_dict(), change.result.plan.to_dict()), ranks, step, None, transport=transport,
            pids={r: now.procs[r].pid for r in ranks}))
        decided = time.time()
        asked = change.seen_at + change.replan_time_s
        self.print_fn(f"elastic: {now.layout.world_size} rank(s) paused after step {step}; in-process reshard onto "
                      f"{change.result.one_line}")
        rc = {"step": step + 1, "reason": change.reason, "world_size_before": now.layout.world_size,
              "world_size_after": layout.world_size, "devices_left": change.cluster.num_devices,
              "devices_added": change.added, "devices_removed": change.removed, "_failed_at": change.seen_at,
              "_launched_at": decided, "handoff_time_s": checked_in - asked, "replan_time_s": change.replan_time_s,
              "plan": change.result.plan.to_dict(), "predicted_tokens_per_s": change.result.tokens_per_s,
              "path": "in-process", "transport": transport, "intersection_bytes": transition.intersection_bytes,
              "predicted_downtime_s": self._predict(now, transition, members, ranks)}
        self.switch(rc, gen, ranks, members, set(), ahead)

    def _stop_schedules(self, lost) -> None:
        """Tell every other worker at once that a peer is lost (:data:`~.protocol.PEER_LOST_SIGNAL`):
        one in the middle of its schedule stops there, instead of computing the rest of the step
        before its next operation with the lost rank fails."""
        gone = {r for r, _ in lost}
        for r, p in self.now.procs.items():
            if r not in gone and p.poll() is None:
                p.send_signal(getattr(signal, PEER_LOST_SIGNAL))

    def _replan(self, lost_ranks, now=None) -> Ahead:
        """The planner's best plan on the devices left; when it puts ranks on devices that run no
        process (idle under the plan before), the plan for the survivors' devices alone: the
        survivors carry on in their processes, and nothing new is started after a failure."""
        from types import SimpleNamespace

        from hetero.layout import build_layout
        from hetero.specs.cluster import without_devices

        now = now or self.now
        left = without_devices(now.cluster, [now.layout.ranks[r] for r in sorted(lost_ranks)])
        result = replan(left, self.model, now.plan)
        layout = build_layout(left, result.plan)
        held: dict[str, int] = {}
        for info in now.layout.ranks:
            if info.rank not in lost_ranks:
                held[info.group] = held.get(info.group, 0) + 1
        wanted: dict[str, int] = {}
        for info in layout.ranks:
            wanted[info.group] = wanted.get(info.group, 0) + 1
        if any(n > held.get(g, 0) for g, n in wanted.items()):
            idle = [SimpleNamespace(group=g.name, node=0) for g in left.groups if g.nodes == 1
                    for _ in range(g.devices_per_node - held.get(g.name, 0))]
            left = without_devices(left, idle)
            result = replan(left, self.model, now.plan)
            layout = build_layout(left, result.plan)
        return Ahead(left, result, layout)

    def _space(self):
        from hetero.runtime.reshard.space import ParameterSpace

        if getattr(self, "_space_cache", None) is None:
            self._space_cache = ParameterSpace(self.model)
        return self._space_cache

    def transition(self, now, ahead, members, survivors):
        """The transition exactly as the workers compute it (:func:`hetero.runtime.reshard.live.reconfigure`)."""
        from hetero.runtime.reshard.live import exchange_ranks, transition_between

        space = self._space()
        return transition_between(space, now.plan, now.layout, space.layout_regions(ahead.result.plan, ahead.layout),
                                  exchange_ranks(members, survivors), ahead.layout)

    def _predict(self, now, transition, members, survivors) -> float | None:
        from hetero.runtime.reshard.live import exchange_ranks
        from hetero.runtime.reshard.predict import predict_transfer_s

        try:
            world = exchange_ranks(members, survivors)
            return predict_transfer_s(transition, now.cluster, {world[r]: now.layout.ranks[r] for r in world})[
                "transfer_s"]
        except Exception:  # noqa: BLE001 - a prediction must not end a recovery
            return None

    def _checkpoint(self) -> str | None:
        """The plan-independent checkpoint to fall back on: the ``--load`` one, else ``--save``'s."""
        for path in (self.options.load, self.options.save):
            if path and os.path.exists(os.path.join(path, ".metadata")):
                return path
        return None

    def _collect_timings(self, wait_s: float = 0.0) -> None:
        """The pending reconfiguration's per-survivor timings, once every survivor put them in the store."""
        pend = self._pending
        if pend is None:
            return
        store = self.coordinator.store
        keys = [timing_key(pend["gen"], r) for r in pend["survivors"] + pend["joiners"]]
        deadline = time.monotonic() + wait_s
        while not store.check(keys):
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)
        t = [json.loads(store.get(k)) for k in keys]
        kept = t[:len(pend["survivors"])]   # the processes that were there (joiners come after)
        rc = pend["rc"]
        ready = max(x["ready_at"] for x in t)
        rc.update(detect_s=max(x["detected_at"] for x in kept) - rc["_failed_at"],
                  leave_s=max(x["leave_s"] for x in t), agree_replan_s=max(x["agree_replan_s"] for x in t), regroup_s=max(x["regroup_s"] for x in t),
                  transfer_s=max(x["transfer_s"] for x in t), rebuild_s=max(x["rebuild_s"] for x in t),
                  bytes_moved=sum(x["bytes_sent"] for x in t), bytes_received=sum(x["bytes_received"] for x in t),
                  restart_time_s=ready - pend["decided"], reshard_time_s=ready - rc["_failed_at"],
                  survivor_pids={str(r): x["pid"] for r, x in zip(pend["survivors"], kept)},
                  pids_kept=all(x["pid"] == pend["pids"][r] for r, x in zip(pend["survivors"], kept)))
        self.print_fn(f"elastic: resharded in-process in {rc['reshard_time_s']:.2f} s (predicted transfer "
                      f"{seconds_cell(rc['predicted_downtime_s'])} s, measured {rc['transfer_s']:.2f} s); "
                      f"{rc['bytes_moved'] / 1e6:,.1f} MB moved; the survivors kept their processes")
        self._pending = None
        self._start_planning_ahead()

    def _start_planning_ahead(self) -> None:
        """Plan for every single loss of the current generation, in the background, once its ranks
        train (after a reshard: once every rank is ready, so that the planner does not compete with
        the exchange for the cores)."""
        if self._plan_after_reshard:
            self._plan_after_reshard = False
            threading.Thread(target=self._plan_ahead, daemon=True).start()
