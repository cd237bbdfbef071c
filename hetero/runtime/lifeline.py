"""A job's processes end when the process that started them dies, however it dies.

``hetero launch`` starts node launchers, which start (or fork) workers; an elastic launcher starts
workers itself. Each of those runs in a session of its own, so a ``kill -9`` of its parent, which
no handler sees, used to leave it training on under PID 1. Every such child calls
:func:`end_with_parent` first thing, and its parent puts :func:`child_env` in its environment:

- On Linux the kernel sends the child SIGKILL when the parent dies (``prctl(PR_SET_PDEATHSIG)``).
  The kernel ties that signal to the parent *thread* that started the child, so it is used only
  when that thread was the parent's main thread (which lives as long as the process); a child
  started from another thread, and any system without ``prctl``, has a thread of its own waiting
  on the parent's process (a pidfd where Linux has one, else a look at ``getppid`` twice a second).
- The parent may have died between starting the child and the child arming its signal: the child
  then has another parent already (``os.getppid()`` differs from the pid it was given) and ends at
  once.

SIGKILL, not SIGTERM: a worker of an elastic run ignores SIGTERM (it must outlive its node
launcher's stop until it has handed its state off), and a job whose launcher is gone has no one to
hand anything to. A node launcher killed this way takes its own workers with it the same way.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

PARENT_ENV = "HETERO_PARENT"
"""``<pid>:main`` or ``<pid>:thread``: the process a child must not outlive, and whether it was
started from that process's main thread."""

_PR_SET_PDEATHSIG = 1


def child_env() -> dict[str, str]:
    """The environment variable a child started now, from this thread, needs for
    :func:`end_with_parent` to tie it to this process."""
    where = "main" if threading.current_thread() is threading.main_thread() else "thread"
    return {PARENT_ENV: f"{os.getpid()}:{where}"}


def end_with_parent(value: str | None = None) -> bool:
    """End this process (SIGKILL) when the parent named by ``value`` (default: :data:`PARENT_ENV`)
    dies, and at once when it is gone already. False when no parent is named (a worker started by
    hand, or by plain ``torchrun``): nothing is armed."""
    value = os.environ.get(PARENT_ENV) if value is None else value
    if not value:
        return False
    pid_text, _, started_from = value.partition(":")
    parent = int(pid_text)
    if started_from != "main" or not _arm_parent_death_signal():
        _watch(parent)
    if os.getppid() != parent:   # the parent died before the signal was armed: we were re-parented
        _die()
    return True


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_parent_death_signal() -> bool:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)``; False where there is no such call."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    """A daemon thread that ends this process once ``parent`` has exited."""
    fd = None
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(parent)
        except ProcessLookupError:
            _die()
        except OSError:   # a kernel without pidfds
            fd = None

    def wait() -> None:
        if fd is not None:
            import select

            select.select([fd], [], [])   # readable once the process has exited
            _die()
        import time

        while os.getppid() == parent:
            time.sleep(0.5)
        _die()

    threading.Thread(target=wait, name="hetero-parent-watch", daemon=True).start()
