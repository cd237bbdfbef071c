"""Arrival tracking: which ranks of a group entered its n-th operation.

Every rank counts the operations it enters on each group (``enter``: a dict update, nothing on the
wire). A daemon thread publishes changed counters to torch's rendezvous store every
``interval`` seconds. When an operation times out, the rank publishes its own counter at once,
waits a short grace period for the others to do the same, and reads every member's counter: a
member whose counter is below the failed operation's sequence number never arrived. That is what
the :class:`~hetero.comm.errors.HeteroCommTimeout` message names.
"""
from __future__ import annotations

import threading
import time
from typing import Sequence

_PREFIX = "hetero_comm/progress"


def default_store():
    """torch.distributed's default store (None where unavailable)."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # noqa: BLE001
        return None


class ArrivalMonitor:
    def __init__(self, rank: int, store=None, interval: float = 0.05):
        self.rank = rank
        self.store = store if store is not None else default_store()
        self.interval = interval
        self._seq: dict[str, int] = {}
        self._published: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.store is not None:
            self._thread = threading.Thread(target=self._loop, name="hetero-comm-arrivals", daemon=True)
            self._thread.start()

    def enter(self, group: str) -> int:
        """Count one more operation on ``group``; returns its sequence number (1, 2, ...)."""
        seq = self._seq.get(group, 0) + 1
        self._seq[group] = seq
        return seq

    def _key(self, group: str, rank: int) -> str:
        return f"{_PREFIX}/{group}/{rank}"

    def publish(self) -> None:
        if self.store is None:
            return
        with self._lock:
            for group, seq in list(self._seq.items()):
                if self._published.get(group) != seq:
                    self.store.set(self._key(group, self.rank), str(seq))
                    self._published[group] = seq

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.publish()
            except Exception:  # noqa: BLE001 - the store went away (shutdown): stop quietly
                return

    def missing(self, group: str, seq: int, ranks: Sequence[int], grace: float = 0.5) -> list[int] | None:
        """Members of ``group`` that have not entered operation ``seq`` (None if it cannot tell)."""
        if self.store is None:
            return None
        try:
            self.publish()
            time.sleep(max(grace, 2 * self.interval))
            out = []
            for r in ranks:
                if r == self.rank:
                    continue
                key = self._key(group, r)
                if not self.store.check([key]) or int(self.store.get(key)) < seq:
                    out.append(r)
            return out
        except Exception:  # noqa: BLE001 - e.g. the store's host (rank 0) has exited
            return None

    def close(self) -> None:
        self._stop.set()
