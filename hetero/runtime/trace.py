"""Chrome / Perfetto traces of training runs (``hetero launch --trace``).

A run's trace has one process per rank and one complete event per forward (F) or backward (B)
of a micro-batch, then per step the gradient sync and the optimizer; on a second row ("gradient sync")
one event per bucket of gradients, from the start of its collective to its completion, so a reduction
overlapped with the backward shows under it, and under ZeRO with overlap one per parameter all-gather
of the previous step ("param gather"), which runs under the step's first forwards. Event times are wall-clock (``time.time()``) on the ranks, so the traces of an
elastic run's attempts line up on one time axis: :func:`merge_traces` puts them in one file, each
attempt's ranks as processes of their own, with a marker at each reconfiguration.
"""
from __future__ import annotations

import json

ORIGIN_KEY = "clock_origin_unix_s"
"""``otherData`` entry: the wall-clock time (s) that a trace's ``ts`` 0 stands for."""


_KINDS = {"F": (None, "forward"), "B": (None, "backward"), "S": ("gradient sync", "dp"),
          "O": ("optimizer", "optimizer")}
"""Event kind -> (name, or None for kind + micro-batch; category, as the predicted step's)."""


def trace_dict(layout, events_by_rank: list, ranks: list[int] | None = None) -> dict:
    """A Chrome / Perfetto trace: one process per rank, one complete event per F / B, and per step
    the gradient sync (S) and the optimizer (O).
    ``events_by_rank[r]``: rank r's ``(kind, micro_batch, step, start_unix_s, duration_s)``;
    ``ranks``: the ranks of ``layout`` to put in (default: all)."""
    all_t = [e[3] for evs in events_by_rank for e in evs]
    t0 = min(all_t) if all_t else 0.0
    out = []
    for info in layout.ranks:
        if ranks is not None and info.rank not in ranks:
            continue
        out.append({"name": "process_name", "ph": "M", "pid": info.rank, "tid": 0,
                    "args": {"name": f"rank {info.rank} {info.group} p{info.pipeline}r{info.replica}s{info.stage}"
                                     + (f" tp{info.tp_rank}" if info.tp_size > 1 else "")}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": info.rank, "tid": 0,
                    "args": {"sort_index": info.rank}})
        if any(e[0] in ("R", "G", "W") for e in events_by_rank[info.rank]):
            out.append({"name": "thread_name", "ph": "M", "pid": info.rank, "tid": 1,
                        "args": {"name": "gradient sync"}})
        for kind, mb, step, t, d in events_by_rank[info.rank]:
            if kind in ("R", "G", "W"):   # a bucket's all-reduce (ZeRO: reduce-scatter), or ZeRO's parameter
                # all-gather of the previous step run under this one's forward, from its start to its
                # completion, and where the forward first used its parameters and waited for it (W)
                name = {"R": "bucket", "G": "param gather", "W": "forward waits for param gather"}[kind]
                out.append({"name": f"{name} {mb}", "cat": "wait" if kind == "W" else "dp", "ph": "X",
                            "pid": info.rank, "tid": 1, "ts": (t - t0) * 1e6, "dur": d * 1e6,
                            "args": {"step": step, "bucket": mb}})
                continue
            name, cat = _KINDS.get(kind, (None, "other"))
            out.append({"name": name or f"{kind}{mb}", "cat": cat, "ph": "X",
                        "pid": info.rank, "tid": 0, "ts": (t - t0) * 1e6, "dur": d * 1e6,
                        "args": {"step": step, "micro_batch": mb, "stage": info.stage, "pipeline": info.pipeline}})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {ORIGIN_KEY: t0}}


PIDS_PER_ATTEMPT = 100_000
"""Attempt k's rank r is process ``k * PIDS_PER_ATTEMPT + r`` in a merged trace."""

LEFT_PART = "left-gen{gen}-rank{rank}.trace.json"
"""The trace part a process writes in the run directory when an in-process reconfiguration leaves it
out (its events up to then; the final plan's ranks write the rest at the end)."""


def merge_traces(paths: list[str | None], reconfigurations: list[dict], labels: list[str] | None = None) -> dict:
    """One trace of an elastic run: ``paths[k]`` is attempt k's trace (None: it left none), and
    ``reconfigurations`` the summary's entries with the wall-clock time each began (``_failed_at``).
    Each attempt's ranks become processes named ``attempt k: rank ...`` (``labels[k]`` instead of
    ``attempt k`` where given: the part of a process that left an in-process run); each
    reconfiguration is a global instant event at the failure or change that started it."""
    traces = []
    for k, path in enumerate(paths):
        if path is None:
            continue
        with open(path) as f:
            traces.append((k, json.load(f)))
    origins = [t.get("otherData", {}).get(ORIGIN_KEY) for _, t in traces]
    origin = min((o for o in origins if o), default=0.0)
    out = []
    for (k, trace), own in zip(traces, origins):
        shift = ((own or origin) - origin) * 1e6
        for e in trace["traceEvents"]:
            e = {**e, "pid": k * PIDS_PER_ATTEMPT + e["pid"]}
            if e.get("ph") == "M" and e["name"] == "process_name":
                label = labels[k] if labels is not None else f"attempt {k}"
                e["args"] = {"name": f"{label}: {e['args']['name']}"}
            elif e.get("ph") == "M" and e["name"] == "process_sort_index":
                e["args"] = {"sort_index": e["pid"]}
            elif "ts" in e:
                e["ts"] = e["ts"] + shift
            out.append(e)
    for rc in reconfigurations:
        if rc.get("_failed_at") is not None:
            out.append({"name": f"reconfiguration before step {rc['step']}: {rc['reason']}", "ph": "i", "s": "g",
                        "pid": 0, "tid": 0, "ts": (rc["_failed_at"] - origin) * 1e6,
                        "args": {k: v for k, v in rc.items() if not k.startswith("_") and k != "plan"}})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {ORIGIN_KEY: origin}}
