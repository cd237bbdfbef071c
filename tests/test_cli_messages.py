"""What the command line says when something is off: one line with the fix, never a traceback."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import REPO

HIDE_RICH = textwrap.dedent("""
    import runpy, sys

    class Hide:   # this Python has no rich, as the system python3 outside the virtual environment
        def find_spec(self, name, path=None, target=None):
            if name == "rich" or name.startswith("rich."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, Hide())
    sys.argv = ["hetero", *sys.argv[1:]]
    runpy.run_module("hetero", run_name="__main__", alter_sys=True)
""")


def test_a_python_without_the_dependencies_says_what_to_run_instead():
    """``python3 -m hetero devices`` where rich is missing: one line naming the module and the
    command to run instead, exit 1 (it printed a 12-line traceback)."""
    proc = subprocess.run([sys.executable, "-c", HIDE_RICH, "devices"], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "no module 'rich'" in lines[0] and "fix:" in lines[0], lines[0]
    assert "make setup" in lines[0] or ".venv/bin/hetero devices" in lines[0], lines[0]


def test_a_mistyped_option_gets_its_command_usage_and_the_closest_option(capsys):
    """``launch --num-steps`` got the top-level usage and no suggestion; a typo among missing required
    options is named too."""
    import pytest

    from hetero.cli import main

    for argv, command, says in (
            (["launch", "--cluster", "c", "--model", "m", "--plan", "p", "--num-steps", "3"], "launch",
             "unrecognized arguments: --num-steps (did you mean --steps?)"),
            (["predict", "--cluster", "c", "--modle", "m"], "predict", "--modle: did you mean --model?"),
            (["plan", "--cluster", "c", "--model", "m", "--global-batch-size", "8", "--top-kk=3", "--jsn"], "plan",
             "(--top-kk: did you mean --top-k?; --jsn: did you mean --json?)")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"usage: hetero {command}" in err and says in err, err


def test_load_hf_of_a_missing_folder_asks_for_a_hugging_face_folder(tmp_path, capsys):
    """``--load hf:DIR`` names a Hugging Face folder: its error asks for one (it asked for a --save
    checkpoint), and a file given as DIR is a file, not "not found"."""
    from conftest import CONFIGS
    from hetero.cli import main

    base = ["launch", "--cluster", str(CONFIGS / "clusters" / "local-cpu.yaml"), "--model",
            str(CONFIGS / "models" / "tiny.yaml"), "--plan", str(CONFIGS / "plans" / "local-cpu-tiny.yaml")]
    afile = tmp_path / "tokenizer.json"
    afile.write_text("{}")
    for load, says in ((f"hf:{tmp_path / 'missing'}", "not found"), (f"hf:{afile}", "a file, not a folder")):
        assert main([*base, "--load", load]) == 1
        err = capsys.readouterr().err
        assert f"--load {load}: {says}" in err and "Hugging Face model folder" in err and "config.json" in err, err
        assert "--save" not in err, err
    assert main([*base, "--load", str(tmp_path / "missing")]) == 1
    assert "checkpoint directory written by --save, or hf:DIR" in capsys.readouterr().err


def test_the_step_line_names_the_rank_busiest_in_the_step_as_predict_names_its_bottleneck(capsys):
    """Two pipelines: rank 0 runs 3 micro-batches of 0.65 s, rank 1 one of 1.36 s (the getting-started
    run). Predict names rank 0's stage the bottleneck (most busy time); the step line named rank 1,
    the slowest per micro-batch. Both name rank 0 now."""
    import types

    from hetero.layout import RankInfo
    from hetero.runtime.report import Reporter

    ranks = [RankInfo(rank=i, group=g, vendor=v, node=0, local_rank=0, pipeline=i, replica=0, stage=0, tp_rank=0,
                      tp_size=1, layers=(0, 6)) for i, (g, v) in enumerate((("fast", "emu-a"), ("slow", "emu-b")))]
    plan = types.SimpleNamespace(pipelines=[types.SimpleNamespace(micro_batches=3), types.SimpleNamespace(micro_batches=1)])
    trainer = types.SimpleNamespace(tokens_per_step=2048, ctx=types.SimpleNamespace(layout=types.SimpleNamespace(ranks=ranks),
                                                                                    plan=plan))
    step = types.SimpleNamespace(step=2, loss=7.6, time_s=2.0, grad_norm=1.0, forward_s=[0.242, 0.435],
                                 backward_s=[0.407, 0.922], skipped=False)
    Reporter(trainer).step(step)
    line = capsys.readouterr().out
    assert "bottleneck rank 0 (3 x F 242.0 / B 407.0 ms)" in line, line


def test_a_note_on_slow_compute_mentions_tensor_parallelism_only_where_a_rank_has_it(capsys):
    import types

    import hetero
    from conftest import CONFIGS
    from hetero.runtime.report import Reporter

    ctx = types.SimpleNamespace(cluster=hetero.load_cluster(CONFIGS / "clusters" / "local-cpu.yaml"),
                                model=hetero.load_model(CONFIGS / "models" / "tiny.yaml"),
                                plan=hetero.load_plan(CONFIGS / "plans" / "local-cpu-tiny.yaml"))
    stage = hetero.predict(ctx.cluster, ctx.model, ctx.plan).stage(0, 0)
    for tp, says in ((1, "the processes sharing this machine's cores"), (2, "with tensor parallelism on CPU")):
        rank = {"rank": 1, "group": "fast", "pipeline": 0, "replica": 1, "stage": 0, "layers": [0, 4], "tp_rank": 0,
                "tp_size": tp, "forward_time_s": 20 * stage.forward_time_s, "backward_time_s": 20 * stage.backward_time_s}
        Reporter(types.SimpleNamespace(tokens_per_step=1024, ctx=ctx)).footer(
            {"ranks": [rank], "median_iteration_time_s": 1.0, "predicted_iteration_time_s": 0.1,
             "losses": [6.0 - 0.1 * i for i in range(8)], "iteration_times_s": [1.0] * 8})
        text = " ".join(capsys.readouterr().out.split())
        assert "the stages compute slower than predicted" in text and says in text, text
        assert ("tensor parallelism" in text) == (tp > 1), text


def test_every_column_of_the_predict_tables_has_a_header(capsys):
    """The column that marked the bottleneck had no header (and was empty in the other pipelines'
    tables); the mark now follows the stage number."""
    from conftest import CONFIGS
    from hetero.cli import main

    assert main(["predict", "--cluster", str(CONFIGS / "clusters" / "local-cpu.yaml"), "--model",
                 str(CONFIGS / "models" / "tiny.yaml"), "--plan", str(CONFIGS / "plans" / "tiny-local-cpu-pp.yaml")]) == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if line.startswith("┃")]
    assert headers and all(cell.strip() for h in headers for cell in h.strip("┃").split("┃")), headers
    assert "0 (bottleneck)" in out, out


def test_the_run_plot_titles_clear_their_legends():
    """`hetero launch --plot` (the demo's out/demo-run.png): the measured panel's title sat in the row
    of the legend above the axes and ran over its last entries."""
    import pytest

    pytest.importorskip("matplotlib")
    import hetero
    from conftest import CONFIGS
    from hetero.plots import run_figure
    from hetero.predictor import predict

    cluster, model, plan = (hetero.load_cluster(CONFIGS / "clusters" / "local-cpu.yaml"),
                            hetero.load_model(CONFIGS / "models" / "tiny.yaml"),
                            hetero.load_plan(CONFIGS / "plans" / "tiny-local-cpu-pp.yaml"))
    events = [{"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}} for r in (0, 1)]
    for step in (1, 2, 3):
        for r in (0, 1):
            t = step * 1e6 + r * 1e5
            events += [{"ph": "X", "name": n, "cat": c, "pid": r, "tid": 0, "ts": t + k * 2e5, "dur": 1.5e5,
                        "args": {"step": step}}
                       for k, (n, c) in enumerate((("F0", "forward"), ("B0", "backward"), ("sync", "dp"),
                                                   ("adam", "optimizer")))]
    fig = run_figure(predict(cluster, model, plan, timeline=True), {"traceEvents": events},
                     "local-cpu / tiny: schedule 1f1b, predicted vs measured")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    from matplotlib.text import Text

    titles = [t for t in fig.findobj(Text) if t.get_text().startswith(("predicted:", "measured:"))]
    legends = [ax.get_legend().get_window_extent(renderer) for ax in fig.axes]
    assert len(titles) == 2 and len(legends) == 2
    for title in titles:
        box = title.get_window_extent(renderer)
        assert not any(box.overlaps(legend) for legend in legends), (title.get_text(), box, legends)


def test_the_reconfiguration_table_says_whether_processes_restarted(capsys):
    """An in-process reconfiguration keeps the survivors' processes: its row said 'restart s'. The
    column now says per row whether the ranks resharded in place or restarted from a checkpoint."""
    from rich.console import Console

    from hetero.runtime.elastic.report import reconfiguration_table

    row = {"step": 4, "reason": "rank 3 failed", "world_size_before": 4, "world_size_after": 2, "devices_added": 0,
           "devices_removed": 1, "handoff_time_s": 0.2, "replan_time_s": 0.01, "restart_time_s": 0.5,
           "reshard_time_s": 0.8, "predicted_tokens_per_s": 1000.0}
    Console(width=400).print(reconfiguration_table([{**row, "path": "in-process"}, row]))   # no header wraps
    out = capsys.readouterr().out
    assert "restart / reshard s" in out and "0.50 (reshard)" in out and "0.50 (restart)" in out, out
    assert "restart s" not in out.replace("restart / reshard s", ""), out


def test_the_reconfiguration_table_names_the_devices_the_replanner_had(capsys):
    """'elastic: replanned for the 3 device(s) left ...: a plan on 2 of them' printed beside a row
    'ranks 4 -> 2': the new plan uses 2 of the 3 devices left, and the row says so too."""
    from rich.console import Console

    from hetero.runtime.elastic.report import reconfiguration_table, replanned

    row = {"step": 4, "reason": "rank 3 failed", "world_size_before": 4, "world_size_after": 2, "devices_left": 3,
           "predicted_tokens_per_s": 1000.0}
    Console(width=400).print(reconfiguration_table([row, {**row, "world_size_after": 3}]))
    out = capsys.readouterr().out
    assert "4 -> 2 (of 3 devices left)" in out and "4 -> 3 " in out and "4 -> 3 (" not in out, out
    assert replanned(3, 2, "0.01 s") == "elastic: replanned for the 3 device(s) left in 0.01 s: a plan on 2 of them"
    assert replanned(3, 3, "0.01 s").endswith("a plan on all 3")
