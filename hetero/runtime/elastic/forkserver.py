"""Elastic workers forked from one preloaded process instead of started as fresh interpreters.

A fresh worker spends seconds of CPU importing torch, the compiler stack torch.optim's first
optimizer imports, and DTensor, before its first step (docs/elastic.md gives the figures); an
elastic launcher starts every worker itself (:mod:`.processes`), and a device or machine that joins
has its worker start in the middle of a run.
The launcher cannot fork workers itself: it runs the coordinator's store, the planner and the
cluster watch on threads, and a fork of a threaded process may inherit a lock another thread held.

So an elastic launcher starts one fork server per run (:class:`ForkServer`): a single-threaded
process that imports what a worker imports once, then forks a worker per request. This is what a
local launch does with its node launcher (:mod:`hetero.runtime.torchrun_loopback`), and, like
there, only for the workers of emulated CPU devices (:data:`~hetero.runtime.torchrun_loopback.FORK_ENV`
``=fork``; ``spawn`` gives fresh interpreters); no device runtime is initialised before a fork.

Each worker is its own session (the launcher signals it by process id), gets the whole environment
it would have had as a fresh process, and ends when the fork server ends, which ends when its
launcher does (:mod:`hetero.runtime.lifeline`). The server names the run directory and the worker
module on its command line, as a fresh worker does, so a look for a run's processes finds both.

The launcher talks to the server over two pipes: a JSON line per request (the worker's arguments and
environment) on the server's standard input, and a JSON line per event back (the worker's process
id once forked; its exit status once reaped). :class:`ForkedWorker` answers what the launcher asks
of a ``subprocess.Popen``: ``pid``, ``poll``, ``wait``, ``send_signal``, ``returncode``.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading

from hetero.errors import HeteroError

SERVER_MODULE = "hetero.runtime.elastic.forkserver"


class ForkedWorker:
    """A worker forked by a :class:`ForkServer`, with the part of ``subprocess.Popen``'s interface
    the elastic launcher uses."""

    def __init__(self, server: "ForkServer"):
        self._server = server
        self._pid: int | None = None
        self.returncode: int | None = None

    @property
    def started(self) -> bool:
        """Whether :attr:`pid` answers at once: forked, or never to be (the server ended)."""
        return self._pid is not None or self.returncode is not None

    @property
    def pid(self) -> int:
        """The process id, once the server has forked it (its first requests wait for its imports)."""
        with self._server.cond:
            while self._pid is None and self.returncode is None:
                self._server.cond.wait()
        if self._pid is None:
            raise HeteroError(f"elastic: the worker fork server ended before starting a worker "
                              f"({self._server.failure or 'no reason given'})")
        return self._pid

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._server.cond:
            if not self._server.cond.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(f"worker {self._pid}", timeout)
            return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the worker; nothing once it has exited (as ``Popen.send_signal``)."""
        if self.returncode is not None or self._pid is None:
            return
        try:
            os.kill(self._pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's side of a fork server, started at construction: its imports run while the
    launcher prepares the run. ``env``: the server's environment (the first node's workers', which
    decides what importing torch reads: threads, log level); ``run_dir``: named on its command line."""

    def __init__(self, env: dict[str, str], run_dir: str):
        from hetero.runtime.torchrun_loopback import WORKER_MODULE

        events_r, events_w = os.pipe()
        self.cond = threading.Condition()
        self.failure: str | None = None
        self._waiting: list[ForkedWorker] = []      # requested, not yet forked (the server answers in order)
        self._by_pid: dict[int, ForkedWorker] = {}
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", SERVER_MODULE, str(events_w), WORKER_MODULE, run_dir],
                                         env=env, stdin=subprocess.PIPE, pass_fds=(events_w,),
                                         start_new_session=True)
        finally:
            os.close(events_w)
        self._events = os.fdopen(events_r, "rb")
        threading.Thread(target=self._read_events, name="hetero-fork-server-events", daemon=True).start()

    def start(self, args: list[str], env: dict[str, str]) -> ForkedWorker:
        """Fork a worker running ``hetero.runtime.worker`` with ``args`` in the environment ``env``."""
        worker = ForkedWorker(self)
        with self.cond:
            if self.failure is not None:
                worker.returncode = 1
                return worker
            self._waiting.append(worker)
        try:
            self.proc.stdin.write(json.dumps({"args": list(args), "env": dict(env)}).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as e:   # the server is gone: the reader ends the waiting workers
            self._fail(f"the fork server's pipe closed: {e}")
        return worker

    def close(self, timeout: float = 5.0) -> None:
        """End the server (its workers should have been ended before: they end with it)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _read_events(self) -> None:
        for line in self._events:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self.cond:
                if "pid" in event:
                    forked = self._waiting.pop(0) if self._waiting else None
                    if forked is not None:
                        forked._pid = event["pid"]
                        self._by_pid[event["pid"]] = forked
                elif "exit" in event:   # after its pid: the server writes both from its one thread
                    self._by_pid[event["exit"]].returncode = event["code"]
                elif "error" in event:
                    self.failure = event["error"]
                self.cond.notify_all()
        self._fail(self.failure or "the fork server exited")

    def _fail(self, why: str) -> None:
        """The server is gone: its workers died with it (the parent-death signal), and the ones not
        yet forked never will be."""
        with self.cond:
            self.failure = self.failure or why
            for forked in [*self._waiting, *self._by_pid.values()]:
                if forked.returncode is None:
                    forked.returncode = -signal.SIGKILL if forked._pid is not None else 1
            self._waiting.clear()
            self.cond.notify_all()


# ------------------------------------------------------------------------------------ the server
def _preload() -> None:
    from hetero.runtime.elastic.reconfig import import_training_modules
    from hetero.runtime.torchrun_loopback import preload_worker_modules

    preload_worker_modules()
    import_training_modules()


def _child(args: list[str], env: dict[str, str], close_fds: list[int]) -> None:
    """In the forked worker: the state of a fresh process (its own session, default signal handling,
    no server pipes, the given environment), then the worker; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in close_fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.setsid()
        os.environ.clear()
        os.environ.update(env)
        from hetero.runtime import worker

        sys.argv = [worker.__file__, *args]
        code = worker.main(list(args)) or 0
        if code == 0:   # as a fresh interpreter's exit; a failed rank skips it (see hetero.runtime.worker)
            import atexit

            atexit._run_exitfuncs()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a fresh worker would print its traceback and exit 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(events_fd: int) -> int:
    """The server's loop: fork a worker per request line on standard input, report each one's
    process id and, once reaped, its exit status on ``events_fd``; end when standard input closes."""
    from hetero.runtime.lifeline import PARENT_ENV, end_with_parent

    end_with_parent()   # the launcher died: so does this server, and the workers with it
    events = os.fdopen(events_fd, "wb", buffering=0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the launcher ends it (a terminal's Ctrl-C reaches the launcher)
    try:
        _preload()
    except BaseException as e:  # noqa: BLE001 - said to the launcher, whose workers then fail to start
        events.write(json.dumps({"error": f"importing the worker's modules failed: {type(e).__name__}: {e}"}).encode()
                     + b"\n")
        return 1
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)   # a handler, so that the wakeup fd is written
    pending = b""
    live = 0
    stdin_open = True
    while stdin_open or live:
        ready, _, _ = select.select([0, wake_r] if stdin_open else [wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        while live:   # reap every worker that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            live -= 1
            events.write(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        if stdin_open and 0 in ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                stdin_open = False
                continue
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                env = {**request["env"], PARENT_ENV: f"{os.getpid()}:main"}
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request["args"], env, [wake_r, wake_w, events.fileno()])
                live += 1
                events.write(json.dumps({"pid": pid}).encode() + b"\n")
    return 0


if __name__ == "__main__":
    # argv: the events pipe's fd; then the worker module and the run directory, for the command line only.
    # The interpreter's teardown of torch (most of a second, nothing to release) is skipped.
    code = serve(int(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
