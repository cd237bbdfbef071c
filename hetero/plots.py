"""PNG pictures of what the tables say in numbers: a step's schedule and memory (``hetero predict
--plot``), the predicted step above a measured one (``hetero launch --plot``), a stage's planned
memory arena (``hetero memplan --plot``).

matplotlib is optional (``pip install 'hetero[plot]'``); it is imported here only, with the Agg
backend (files, no display), so nothing else pays for it.
"""
from __future__ import annotations

import io

from hetero.errors import HeteroError

CATEGORY_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "p2p": "#8c8c8c", "dp": "#55a868",
                    "optimizer": "#c44e52", "wait": "#e0e0e0", "steady": "#b4a0b8"}
"""Chrome-trace categories of the predicted step (and of ``hetero launch --trace``)."""
OTHER_COLOUR = "#8172b3"


def require_matplotlib(flag: str = "--plot") -> None:
    """Raise a HeteroError naming ``flag`` and the fix when matplotlib is missing: called before
    the work a plot follows (a recording or a training run), so it is not lost to a missing package."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise HeteroError(f"{flag} needs matplotlib, which is not installed (fix: pip install matplotlib, "
                          f"or pip install 'hetero[plot]')") from None


def load_pyplot(flag: str):
    """``matplotlib.pyplot`` drawing to files only (Agg); without matplotlib, the error that names
    ``flag`` and what to install."""
    require_matplotlib(flag)
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig) -> bytes:
    """The figure as PNG bytes (written by the caller, atomically); the figure is closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return buf.getvalue()


def trace_rows(trace: dict) -> list[tuple[tuple, str, list[dict]]]:
    """The complete ("X") events of a Chrome trace by row: ``[((pid, tid), label, events)]`` in
    (pid, tid) order, labelled from the trace's process / thread names."""
    procs, threads, rows = {}, {}, {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e.get("args", {}).get("name", f"process {e['pid']}")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid", 0))] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "X":
            rows.setdefault((e["pid"], e.get("tid", 0)), []).append(e)
    out = []
    for key in sorted(rows):
        pid, tid = key
        name = procs.get(pid, f"process {pid}")
        out.append((key, f"{name}: {threads[key]}" if threads.get(key) else name, rows[key]))
    return out


MERGE_ABOVE = 48
"""A row with more forward / backward bars than this draws its first and last :data:`KEEP` as they
are and the ones between as one bar (category ``steady``): at a few pixels each they would read as
one solid stripe anyway, and the schedule's shape is in its start and end."""
KEEP = 8


def _merged(events: list[dict]) -> list[dict]:
    """``events`` of one row with the middle of its forward / backward run merged (:data:`MERGE_ABOVE`)."""
    compute = sorted((e for e in events if e.get("cat") in ("forward", "backward")), key=lambda e: e["ts"])
    if len(compute) <= MERGE_ABOVE:
        return events
    middle = compute[KEEP:-KEEP]
    start, end = middle[0]["ts"], max(e["ts"] + e.get("dur", 0.0) for e in middle)
    inner = {id(e) for e in middle}
    return [e for e in events if id(e) not in inner] + [
        {"ph": "X", "cat": "steady", "name": f"{len(middle)} forwards and backwards", "ts": start, "dur": end - start}]


LEGEND_ROW_PT = 22
"""Points between a Gantt chart's axes and a title above it: the height of the legend row there."""


def draw_gantt(ax, trace: dict) -> dict[str, int]:
    """One horizontal bar per event of ``trace`` (seconds on x, one row per process / thread),
    coloured by category, the middle of a long forward / backward run merged into one ``steady``
    bar (:data:`MERGE_ABOVE`); returns the number of bars drawn per category."""
    rows = trace_rows(trace)
    drawn: dict[str, int] = {}
    for y, (_, _, events) in enumerate(rows):
        by_cat: dict[str, list] = {}
        for e in _merged(events):
            by_cat.setdefault(e.get("cat", ""), []).append((e["ts"] / 1e6, max(e.get("dur", 0.0), 0.0) / 1e6))
        for cat, spans in by_cat.items():
            ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=CATEGORY_COLOURS.get(cat, OTHER_COLOUR),
                           edgecolor="white", linewidth=0.2)
            drawn[cat] = drawn.get(cat, 0) + len(spans)
    ax.set_yticks(range(len(rows)), [label for _, label, _ in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("time (s)")
    from matplotlib.patches import Patch

    names = {"steady": f"forward + backward (beyond the first and last {KEEP} of a long run)"}
    ax.legend(handles=[Patch(color=CATEGORY_COLOURS.get(c, OTHER_COLOUR), label=names.get(c, c or "other"))
                       for c in sorted(drawn)],
              loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=7, ncol=max(len(drawn), 1), frameon=False)
    return drawn


def step_figure(prediction, plan=None, title: str = ""):
    """The predicted step: its schedule as a Gantt chart (``prediction`` made with
    ``timeline=True``), and each stage's predicted peak memory against its device's capacity (with
    ``plan``, an interleaved pipeline's devices once each, not every model chunk)."""
    plt = load_pyplot("--plot")
    trace = prediction.timeline()
    rows = len(trace_rows(trace))
    stages = []
    for pi, p in enumerate(prediction.to_dict()["pipelines"]):
        phys = len(plan.physical_stages(plan.pipelines[pi])) if plan is not None else len(p["stages"])
        for si, s in enumerate(p["stages"][:phys]):   # a device's chunks share its memory
            held = [c["layers"][1] - c["layers"][0] for c in p["stages"][si::phys]]
            stages.append((pi, si, {**s, "held_layers": sum(held)} if len(held) > 1 else s))
    height = min(2.5 + 0.28 * rows + 0.3 * len(stages), 60.0)   # a very deep plan: rows get thin, not lost
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, height),
                                      gridspec_kw={"height_ratios": [max(rows, 2), max(len(stages), 2)]})
    draw_gantt(top, trace)
    top.axvline(prediction.iteration_time_s, color="black", linewidth=0.8, linestyle="--")
    fig.suptitle(title or f"predicted step: {prediction.iteration_time_s:.4g} s, "
                          f"{prediction.tokens_per_s:,.0f} tokens/s", fontsize=10)
    draw_stage_memory(bottom, stages)
    fig.tight_layout()
    return fig


def one_step(trace: dict, step: int | None = None) -> tuple[dict, int, float]:
    """The events of one step of a run's trace (``hetero launch --trace``: every event carries its
    step), shifted to start at 0: ``(trace of that step, the step, its span in s)``. By default the
    step whose span is the median of the steps after the first (the first pays for warm-up)."""
    spans: dict[int, list[float]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and "step" in e.get("args", {}):
            lo, hi = spans.get(e["args"]["step"], [float("inf"), float("-inf")])
            spans[e["args"]["step"]] = [min(lo, e["ts"]), max(hi, e["ts"] + e.get("dur", 0.0))]
    if not spans:
        raise HeteroError("the run's trace has no forward or backward events to draw")
    if step is None:
        later = sorted(spans)[1:] or sorted(spans)
        by_span = sorted(later, key=lambda k: spans[k][1] - spans[k][0])
        step = by_span[(len(by_span) - 1) // 2]
    t0 = spans[step][0]
    events = [e for e in trace["traceEvents"] if e.get("ph") == "M"]
    events += [{**e, "ts": e["ts"] - t0} for e in trace["traceEvents"]
               if e.get("ph") == "X" and e.get("args", {}).get("step") == step]
    return {"traceEvents": events}, step, (spans[step][1] - spans[step][0]) / 1e6


def run_figure(prediction, trace: dict, title: str = ""):
    """The predicted step (``prediction`` made with ``timeline=True``) above one measured step of
    the run's trace (:func:`one_step`), on one time scale: where the schedules agree, and where the
    prediction is off, at a glance. Both hold the schedule, the gradient sync and the optimizer (a
    trace of an older run: forwards and backwards only, and the title says so)."""
    plt = load_pyplot("--plot")
    predicted = prediction.timeline()
    measured, step, span = one_step(trace)
    rows_p, rows_m = len(trace_rows(predicted)), len(trace_rows(measured))
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(12, min(3.0 + 0.28 * (rows_p + rows_m), 60.0)),
                                      gridspec_kw={"height_ratios": [max(rows_p, 2), max(rows_m, 2)]})
    draw_gantt(top, predicted)
    top.set_xlabel("")
    # each panel's title on a line of its own above the legend row draw_gantt puts over the axes
    top.set_title(f"predicted: {prediction.iteration_time_s:.4g} s per step", fontsize=9, loc="right",
                  pad=LEGEND_ROW_PT)
    drawn = draw_gantt(bottom, measured)
    what = ("schedule, gradient sync and optimizer" if "dp" in drawn or "optimizer" in drawn
            else "forwards and backwards only")
    bottom.set_title(f"measured: step {step}, {what}: {span:.4g} s (the median step after the first)",
                     fontsize=9, loc="right", pad=LEGEND_ROW_PT)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def draw_stage_memory(ax, stages: list[tuple[int, int, dict]]) -> None:
    """Per stage (``(pipeline, stage, its prediction dict)``): predicted peak memory as a bar, the
    device's capacity as a diamond (not a tick mark, which it would read as); a bar over capacity is
    red. The axis unit follows the largest value (KiB, MiB, GiB), so small stages do not read as 0."""
    largest = max([max(s["peak_memory_bytes"], s.get("memory_capacity_bytes") or 0) for _, _, s in stages] or [0])
    unit, scale = next(((u, f) for u, f in (("TiB", 2.0 ** 40), ("GiB", 2.0 ** 30), ("MiB", 2.0 ** 20),
                                            ("KiB", 2.0 ** 10)) if largest >= f), ("B", 1.0))
    labels, peaks, caps = [], [], []
    for pi, si, s in stages:
        where = (f"{s['held_layers']} layers" if "held_layers" in s else f"L{s['layers'][0]}:{s['layers'][1]}")
        labels.append(f"p{pi} s{si} {s['group']} tp{s['tp']} {where}")
        peaks.append(s["peak_memory_bytes"] / scale)
        caps.append((s.get("memory_capacity_bytes") or 0) / scale)
    ys = range(len(stages))
    colours = ["#c44e52" if c and p > c else "#4c72b0" for p, c in zip(peaks, caps)]
    ax.barh(list(ys), peaks, color=colours, height=0.6)
    ax.scatter([c for c in caps], list(ys), marker="D", s=30, color="black", label="device capacity")
    ax.set_yticks(list(ys), labels, fontsize=7)
    ax.set_ylim(len(stages) - 0.5, -0.5)
    ax.set_xlabel(f"peak memory per device ({unit})")
    ax.legend(loc="lower right", fontsize=7)


def arena_figure(trace, arena, reserved_bytes: int, title: str = ""):
    """A memory plan in time and address: every planned block as a rectangle (its lifetime in trace
    events x its byte range in the arena), the bytes live at each event (the lower bound is their
    maximum), the arena's size and what the caching allocator reserves for the same trace."""
    plt = load_pyplot("--plot")
    import numpy as np
    from matplotlib.collections import PolyCollection

    mib = 2 ** 20
    fig, ax = plt.subplots(figsize=(12, 6))
    off, size = np.asarray(arena.offsets, dtype=float) / mib, np.asarray(arena.sizes, dtype=float) / mib
    s, e = np.asarray(arena.starts, dtype=float), np.asarray(arena.ends, dtype=float)
    boxes = np.stack([np.stack([s, off], 1), np.stack([e, off], 1), np.stack([e, off + size], 1),
                      np.stack([s, off + size], 1)], 1) if len(off) else np.zeros((0, 4, 2))
    # neighbouring blocks told apart by colour, cycling in allocation order
    shades = plt.get_cmap("tab20")(np.argsort(np.argsort(s, kind="stable")) % 20) if len(off) else None
    ax.add_collection(PolyCollection(boxes, facecolors=shades, edgecolors="none", alpha=0.85))
    live = np.asarray(trace.live_bytes(), dtype=float) / mib   # slot k: after event k - 1
    ax.plot(np.arange(len(live)), live, color="black", linewidth=0.8, label="bytes live (lower bound: the top)")
    ax.axhline(arena.arena_bytes / mib, color="#55a868", linestyle="--", label="planned arena")
    ax.axhline(reserved_bytes / mib, color="#c44e52", linestyle=":", label="caching allocator reserves")
    ax.set_xlim(0, max(len(trace.events), 1))
    ax.set_ylim(0, max(arena.arena_bytes, reserved_bytes, 1) / mib * 1.05)
    ax.set_xlabel("trace event (allocations and frees, in order)")
    ax.set_ylabel("address in the arena (MiB)")
    ax.set_title(title or f"planned layout of {len(off):,} blocks", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig


__all__ = ["arena_figure", "draw_gantt", "require_matplotlib", "draw_stage_memory", "one_step", "png_bytes", "run_figure", "step_figure",
           "trace_rows"]
