"""The handle of an asynchronous communicator operation (``async_op=True``)."""
from __future__ import annotations

import threading
import time

from .bridge import wait_work
from .errors import HeteroCommError


class Work:
    """Handle of an asynchronous operation: ``wait(timeout=None)`` returns its result."""

    def __init__(self, comm, op, group, seq, deadline, works=(), finalize=None, future=None, peer=None):
        self._comm, self.op, self.group, self._seq = comm, op, group, seq
        self._deadline = deadline
        self._works = list(works)
        self._finalize = finalize
        self._future = future
        self._peer = peer
        self._done = False
        self._result = None

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self._future is not None and not self._future.done():
            return False
        return all(w.is_completed() for w in self._works)

    def add_done_callback(self, fn) -> None:
        """Call ``fn()`` once the operation's library work has completed, on whichever thread sees it
        complete (a library thread, the worker thread, or this one when it already has): for a
        timeline of when each operation finished, not for results (``wait`` gives those)."""
        def after_works(works):
            works = [w for w in works if w is not None]
            left = [len(works)]
            lock = threading.Lock()

            def one(_=None):
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    fn()

            if not works:
                fn()
            for w in works:
                w.get_future().add_done_callback(one)

        if self._future is not None:
            self._future.add_done_callback(lambda f: None if f.exception() else after_works(f.result()[0]))
        else:
            after_works(self._works)

    def wait(self, timeout: float | None = None):
        if self._done:
            return self._result
        try:
            if self._future is not None:
                guard = (timeout or self._comm.timeout) * 4 + 60
                works, finalize, deadline = self._future.result(timeout=guard)
                self._works, self._finalize, self._deadline = list(works), finalize, deadline
                self._future = None
            deadline = self._deadline if timeout is None else min(self._deadline, time.monotonic() + timeout)
            for w in self._works:
                wait_work(w, deadline)
            self._result = self._finalize() if self._finalize is not None else None
        except HeteroCommError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._comm._failure(self.op, self.group, self._seq, e, self._peer) from e
        self._done = True
        return self._result
