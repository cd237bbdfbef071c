"""The processes of an in-process elastic run: the launcher starts every worker itself.

Not through torchrun, whose agent ends a node's other workers when one of them fails: each worker
is one process per rank, in a session of its own, told the coordinator's port
(:data:`~.protocol.RECONFIG_ENV`), and tied to the launcher's life (:mod:`hetero.runtime.lifeline`).
The workers of emulated devices are forked from a preloaded fork server (:mod:`.forkserver`), the
others are fresh interpreters (:class:`WorkerStarter`).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from hetero.runtime.elastic.protocol import RECONFIG_ENV
from hetero.runtime.lifeline import child_env
from hetero.runtime.torchrun_loopback import FORK_ENV, WORKER_MODULE


class WorkerStarter:
    """Starts one elastic launcher's workers (:meth:`start`), forking those of emulated devices
    (node environment :data:`~hetero.runtime.torchrun_loopback.FORK_ENV` ``=fork``, as a local
    launch's node launcher does) from a fork server that is started by :meth:`prestart` or by the
    first of them, and ended by :meth:`close`. ``run_dir``: the run's directory, which the server's
    command line names."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.server = None

    @staticmethod
    def forks(node) -> bool:
        return node.env.get(FORK_ENV) == "fork" and hasattr(os, "fork")

    def prestart(self, node) -> None:
        """Start the fork server now, where ``node``'s workers are forked: its imports then run
        while the launcher prepares the run."""
        if self.server is None and self.forks(node):
            from hetero.runtime.elastic.forkserver import ForkServer

            self.server = ForkServer({**os.environ, **node.env, **child_env()}, self.run_dir)

    def start(self, node, local: int, world: int, spec_path: str, extra, port: int,
              env: dict[str, str] | None = None, host: str | None = None):
        """The worker of local rank ``local`` of node slot ``node`` (a
        :class:`~hetero.runtime.launcher.NodeCommand`) in a world of ``world`` ranks, running the
        run file ``spec_path`` with the worker's ``extra`` arguments, its coordinator on ``port``;
        ``env``: more variables (a joiner's :data:`~.protocol.JOIN_ENV`); ``host``: the
        coordinator's machine when it is not this one (:mod:`.agent`). A ``subprocess.Popen``, or a
        :class:`~.forkserver.ForkedWorker` with the same interface."""
        variables = {**os.environ, **node.env, "LOCAL_RANK": str(local), "RANK": str(node.first_rank + local),
                     "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(node.num_ranks),
                     RECONFIG_ENV: f"{host}:{port}" if host else str(port), **(env or {}), **child_env()}
        args = ["--spec", spec_path, *extra]
        if self.forks(node):
            self.prestart(node)
            return self.server.start(args, variables)
        return subprocess.Popen([sys.executable, "-m", WORKER_MODULE, *args], env=variables, start_new_session=True)

    def close(self) -> None:
        """End the fork server (after the workers: they end with it)."""
        if self.server is not None:
            self.server.close()
            self.server = None


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
