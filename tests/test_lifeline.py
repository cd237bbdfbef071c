"""A child started with :func:`hetero.runtime.lifeline.child_env` ends when its parent dies, however
it dies (``kill -9`` included), and never outlives it through a race at its start.

Each test runs a small parent process that starts a sleeping child, kills the parent with SIGKILL
and waits (bounded) for the child to be gone; every process is ended on the way out.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hetero.runtime.lifeline import PARENT_ENV

pytestmark = pytest.mark.timeout(60)

CHILD = ("import time; from hetero.runtime.lifeline import end_with_parent; "
         "armed = end_with_parent(); print('armed' if armed else 'unarmed', flush=True); time.sleep(120)")

PARENT = """
import subprocess, sys, threading, os
from hetero.runtime.lifeline import child_env
CHILD = {child!r}
def start():
    env = {{**os.environ, **child_env()}}
    p = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "armed"
    print(p.pid, flush=True)
if {from_thread}:
    t = threading.Thread(target=start)
    t.start()
    t.join()   # the thread that started the child is gone: the child must live on with this process
else:
    start()
import time; time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


def _parent_and_child(from_thread: bool) -> tuple[subprocess.Popen, int]:
    code = PARENT.format(child=CHILD, from_thread=from_thread)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    line = parent.stdout.readline()
    assert line.strip().isdigit(), f"the parent did not start its child: {line!r}"
    return parent, int(line)


def _end(parent: subprocess.Popen, child: int | None) -> None:
    for pid in (parent.pid, child):
        if pid and _alive(pid):
            os.kill(pid, signal.SIGKILL)
    parent.wait(timeout=10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("from_thread", [False, True], ids=["main-thread", "other-thread"])
def test_a_child_ends_when_its_parent_is_killed(from_thread):
    parent, child = _parent_and_child(from_thread)
    try:
        time.sleep(0.3)
        assert _alive(child), "the child ended while its parent lives (started from a thread that ended)"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        assert _gone_within(child, 5.0), f"child {child} outlived its killed parent"
    finally:
        _end(parent, child)


def test_a_child_whose_parent_died_before_it_armed_ends_at_once():
    # its parent is not the pid it was given: the parent died in between and it was re-parented
    code = "from hetero.runtime.lifeline import end_with_parent; end_with_parent('1:main'); print('survived')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == -signal.SIGKILL and "survived" not in out.stdout, (out.returncode, out.stderr)


def test_a_process_started_without_a_parent_named_arms_nothing():
    env = {k: v for k, v in os.environ.items() if k != PARENT_ENV}
    out = subprocess.run([sys.executable, "-c", CHILD.replace("time.sleep(120)", "pass")], env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "unarmed", out.stderr
