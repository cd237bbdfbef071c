"""Devices that come and go on purpose: an elastic run watches its cluster file.

``hetero launch --elastic --cluster C.yaml`` re-reads ``C.yaml`` while it trains. When the file
changes to a valid cluster with other devices (a group added, a node's device count raised or
lowered, a group removed to drain it), the watcher plans for the new cluster (the same global
batch, so the losses go on as if nothing happened) off the training's critical path, and only then
asks the workers to pause: every rank stops at the next step boundary, hands off its live state
(:mod:`hetero.runtime.handoff`) and exits cleanly, and the launcher relaunches on the new plan from
that state (:mod:`hetero.runtime.elastic.run`). On the in-process path the launcher may hold the pause
request back (:attr:`ClusterWatch.hold`) while it starts the processes of devices that join
(:mod:`hetero.runtime.elastic.joiners`), and the ranks reshard in their processes instead.

What a change to the file means: the file is the truth about the machines from the moment it
changes. Devices that an earlier failure removed and that the file still lists are used again.

A change that cannot be used (the YAML does not load, the model does not fit the devices, the
planner finds no plan) is printed with its reason and the run goes on as it was. Edits that leave
the cluster the same (comments, key order) do nothing; a change after which the best plan is the
running one on the same devices is taken in without a pause (later replans start from it).
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

from hetero.runtime.elastic.policy import replan
from hetero.runtime.elastic.protocol import PAUSE_REQUEST

POLL_S = 0.5
"""How often the file is looked at (a stat; it is read only when its size or time changed)."""

SETTLE_S = 0.2
"""A changed file is read once it has stayed the same this long: a copy or an editor that writes in
place truncates first, and a read in between would see an empty or partial cluster."""


@dataclasses.dataclass
class Change:
    """A usable change of the cluster file, planned for."""

    cluster: object
    result: object
    """The planner's best plan for ``cluster`` (:class:`hetero.planner.SearchResult`)."""
    reason: str
    seen_at: float
    """When the change was seen (the reconfiguration's downtime counts from here)."""
    replan_time_s: float
    added: int
    removed: int


def device_counts(cluster) -> dict[str, int]:
    """Devices per group name."""
    return {g.name: g.num_devices for g in cluster.groups}


def describe_change(before, after) -> tuple[str, int, int]:
    """A line saying which groups gained or lost devices, and the devices added and removed."""
    a, b = device_counts(before), device_counts(after)
    parts, added, removed = [], 0, 0
    for name in list(a) + [n for n in b if n not in a]:
        old, new = a.get(name, 0), b.get(name, 0)
        if old == new:   # present in both (a group has at least one device)
            if before.group(name).device != after.group(name).device:
                parts.append(f"group '{name}' now {after.group(name).device}")
            continue
        parts.append(f"group '{name}' {old} -> {new}")
        added += max(0, new - old)
        removed += max(0, old - new)
    return ", ".join(parts) or "device settings", added, removed


class ClusterWatch:
    """Polls ``path`` in a thread; a usable change becomes :attr:`pending` and a pause request in
    the attached run directory (:meth:`attach`)."""

    def __init__(self, path: str, loaded, model, plan, print_fn=print, poll_s: float = POLL_S,
                 settle_s: float = SETTLE_S):
        self.path, self.model, self.plan = path, model, plan
        self.print_fn, self.poll_s, self.settle_s = print_fn, poll_s, settle_s
        self._seen = loaded.to_dict()    # what the file said when last read: the launch's cluster at first
        self._current = loaded           # the cluster the running attempt was planned for
        self._plan_now = plan            # and its plan
        self._signature = None           # None: compare the file with the launch's cluster at the first poll
        self._lock = threading.Lock()
        self._pending: Change | None = None
        self._run_dir: str | None = None
        self.hold = None
        """``hold(change) -> bool``: True keeps a change's pause request back until :meth:`release`
        (the in-process path starts the processes of devices that join first, while training goes on)."""
        self._held = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hetero-cluster-watch", daemon=True)

    def start(self) -> "ClusterWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def attach(self, run_dir: str | None, current=None, plan=None):
        """The attempt now running (its run directory; None between attempts), its cluster and plan; a
        change already pending asks it to pause at once. Returns the cluster as it stands (a change
        that left the running plan as it was is taken in without a pause)."""
        with self._lock:
            self._run_dir = run_dir
            if current is not None:
                self._current = current
            if plan is not None:
                self._plan_now = plan
            if self._pending is not None and run_dir and not self._held:
                _write_request(run_dir, self._pending)
            return self._current

    def set_hold(self, hold) -> None:
        """Install :attr:`hold` (None: every change asks for its pause at once again)."""
        with self._lock:
            self.hold = hold
            if hold is None:
                self._held = False

    def release(self) -> None:
        """Ask the ranks to pause for the pending change held back by :attr:`hold`."""
        with self._lock:
            self._held = False
            if self._pending is not None and self._run_dir:
                _write_request(self._run_dir, self._pending)

    def take(self) -> Change | None:
        """The pending change, which the caller now carries out (None if there is none)."""
        with self._lock:
            change, self._pending, self._held = self._pending, None, False
            return change

    @property
    def pending(self) -> Change | None:
        with self._lock:
            return self._pending

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s if self._signature is not None else 0.0):
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - a watcher bug must not end a training run
                self.print_fn(f"elastic: watching {self.path} failed ({type(e).__name__}: {e}); "
                              f"devices that come or go by editing it are not seen any more")
                return

    def poll(self) -> Change | None:
        """Look at the file once; returns the new pending change, if this look found one."""
        signature = self._stat()
        if signature is None or signature == self._signature:
            return None    # unchanged, or being replaced by an editor / moved away: look again later
        while True:   # wait until the writer is done
            time.sleep(self.settle_s)
            settled = self._stat()
            if settled is None:
                return None
            if settled == signature:
                break
            signature = settled
        self._signature = signature
        cluster = self._load()
        if cluster is None:
            return None
        with self._lock:
            current = self._current
        reason, added, removed = describe_change(current, cluster)
        t0 = time.time()
        result = self._replan(cluster)
        if result is None:
            return None
        with self._lock:
            # with a change already asked for, the ranks may be pausing for it: this one then replaces
            # it (a pause to the running plan at worst), never cancels it
            unchanged = self._pending is None and _runs_the_same(current, self._plan_now, cluster, result.plan)
            if unchanged:
                self._current = cluster
        if unchanged:
            self.print_fn(f"elastic: {self.path} changed: {reason}; the best plan is the running one, on the same "
                          f"devices: no pause")
            return None
        change = Change(cluster, result, f"{self.path} changed: {reason}", t0, time.time() - t0, added, removed)
        self.print_fn(f"elastic: {change.reason}; new plan ready ({result.one_line}, predicted "
                      f"{result.tokens_per_s:,.0f} tokens/s): pausing at the next step boundary")
        held = bool(self.hold and self.hold(change))
        with self._lock:
            self._pending, self._held = change, held
            if self._run_dir and not held:
                _write_request(self._run_dir, change)
        return change

    def _stat(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _load(self):
        """The file's cluster when it is valid for the model and differs from what it said before."""
        from hetero.specs.cluster import load_cluster, model_problems
        from hetero.specs.errors import SpecError

        try:
            cluster = load_cluster(self.path)
            problems = model_problems(cluster, self.model)
            if problems:
                raise SpecError(problems)
        except SpecError as e:
            self.print_fn(f"elastic: {self.path} changed but cannot be used, training goes on as it was:\n{e}")
            return None
        except OSError as e:
            self.print_fn(f"elastic: {self.path} changed but cannot be read ({e}); training goes on as it was")
            return None
        if cluster.to_dict() == self._seen:
            return None
        self._seen = cluster.to_dict()
        return cluster

    def _replan(self, cluster):
        from hetero.errors import HeteroError

        try:
            return replan(cluster, self.model, self.plan)
        except HeteroError as e:
            why = str(e).removeprefix("elastic: ")
            self.print_fn(f"elastic: {self.path} changed, but {why}; training goes on as it was")
            return None


def _runs_the_same(cluster, plan, new_cluster, new_plan) -> bool:
    """Whether ``new_plan`` on ``new_cluster`` launches exactly what ``plan`` on ``cluster`` does: the
    same plan, and every group it uses defined as before (device type, nodes, devices, hosts)."""
    if new_plan.to_dict() != plan.to_dict():
        return False
    for name in plan.devices_by_group():
        try:
            same = (new_cluster.group(name) == cluster.group(name)
                    and new_cluster.device_type(name) == cluster.device_type(name))
        except KeyError:
            return False
        if not same:
            return False
    return True


def _write_request(run_dir: str, change: Change) -> None:
    path = os.path.join(run_dir, PAUSE_REQUEST)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"reason": change.reason, "seen_at": change.seen_at}, f)
    os.replace(tmp, path)
