"""hetero's torchrun: the node launcher that ``hetero launch`` runs for every node slot.

    python -m hetero.runtime.torchrun_loopback <torchrun arguments>

It is ``torchrun`` (run in this process) with three differences, all about the rendezvous store
and what a node slot prints:

- Node slot 0 hosts the static rendezvous store itself (a multi-tenant ``TCPStore``: torchrun's
  rendezvous asks for one on the same port and gets this server instead of binding a new one; torch
  keeps one server per port per process). On a loopback ``--master-addr`` (a local launch) the
  store listens on that address only: torchrun's own listens on every interface and torch offers
  no bind address, so the socket is bound here and handed over (``master_listen_fd``). On any
  other address it listens where torchrun's would.
- After a successful run node slot 0 keeps the store until every other node slot has checked out
  (a key each sets once its own torchrun returned; at most :data:`CHECKOUT_WAIT_S`). torchelastic's
  exit barrier otherwise races the store's shutdown (pytorch/pytorch#69520): slot 0 passes the
  barrier and exits, closing the store under a slot that is still waiting on it, which then logs
  a C++ stack and "Error waiting on exit barrier" after a run that succeeded.
- Workers of a node slot whose devices are emulated (the launcher sets :data:`FORK_ENV`) are forked
  from this process, torchrun's own function entrypoint with ``--start-method=fork``, instead of
  each starting a fresh interpreter: torch and the runtime's modules are imported once, here, before
  any worker exists (what that saves is measured in docs/emulation.md). A slot of GPUs or
  NPUs keeps torchrun's fresh processes (a CUDA or CANN runtime must not be forked); so does any
  worker with ``HETERO_WORKER_START=spawn`` in the environment.
- Failures are said in one line at most, not in torchelastic's tracebacks: a worker that reported
  its own error (``rank<r>.error.json`` beside the run file) is left to that report and to the
  launcher's; a worker that ended without one (a signal, an exit status of its own) is named in one
  line; a node slot stopped by a signal (the launcher ending the job) says nothing.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import time

# a master address on this machine's loopback interface gets a store bound there only (the launcher's too)
from hetero.specs.cluster import is_loopback

CHECKOUT_WAIT_S = 30.0
"""Longest node slot 0 keeps the store for the other slots to check out after its own run succeeded
(they check out right after their exit barrier: normally well under a second)."""
CHECKOUT_KEY = "hetero/checkout/{slot}"


FORK_ENV = "HETERO_WORKER_START"
"""``fork`` (set by the launcher for emulated device groups): workers are forked from the node
launcher; ``spawn`` or unset: torchrun starts each as ``python -m hetero.runtime.worker``."""
WORKER_MODULE = "hetero.runtime.worker"
"""The module every node launcher runs as its workers (named in its torchrun arguments)."""

_NOISE = ("Received %s death signal", "Sending process %s closing signal", "failed (exitcode: ",
          "Error waiting on exit barrier", "Got termination signal", "Terminating process %s via signal")
"""torchelastic log lines this wrapper replaces: the agent being stopped, the failure summary that
precedes ChildFailedError, the exit-barrier race, and (forked workers) torch.multiprocessing ending
a node's other workers after one failed."""
_NOISY_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api",
                  "torch.multiprocessing.spawn")


def torchrun_option(argv: list[str], name: str) -> str | None:
    """The value of ``--name`` in a torchrun argument list (``--x=v`` or ``--x v``, dashes or underscores)."""
    value = None
    spellings = (name, name.replace("-", "_"))
    for i, arg in enumerate(argv):
        if arg in ("-m", "--module"):
            break   # the worker module and its own arguments follow
        for spelling in spellings:
            if arg.startswith(spelling + "="):
                value = arg.split("=", 1)[1]
            elif arg == spelling and i + 1 < len(argv):
                value = argv[i + 1]
    return value


def master_endpoint(argv: list[str]) -> tuple[str, int]:
    """(``--master-addr``, ``--master-port``) of a torchrun argument list."""
    addr, port = torchrun_option(argv, "--master-addr"), torchrun_option(argv, "--master-port")
    if addr is None or port is None:
        raise SystemExit("torchrun_loopback: give --master-addr and --master-port")
    return addr, int(port)


def bind_store(addr: str, port: int):
    """A multi-tenant store server listening on ``addr:port`` only (kept alive by the caller)."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    store = TCPStore(addr, port, is_master=True, multi_tenant=True, master_listen_fd=sock.fileno(),
                     wait_for_workers=False)
    return store, sock


def host_store(addr: str, port: int):
    """Node slot 0's store server: on ``addr`` only when it is a loopback address, else on every
    interface as torchrun's own (the caller printed that address)."""
    if is_loopback(addr):
        return bind_store(addr, port)
    from torch.distributed import TCPStore

    return TCPStore(addr, port, is_master=True, multi_tenant=True, wait_for_workers=False), None


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NOISE)


def _say(slot: str, text: str) -> None:
    print(f"[hetero torchrun] node slot {slot}: {text}", file=sys.stderr, flush=True)


def _reported(rank: int) -> bool:
    """The worker of ``rank`` left an error report beside the run file (it printed its own message)."""
    from hetero.runtime.spec import SPEC_ENV

    spec = os.environ.get(SPEC_ENV)
    return bool(spec) and os.path.exists(os.path.join(os.path.dirname(spec), f"rank{rank}.error.json"))


def _name_unreported(slot: str, error) -> None:
    """One line for the first worker that failed (torchelastic's root cause) when it left no report;
    the node slot's other workers were then ended by torchrun itself (SIGTERM), which is no news."""
    rank, failure = error.get_first_failure()
    if _reported(rank):
        return
    how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
           else f"exited with status {failure.exitcode}")
    _say(slot, f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how} without reporting an error")


def _check_out(store, slot: int, nnodes: int, addr: str, port: int) -> None:
    """After a successful run: slot 0 waits (bounded) for the others' check-out keys, the others set theirs."""
    from datetime import timedelta

    if slot == 0:
        keys = [CHECKOUT_KEY.format(slot=s) for s in range(1, nnodes)]
        deadline = time.monotonic() + CHECKOUT_WAIT_S
        while keys and time.monotonic() < deadline and not store.check(keys):
            time.sleep(0.02)
        return
    from torch.distributed import TCPStore

    client = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False)
    client.set(CHECKOUT_KEY.format(slot=slot), "1")


def _default_stop_signals() -> None:
    """Put SIGTERM, SIGHUP and SIGQUIT back to ending the process. torchelastic's handlers raise
    SignalException on them: after torchrun returned, the launcher's teardown then printed a
    traceback from the interpreter's exit; and a worker forked from this process inherits them."""
    import signal

    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.SIG_DFL)


def _worker_args(argv: list[str]) -> list[str] | None:
    """The worker's own arguments when ``argv`` runs ``-m hetero.runtime.worker`` and the workers are
    to be forked (:data:`FORK_ENV`), else None."""
    if os.environ.get(FORK_ENV) != "fork" or not hasattr(os, "fork"):
        return None
    for i, arg in enumerate(argv[:-1]):
        if arg in ("-m", "--module") and argv[i + 1] == WORKER_MODULE:
            return argv[i + 2:]
    return None


def preload_worker_modules() -> None:
    """Import what every worker imports, once, before they are forked (no thread is started by it,
    and no device runtime is initialised)."""
    import torch._dynamo  # noqa: F401 - torch.optim's first optimizer imports it

    import hetero.runtime.trainer  # noqa: F401
    import hetero.runtime.worker  # noqa: F401


def _forked_worker(*argv: str) -> None:
    """A worker forked from the node launcher (torchrun's function entrypoint): the signal handlers
    torchelastic installed in this process are put back to the defaults a fresh worker has, then the
    worker runs. A failure ends the process at once with its status, as ``python -m`` would after
    the worker's report (see hetero.runtime.worker's end); success returns, for torchrun's count."""
    import signal

    _default_stop_signals()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from hetero.runtime import worker

    code = worker.main(list(argv))
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _torchrun_forking(argv: list[str], worker_args: list[str]) -> None:
    """torchrun's ``run`` with the worker as a function forked from this process."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args(argv)
    args.start_method = "fork"
    config, _cmd, _cmd_args = config_from_args(args)
    elastic_launch(config=config, entrypoint=_forked_worker)(*worker_args)


def main(argv: list[str] | None = None) -> int:
    from hetero.runtime.lifeline import child_env, end_with_parent

    end_with_parent()   # the launcher died: so does this node slot, and its workers with it
    os.environ.update(child_env())   # the workers (forked or spawned, from this thread) end with this process
    argv = list(sys.argv[1:] if argv is None else argv)
    worker_args = _worker_args(argv)
    if worker_args is not None:
        preload_worker_modules()
    addr, port = master_endpoint(argv)
    slot_text = torchrun_option(argv, "--node-rank") or "0"
    slot, nnodes = int(slot_text), int((torchrun_option(argv, "--nnodes") or "1").split(":")[-1])
    store = None
    if slot == 0:
        try:
            store, _sock = host_store(addr, port)   # noqa: F841 - both live as long as this process
        except Exception as e:  # noqa: BLE001 - said in one line: the port is taken, the address is not here
            _say(slot_text, f"cannot host the rendezvous store on {addr}:{port}: {str(e).splitlines()[0]} "
                            f"(fix: give a free --master-port, and a --master-addr of this machine)")
            return 1
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).addFilter(_DropNoise())
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        if worker_args is not None:
            _torchrun_forking(argv, worker_args)
        else:
            torchrun(argv)
    except SignalException as e:   # stopped (the launcher ending the job): its workers were ended too
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        _name_unreported(slot_text, e)
        return 1
    except Exception as e:  # noqa: BLE001 - a rendezvous that failed, a store that went away
        _say(slot_text, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}")
        return 1
    finally:
        _default_stop_signals()
    try:
        _check_out(store, slot, nnodes, addr, port)
    except Exception:  # noqa: BLE001 - the run succeeded; a check-out nobody waits for any more is moot
        pass
    return 0


def _exit(code: int) -> None:
    """End the node launcher once its work is done: exit handlers run and output is flushed, but
    the interpreter's teardown of torch and the compiler stack (slow, with nothing left to release:
    the workers are gone and the store is ended by the exit itself) is skipped."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
