"""Run a function in N fresh processes on this machine: the multi-process test helper.

    from _spawn import spawn          # tests/ is on sys.path under pytest

    def worker(rank, world_size, *args):      # module level, so it can be pickled
        import torch.distributed as dist
        dist.init_process_group("gloo")       # env:// - MASTER_ADDR/PORT, RANK, WORLD_SIZE are set
        ...
        return something_picklable            # collected per rank

    results = spawn(worker, 4, args=(...), timeout=60)   # [result of rank 0, rank 1, ...]

Each child gets ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK`` and
``WORLD_SIZE`` (plus ``env``). When any worker raises, :class:`SpawnError` carries every failed
rank's traceback; when ``timeout`` seconds pass, the ranks still running are named in the error.
Leftover processes are always terminated, then killed. A worker's process exits right after
reporting (``os._exit``), so a wedged process-group teardown cannot hang a test.

The ranks start from multiprocessing's fork server, which imports torch, torch.distributed and
the compiler stack torch.optim loads once per test session (:data:`PRELOAD`), instead of each
rank importing them again (docs/testing.md). Each rank still gets this process's environment and
working directory as they are when it starts, as a spawned one would.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["spawn", "free_port", "SpawnError", "run_launcher", "end_launcher", "processes_naming"]


class SpawnError(RuntimeError):
    """One or more workers failed or timed out; ``failures`` maps rank -> traceback text."""

    def __init__(self, message: str, failures: Dict[int, str]):
        super().__init__(message)
        self.failures = failures


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "hetero.comm", "hetero.runtime.trainer"]
"""Modules the fork server imports before forking any rank."""


def _context(start_method: str):
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)   # read when the server starts: the first spawn of a session
    return ctx


def _child(fn, rank, world_size, args, env, out_path):
    os.environ.clear()   # the environment of the test at this spawn, not of the fork server's start
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        payload = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        payload = ("error", traceback.format_exc())
    try:
        data = pickle.dumps(payload)
    except Exception:  # noqa: BLE001
        data = pickle.dumps(("error", "result not picklable:\n" + traceback.format_exc()))
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out_path)
    os._exit(0)


def spawn(fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), timeout: float = 120.0,
          env: Optional[Dict[str, str]] = None, start_method: str = "forkserver",
          may_die: Sequence[int] = ()) -> List[Any]:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` processes; return their results by rank.
    ``may_die``: ranks that may exit without reporting (a lost device): their result is None."""
    ctx = _context(start_method)
    child_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    child_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="hetero-spawn-") as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pkl") for r in range(nprocs)]
        procs = [ctx.Process(target=_child, args=(fn, r, nprocs, tuple(args), child_env, paths[r]), daemon=True)
                 for r in range(nprocs)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if all(os.path.exists(p) for p in paths) or all(not pr.is_alive() for pr in procs):
                    break
                if any(os.path.exists(pa) and _load(pa)[0] == "error" for pa in paths):
                    time.sleep(0.5)  # let the others report their own errors, then stop
                    break
                time.sleep(0.02)
            results: Dict[int, Any] = {}
            failures: Dict[int, str] = {}
            for r, path in enumerate(paths):
                if os.path.exists(path):
                    status, value = _load(path)
                    if status == "ok":
                        results[r] = value
                    else:
                        failures[r] = value
                elif procs[r].is_alive():
                    failures[r] = f"rank {r} still running after {timeout:g} s"
                elif r in may_die:
                    results[r] = None
                else:
                    failures[r] = f"rank {r} exited with code {procs[r].exitcode} without reporting"
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(2)
                if p.is_alive():
                    p.kill()
                    p.join(2)
        if failures:
            text = "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(failures.items()))
            raise SpawnError(f"{len(failures)} of {nprocs} workers failed:\n{text}", failures)
        return [results[r] for r in range(nprocs)]


def _load(path: str):
    with open(path, "rb") as f:
        return pickle.load(f)


def processes_naming(marker: str) -> list[int]:
    """The live processes (not zombies) whose command line holds ``marker`` (a run directory), this
    process and its ancestors aside."""
    mine, pid = set(), os.getpid()
    while pid > 1 and pid not in mine:
        mine.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) in mine:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":   # exited, not yet reaped: nothing to end
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            continue
    return out


def end_launcher(proc: subprocess.Popen, marker: str | None = None, grace: float = 10.0) -> None:
    """End a ``hetero launch`` started by :func:`run_launcher` (or any Popen with
    ``start_new_session=True``) and everything it started: SIGTERM first (the launcher then ends its
    job's node launchers, which run in sessions of their own), SIGKILL to its process group after
    ``grace`` seconds, then SIGKILL to the session of any process whose command line still names
    ``marker`` (the run directory: node launchers and workers the launcher could not end)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            pass
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 10.0   # then until none is left (a killed process takes a moment to go)
    while marker and time.monotonic() < deadline:
        pids = processes_naming(marker)
        if not pids:
            break
        for pid in pids:
            try:   # its session: a node launcher and its workers
                sid = os.getsid(pid)
                if sid != os.getsid(0):
                    os.killpg(sid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.2)


def run_launcher(cmd, timeout: float, marker: str | None = None, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)`` for commands
    that start process trees (``hetero launch``): the command leads a session of its own, and on the
    timeout it and everything it started are ended (:func:`end_launcher`, ``marker``: the run
    directory) before ``subprocess.TimeoutExpired`` is raised, so no orphan outlives the test."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_launcher(proc, marker)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    except BaseException:   # KeyboardInterrupt, pytest-timeout: nothing left running either
        end_launcher(proc, marker)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
