"""The elastic launcher's fork server (hetero/runtime/elastic/forkserver.py): workers forked from one
preloaded process answer as ``subprocess.Popen`` does, in a fresh process's state."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from _spawn import processes_naming

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


def _server(tmp_path):
    from hetero.runtime.elastic.forkserver import ForkServer
    from hetero.runtime.lifeline import child_env

    return ForkServer({**os.environ, **child_env()}, str(tmp_path / "run"))


def _until(check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _open_for_writing(fifo) -> int | None:
    """The FIFO's write end once a reader has it open (a worker reading its run file), else None."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:   # ENXIO: no reader yet
        return None


@pytest.mark.timeout(120)
def test_forked_workers_report_their_exit_status_and_run_in_a_fresh_process_state(tmp_path):
    from hetero.runtime.spec import SPEC_ENV

    fifo = tmp_path / "spec.fifo"
    os.mkfifo(fifo)   # a worker reading its run file from here waits until the test ends it
    server = _server(tmp_path)
    writer = None
    try:
        failing = server.start(["--spec", str(tmp_path / "missing.json")], dict(os.environ))
        # the run file named by the environment it is given, not the server's
        waiting = server.start([], {**os.environ, SPEC_ENV: str(fifo)})
        assert failing.wait(timeout=60) == 1      # a run file that is not there: the worker's failure
        pid = waiting.pid
        assert pid not in (os.getpid(), server.proc.pid)
        deadline = time.monotonic() + 60
        while (writer := _open_for_writing(fifo)) is None:
            assert waiting.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        assert os.getsid(pid) == pid               # a session of its own: the launcher signals it alone
        assert pid in processes_naming(str(tmp_path / "run"))   # found as a process of its run
        waiting.send_signal(signal.SIGKILL)
        assert waiting.wait(timeout=30) == -signal.SIGKILL
        waiting.send_signal(signal.SIGTERM)        # after its exit: nothing, as Popen
    finally:
        if writer is not None:
            os.close(writer)
        server.close()
    assert server.proc.returncode == 0 and not processes_naming(str(tmp_path / "run"))


@pytest.mark.timeout(120)
def test_a_server_that_dies_takes_its_workers_and_they_read_as_killed(tmp_path):
    fifo = tmp_path / "spec.fifo"
    os.mkfifo(fifo)
    server = _server(tmp_path)
    try:
        worker = server.start(["--spec", str(fifo)], dict(os.environ))
        assert worker.pid != server.proc.pid   # forked before the server is killed
        os.kill(server.proc.pid, signal.SIGKILL)
        assert worker.wait(timeout=30) == -signal.SIGKILL
        _until(lambda: not processes_naming(str(tmp_path / "run")))   # the worker died with its server
        assert server.start(["--spec", str(fifo)], dict(os.environ)).poll() == 1   # no more forks
    finally:
        server.close()
