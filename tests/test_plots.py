"""PNG pictures: `hetero predict --plot` (the predicted step and each stage's memory) and
`hetero memplan --plot` (the planned arena). What is drawn is checked against the numbers it
comes from; matplotlib missing is a clear error."""
from __future__ import annotations

import sys

import pytest

import hetero
from conftest import CONFIGS, run_cli
from test_cli_foundation import assert_bad_input

pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"
PREDICT = ["--cluster", str(CONFIGS / "clusters" / "mixed-vendor.yaml"), "--model",
           str(CONFIGS / "models" / "llama2-7b.yaml"), "--plan", str(CONFIGS / "plans" / "mixed-vendor-llama2-7b.yaml")]


def test_predict_plot_draws_every_event_of_the_predicted_step(tmp_path):
    """One bar per event of the predicted step's trace (the same numbers as `--timeline`), on one
    row per device and its communication, and one memory bar per stage (red where over capacity)."""
    from hetero.plots import draw_gantt, step_figure, trace_rows

    cluster = hetero.load_cluster(CONFIGS / "clusters" / "mixed-vendor.yaml")
    model = hetero.load_model(CONFIGS / "models" / "llama2-7b.yaml")
    plan = hetero.load_plan(CONFIGS / "plans" / "mixed-vendor-llama2-7b.yaml")
    from hetero.predictor import predict

    pred = predict(cluster, model, plan, timeline=True)
    events = [e for e in pred.timeline()["traceEvents"] if e["ph"] == "X"]
    fig = step_figure(pred)
    top, bottom = fig.axes
    assert len(top.get_yticklabels()) == len(trace_rows(pred.timeline())) == 12   # 6 stages, compute + comm
    assert "pipeline 1 (1 replica, 72 micro-batches): stage 3 ascend tp2" in [t.get_text() for t in
                                                                                top.get_yticklabels()]
    import matplotlib.pyplot as plt

    ax = plt.figure().add_subplot()
    drawn = draw_gantt(ax, pred.timeline())
    counts = {}
    for e in events:
        counts[e["cat"]] = counts.get(e["cat"], 0) + 1
    assert set(counts) >= {"forward", "backward", "dp", "optimizer"}
    # a row of more than MERGE_ABOVE forwards and backwards keeps its first and last KEEP, the rest one bar
    from hetero.plots import KEEP, MERGE_ABOVE, trace_rows as rows_of

    long_rows = [evs for _, _, evs in rows_of(pred.timeline())
                 if sum(e["cat"] in ("forward", "backward") for e in evs) > MERGE_ABOVE]
    assert long_rows and drawn.get("steady") == len(long_rows)
    merged = sum(sum(e["cat"] in ("forward", "backward") for e in evs) - 2 * KEEP for evs in long_rows)
    assert drawn["forward"] + drawn["backward"] == counts["forward"] + counts["backward"] - merged
    assert all(drawn[c] == n for c, n in counts.items() if c not in ("forward", "backward"))
    bars = [p.get_width() for p in bottom.patches]
    stages = [s for p in pred.to_dict()["pipelines"] for s in p["stages"]]
    assert bars == pytest.approx([s["peak_memory_bytes"] / 2**30 for s in stages])
    plt.close("all")

    out = tmp_path / "step.png"
    proc = run_cli("predict", *PREDICT, "--plot", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes().startswith(PNG) and f"plot written to {out}" in proc.stdout


@pytest.mark.slow
def test_memplan_plot_draws_every_planned_block(tmp_path):
    """Every block of the planned layout is one rectangle at its offset over its lifetime; the
    curve of bytes live peaks at the lower bound the report gives."""
    import matplotlib.pyplot as plt

    from hetero.memplan import memory_plan_and_layout
    from hetero.memplan.record import record_stage
    from hetero.plots import arena_figure

    model = hetero.load_model(CONFIGS / "models" / "tiny.yaml")
    plan = hetero.load_plan(CONFIGS / "plans" / "local-cpu-tiny.yaml")
    trace = record_stage(model, plan, 0, 0, 2)
    report, cached, arena = memory_plan_and_layout(trace)
    fig = arena_figure(trace, arena, cached.reserved_bytes)
    ax = fig.axes[0]
    (boxes,) = ax.collections
    paths = boxes.get_paths()
    assert len(paths) == len(arena.offsets) > 100
    i = max(range(len(arena.sizes)), key=lambda k: arena.sizes[k])   # the largest block, where it was placed
    xs, ys = paths[i].vertices[:, 0], paths[i].vertices[:, 1]
    assert (xs.min(), xs.max()) == (arena.starts[i], arena.ends[i])
    assert (ys.min(), ys.max()) == pytest.approx((arena.offsets[i] / 2**20, (arena.offsets[i] + arena.sizes[i]) / 2**20))
    live = ax.lines[0].get_ydata()
    assert len(live) == len(trace.events) + 1
    assert max(live) == pytest.approx(report["lower_bound_bytes"] / 2**20)
    plt.close(fig)

    out = tmp_path / "arena.png"
    proc = run_cli("memplan", "--model", str(CONFIGS / "models" / "tiny.yaml"), "--plan",
                   str(CONFIGS / "plans" / "local-cpu-tiny.yaml"), "--json", "--plot", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes().startswith(PNG)
    assert proc.stdout.lstrip().startswith("{")   # --json: stdout stays the JSON alone


def test_plot_path_is_checked_before_the_work(tmp_path):
    assert_bad_input(run_cli("predict", *PREDICT, "--plot", str(tmp_path)), "--plot", "is a directory")
    proc = run_cli("memplan", "--model", str(CONFIGS / "models" / "tiny.yaml"), "--plan",
                   str(CONFIGS / "plans" / "local-cpu-tiny.yaml"), "--plot", "/dev/null")
    assert_bad_input(proc, "--plot", "not a regular file")


def test_without_matplotlib_a_plot_is_a_clear_error(monkeypatch, tmp_path, capsys):
    from hetero.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib raises ImportError
    out = tmp_path / "step.png"
    assert main(["predict", *PREDICT, "--plot", str(out)]) == 1
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install" in err and "Traceback" not in err
    assert not out.exists()
    # said before the work the plot would follow: no stage recorded, no launch prepared
    import hetero.memplan.record as record
    import hetero.runtime.launcher as launcher

    def no_work(*a, **k):
        raise AssertionError("work started before the missing matplotlib was reported")

    monkeypatch.setattr(record, "record_stage", no_work)
    monkeypatch.setattr(launcher, "prepare", no_work)
    tiny = ["--model", str(CONFIGS / "models" / "tiny.yaml"), "--plan", str(CONFIGS / "plans" / "local-cpu-tiny.yaml")]
    for args in (["memplan", *tiny], ["launch", "--cluster", str(CONFIGS / "clusters" / "local-cpu.yaml"), *tiny]):
        assert main([*args, "--plot", str(out)]) == 1
        err = capsys.readouterr().err
        assert "--plot needs matplotlib" in err and "Traceback" not in err, err


def test_a_measured_step_is_the_median_after_the_first_shifted_to_zero():
    from hetero.plots import one_step

    def ev(step, ts, dur):
        return {"ph": "X", "name": "F0", "cat": "forward", "pid": 0, "tid": 0, "ts": ts, "dur": dur,
                "args": {"step": step}}

    # spans (us): step 1 5e6 (warm-up), 2: 1e6, 3: 3e6, 4: 2e6 -> the median of steps 2-4 is step 4
    trace = {"traceEvents": [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "rank 0"}},
                             ev(1, 0, 5e6), ev(2, 5e6, 1e6), ev(3, 6e6, 1e6), ev(3, 8e6, 1e6), ev(4, 9e6, 2e6)]}
    one, step, span = one_step(trace)
    assert (step, span) == (4, 2.0)
    assert [(e["ts"], e["dur"]) for e in one["traceEvents"] if e["ph"] == "X"] == [(0, 2e6)]
    assert one_step(trace, step=3)[2] == 3.0
    with pytest.raises(hetero.HeteroError, match="no forward or backward events"):
        one_step({"traceEvents": []})


def test_launch_plot_refuses_an_elastic_run_up_front(tmp_path):
    """An elastic run may change its plan midway; one plan's step cannot stand for it."""
    proc = run_cli("launch", "--cluster", str(CONFIGS / "clusters" / "local-cpu.yaml"), "--model",
                   str(CONFIGS / "models" / "tiny.yaml"), "--plan", str(CONFIGS / "plans" / "local-cpu-tiny.yaml"),
                   "--elastic", "--plot", str(tmp_path / "run.png"))
    assert_bad_input(proc, "--plot", "--elastic may change the plan")


def test_an_interleaved_plans_memory_is_drawn_once_per_device():
    """Two devices with two model chunks each: two memory bars (a device's chunks share its memory),
    each labelled with the layers the device holds, not four bars of one chunk each."""
    from hetero.plots import step_figure
    from hetero.predictor import predict

    cluster = hetero.load_cluster(CONFIGS / "clusters" / "local-cpu.yaml")
    model = hetero.load_model(CONFIGS / "models" / "tiny.yaml")
    plan = hetero.load_plan(CONFIGS / "plans" / "tiny-local-cpu-interleaved.yaml")
    pred = predict(cluster, model, plan, timeline=True)
    fig = step_figure(pred, plan)
    bottom = fig.axes[1]
    assert [t.get_text() for t in bottom.get_yticklabels()] == ["p0 s0 fast tp1 2 layers", "p0 s1 slow tp1 2 layers"]
    assert [p.get_width() for p in bottom.patches] == pytest.approx(
        [pred.pipelines[0].stages[i].peak_memory_bytes / 2**30 for i in range(2)])
    import matplotlib.pyplot as plt

    plt.close(fig)
