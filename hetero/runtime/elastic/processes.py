"""The processes of an in-process elastic run: the launcher starts every worker itself.

Not through torchrun, whose agent ends a node's other workers when one of them fails: each worker
is one process per rank, in a session of its own, told the coordinator's port
(:data:`~.protocol.RECONFIG_ENV`), and tied to the launcher's life (:mod:`hetero.runtime.lifeline`).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from hetero.runtime.elastic.protocol import RECONFIG_ENV
from hetero.runtime.lifeline import child_env
from hetero.runtime.torchrun_loopback import WORKER_MODULE


def start_worker(node, local: int, world: int, spec_path: str, extra, port: int,
                 env: dict[str, str] | None = None, host: str | None = None) -> subprocess.Popen:
    """The worker of local rank ``local`` of node slot ``node`` (a
    :class:`~hetero.runtime.launcher.NodeCommand`) in a world of ``world`` ranks, running the run
    file ``spec_path`` with the worker's ``extra`` arguments, its coordinator on ``port``; ``env``:
    more variables (a joiner's :data:`~.protocol.JOIN_ENV`); ``host``: the coordinator's machine when
    it is not this one (:mod:`.agent`)."""
    variables = {**os.environ, **node.env, "LOCAL_RANK": str(local), "RANK": str(node.first_rank + local),
                 "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(node.num_ranks), RECONFIG_ENV: f"{host}:{port}" if host else str(port),
                 **(env or {}), **child_env()}
    argv = [sys.executable, "-m", WORKER_MODULE, "--spec", spec_path, *extra]
    return subprocess.Popen(argv, env=variables, start_new_session=True)


def end_processes(procs, grace_s: float = 3.0) -> None:
    """End every process of ``procs`` still running (a ``subprocess.Popen``, or a worker on another
    machine, :class:`~.remote.RemoteWorker`): SIGTERM, ``grace_s`` to exit, then SIGKILL."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.02)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
