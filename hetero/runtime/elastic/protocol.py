"""What the elastic launcher and its workers agree on: environment variables, store keys, the pause
request file, the signal of a lost peer and the run directories of later generations.

Both sides import this module and nothing of each other: the launcher's controller
(:mod:`.live`, :mod:`.joiners`, :mod:`.watch`) writes what the workers' side (:mod:`.reconfig`,
:mod:`.joining`, :mod:`hetero.runtime.worker`) reads, and the other way round. It imports nothing.
The coordination's own keys (check-ins, decisions, the exchange) are
:mod:`hetero.runtime.reshard.live`'s.
"""
from __future__ import annotations

import os

RECONFIG_ENV = "HETERO_RECONFIG_PORT"
"""The coordinator store's ``port`` (on 127.0.0.1) or ``host:port``: set by the launcher for the
in-process path (:func:`coordinator_endpoint`)."""

COORDINATOR_PORT_OFFSET = 1
"""A run whose machines each start their own node slot (``--elastic --node-rank R``) finds the
coordinator's store on node slot 0's machine at the rendezvous port plus this."""

JOIN_ENV = "HETERO_JOIN"
"""``<generation>:<id>``: set by the launcher for a worker that joins a running in-process run."""

PEER_LOST_SIGNAL = "SIGUSR1"
"""The signal the launcher sends every survivor the moment it sees a worker's process end: a
survivor in the middle of its pipeline schedule (compute for seconds before its next operation with
the lost rank) stops there instead of finishing it (:meth:`.reconfig.LiveReconfig.watch`)."""

PAUSE_REQUEST = "reconfigure.request"
"""The file in an attempt's run directory that asks its workers to pause at the next step boundary
(the cluster file changed: :mod:`.watch`)."""


def timing_key(gen: int, me: int) -> str:
    """Where a process of generation ``gen``'s plan puts what each phase of its reconfiguration took."""
    return f"hetero/reconfig/gen{gen}/timing/{me}"


def ready_key(gen: int, me: int) -> str:
    """Set by a joining process once it is ready to take part in generation ``gen``'s exchange."""
    return f"hetero/reconfig/gen{gen}/joined/{me}"


def prepare_key(gen: int, rank: int) -> str:
    """Where a running rank finds, while it trains, the run file of the plan it will reshard into
    and its rank there (it prepares its new regions as the joiners do theirs)."""
    return f"hetero/reconfig/gen{gen}/prepare/{rank}"


def prepared_key(gen: int, rank: int) -> str:
    """Set by a running rank once its new regions are prepared (:func:`prepare_key`)."""
    return f"hetero/reconfig/gen{gen}/prepared/{rank}"


def history_key(gen: int) -> str:
    """What the running rank 0 leaves for the joiners when it pauses: the step results so far, the
    step the run ends at and the fp16 loss scale."""
    return f"hetero/reconfig/gen{gen}/history"


def root_run_dir(run_dir: str) -> str:
    """The run directory of generation 0 (later generations' are ``gen<g>`` inside it)."""
    base = os.path.basename(run_dir.rstrip(os.sep))
    return os.path.dirname(run_dir.rstrip(os.sep)) if base.startswith("gen") and base[3:].isdigit() else run_dir


def generation_dir(run_dir: str, gen: int) -> str:
    """The run directory of generation ``gen`` of the run whose (any generation's) directory is ``run_dir``."""
    return os.path.join(root_run_dir(run_dir), f"gen{gen}")


def coordinator_endpoint(value: str) -> tuple[str, int]:
    """``(host, port)`` of a :data:`RECONFIG_ENV` value (a bare port is on 127.0.0.1)."""
    host, _, port = value.rpartition(":")
    return host or "127.0.0.1", int(port)


# ---- the coordinator and the launchers of the other machines (:mod:`.agent`, :mod:`.remote`)

RUN_OVER_KEY = "hetero/agents/over"
"""Set by the coordinator's launcher when the run ended: ``ok`` or ``failed``; every other
machine's launcher then ends its workers and returns."""


SUMMARY_KEY = "hetero/agents/summary"
"""The run summary, put there by the launcher of the machine where rank 0 finished (a
reconfiguration may have moved rank 0 off node slot 0's machine)."""


def agent_key(slot: int, what: str) -> str:
    """A key of node slot ``slot``'s launcher (``beat``: its heartbeat counter; ``bye``: it saw the end)."""
    return f"hetero/agents/slot{slot}/{what}"


def worker_key(wid: int, what: str) -> str:
    """A key about the worker process ``wid`` (its rank in generation 0): ``pid``, ``exit`` (its exit
    status), ``report`` (its error report, when it left one), ``signals`` (how many signals were
    asked for) and ``signal/<n>`` (the n-th, a number)."""
    return f"hetero/agents/worker{wid}/{what}"


INITIAL_SLOTS_KEY = "hetero/agents/initial"
"""The node slots of the run as it started (JSON list), set by the coordinator's launcher: a call
whose ``--node-rank`` is not one of them is a machine that joins (:mod:`.agent`)."""


def join_key(slot: int) -> str:
    """What node slot ``slot``'s joining launcher starts, set by the coordinator's launcher once a
    change of the cluster file puts ranks there (:mod:`.joiners`): JSON ``{"gen", "cluster", "plan",
    "ids"}`` (the new plan's cluster and plan as dicts; ``ids``: local rank -> worker id)."""
    return agent_key(slot, "join")
