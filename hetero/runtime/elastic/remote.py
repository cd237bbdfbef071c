"""A worker on another machine, as the coordinator's launcher sees it: a stand-in for its process.

When every machine starts its own node slot (``hetero launch --elastic --node-rank R``), node slot
0's launcher runs the controller (:class:`~.live.LiveRun`) and hosts the coordinator's store; the
other machines' launchers (:mod:`.agent`) start and watch their workers and report through that
store. :class:`RemoteWorker` answers what the controller asks of a ``subprocess.Popen`` (``pid``,
``poll``, ``wait``, ``send_signal``, ``returncode``) from those reports, so the controller treats a
worker anywhere the same way.

A machine is lost when its launcher's heartbeat (:func:`~.protocol.agent_key` ``beat``, a counter
it raises every :data:`~.agent.BEAT_S`) has not changed for ``lost_after_s``: every worker there
then reads as ended by SIGKILL without a report, as a worker whose process died does.
"""
from __future__ import annotations

import json
import time

from hetero.runtime.elastic.protocol import agent_key, worker_key


class RemoteWorker:
    """The worker process ``wid`` (its rank in generation 0) of node slot ``slot`` on another machine."""

    def __init__(self, store, wid: int, slot: int, lost_after_s: float, first_beat_s: float | None = None):
        """``first_beat_s``: how long its machine's launcher may take to send a first heartbeat (a
        machine that joins is started by hand; default ``lost_after_s``)."""
        self.store, self.wid, self.slot, self.lost_after_s = store, wid, slot, lost_after_s
        self.first_beat_s = lost_after_s if first_beat_s is None else first_beat_s
        self.returncode: int | None = None
        self.lost_at: float | None = None
        """When its machine was last heard from (wall time), once the machine is found lost."""
        self._pid: int | None = None
        self._beat: bytes | None = None
        self._beat_seen = time.monotonic()

    @property
    def pid(self) -> int:
        """Its process id on its machine (waited for until its launcher said it)."""
        if self._pid is None:
            self.store.wait([worker_key(self.wid, "pid")])
            self._pid = int(self.store.get(worker_key(self.wid, "pid")))
        return self._pid

    def poll(self) -> int | None:
        """Its exit status once its launcher reported it (or its machine is lost: -9), else None."""
        if self.returncode is not None:
            return self.returncode
        if self.store.check([worker_key(self.wid, "exit")]):
            self.returncode = int(self.store.get(worker_key(self.wid, "exit")))
        elif self._machine_lost():
            self.returncode = -9
            self.lost_at = time.time() - (time.monotonic() - self._beat_seen)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                import subprocess

                raise subprocess.TimeoutExpired(f"worker {self.wid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig) -> None:
        """Ask its machine's launcher to send it ``sig``."""
        if self.poll() is not None:
            return
        n = self.store.add(worker_key(self.wid, "signals"), 1)
        self.store.set(worker_key(self.wid, f"signal/{n}"), str(int(sig)))

    def report(self) -> dict | None:
        """The error report it left (its launcher forwards it before the exit status), if any."""
        if not self.store.check([worker_key(self.wid, "report")]):
            return None
        return json.loads(self.store.get(worker_key(self.wid, "report")))

    def _machine_lost(self) -> bool:
        key = agent_key(self.slot, "beat")
        beat = self.store.get(key) if self.store.check([key]) else None
        now = time.monotonic()
        if beat != self._beat:
            self._beat, self._beat_seen = beat, now
            return False
        return now - self._beat_seen > (self.lost_after_s if beat is not None else self.first_beat_s)
