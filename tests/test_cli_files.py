"""Input and output files at the CLI's edges: encodings, sizes, links, devices, modes, early checks.
Every failure is exit 1 with the file and the fix named, no traceback, nothing half-written."""
import copy
import json
import os

import pytest
import yaml

from conftest import CONFIGS, run_cli
from test_cli_foundation import assert_bad_input
from test_specs import CLUSTER

PREDICT = ["--cluster", str(CONFIGS / "clusters" / "local-cpu.yaml"), "--model", str(CONFIGS / "models" / "tiny.yaml"),
           "--plan", str(CONFIGS / "plans" / "local-cpu-tiny.yaml")]


def test_non_utf8_inputs_are_named_not_a_traceback(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_bytes(b"name: \xff\xfe bad\n")
    assert_bad_input(run_cli("validate", str(bad)), "c.yaml", "not UTF-8", "byte 0xff at offset 6", "save the file as UTF-8")
    runs = tmp_path / "runs.csv"
    runs.write_bytes(b"device,num_devices\n\xff\n")
    cal = tmp_path / "cal.json"
    assert_bad_input(run_cli("calibrate", "--cluster", str(CONFIGS / "clusters" / "local-cpu.yaml"), "--runs", str(runs),
                             "-o", str(cal)), "runs.csv", "not UTF-8")
    assert not cal.exists()
    cal.write_bytes(b"\x80{}")
    assert_bad_input(run_cli("predict", *PREDICT, "--calibration", str(cal)), "cal.json", "not UTF-8")


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    from hetero.predictor.runlog import read_runs

    header = ("device,devices_per_node,num_devices,global_batch_size,micro_batch_size,hidden_size,"
              "num_attention_heads,num_layers,seq_length,vocab_size,dtype,recompute,tp,dp,pp,iteration_time_ms\n")
    row = "A100-SXM4-80GB,8,8,32,4,2048,16,16,1024,51200,fp16,full,4,2,1,356.2\n"
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbf" + (header + row).encode())
    assert [r.iteration_time_ms for r in read_runs(path)] == [356.2]


def test_outputs_go_through_links_keep_the_umask_and_refuse_directories(tmp_path):
    target = tmp_path / "target.yaml"
    target.write_text("old\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    args = ["plan", "--cluster", str(CONFIGS / "clusters" / "local-cpu.yaml"), "--model",
            str(CONFIGS / "models" / "tiny.yaml"), "--global-batch-size", "16", "--no-progress"]
    proc = run_cli(*args, "-o", str(link))
    assert proc.returncode == 0, proc.stderr
    assert link.is_symlink() and "global_batch_size: 16" in target.read_text()
    fresh = tmp_path / "new" / "plan.yaml"
    assert run_cli(*args, "-o", str(fresh)).returncode == 0
    umask = os.umask(0)
    os.umask(umask)
    assert fresh.stat().st_mode & 0o777 == 0o666 & ~umask
    assert_bad_input(run_cli(*args, "-o", str(tmp_path)), "is a directory")


def test_timeline_path_is_checked_before_predicting(tmp_path):
    assert_bad_input(run_cli("predict", *PREDICT, "--timeline", str(tmp_path)), "--timeline", "is a directory")
    assert_bad_input(run_cli("predict", *PREDICT, "--timeline", "/dev/null"), "not a regular file")
    out = tmp_path / "a" / "b" / "t.json"
    assert run_cli("predict", *PREDICT, "--timeline", str(out)).returncode == 0
    assert json.loads(out.read_text())["traceEvents"]


def test_device_numbers_must_be_finite_and_plausible(tmp_path):
    for mutate, fragment in ((lambda d: d.update(slowdown=".nan"), "devices.cpu-slow.slowdown"),
                             (lambda d: d.update(slowdown=float("nan")), "finite number"),
                             (lambda d: d.update(peak_flops={"fp32": 0}), "peak_flops.fp32"),
                             (lambda d: d.update(peak_flops={"fp32": 19.5}), "with its unit")):
        data = copy.deepcopy(CLUSTER)
        mutate(data["devices"]["cpu-slow"])
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(data))
        assert_bad_input(run_cli("validate", str(path)), fragment)



def test_link_numbers_must_be_plausible(tmp_path):
    """A link's unit left out (`latency: 5` is 5 seconds, `bandwidth: 300` 300 B/s) or an absurd value
    is an error naming the field; a latency of 1e308 s made `predict --json` print `Infinity`."""
    for mutate, fragment in ((lambda d: d["groups"][0]["intra_node"].update(latency=5), "groups[0].intra_node.latency"),
                             (lambda d: d["network"]["cross_group"].update(latency="1e308 s"), "at most 1 s"),
                             (lambda d: d["network"]["inter_node"].update(bandwidth=300), "network.inter_node.bandwidth"),
                             (lambda d: d["groups"][0]["intra_node"].update(bandwidth=1e-300), "at least 1 MB/s")):
        data = copy.deepcopy(CLUSTER)
        mutate(data)
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(data))
        assert_bad_input(run_cli("validate", str(path)), "c.yaml", fragment, "with its unit")
    data = yaml.safe_load(open(PREDICT[1]))
    data["groups"][0]["intra_node"]["latency"] = "1e308 s"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    assert_bad_input(run_cli("predict", "--cluster", str(path), *PREDICT[2:], "--json"), "intra_node.latency")

def test_a_global_batch_given_in_tokens_is_refused_at_once():
    proc = run_cli("plan", "--cluster", str(CONFIGS / "clusters" / "a100-v100.yaml"), "--model",
                   str(CONFIGS / "models" / "gpt3-1.3b.yaml"), "--global-batch-size", str(4 * 2**20), timeout=30)
    assert_bad_input(proc, "4,194,304 samples", "in samples (sequences), not tokens")


def test_launch_checks_its_numbers_in_a_dry_run(tmp_path):
    for extra, fragment in ((["--master-port", "99999"], "1..65535"), (["--timeout", "0"], "--timeout"),
                            (["--lr", "nan"], "--lr"), (["--threads", "0"], "--threads"),
                            (["--node-rank", "5"], "node slots"), (["--data", str(tmp_path)], "--data"),
                            (["--load", str(tmp_path / "none")], "--load"),
                            (["--summary", str(tmp_path)], "--summary")):
        assert_bad_input(run_cli("launch", *PREDICT, "--dry-run", *extra), fragment)


def test_a_calibration_for_other_devices_is_flagged(tmp_path):
    from hetero.predictor.calibration import Calibration
    from hetero.predictor.factors import CalibrationFactors

    path = tmp_path / "cal.json"
    Calibration(factors={"A100-SXM4-80GB": CalibrationFactors()}).save(path)
    proc = run_cli("predict", *PREDICT, "--calibration", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "none of this cluster's devices" in proc.stderr and "uncalibrated" in proc.stderr


def test_a_file_of_another_kind_is_named_as_such():
    model, cluster = str(CONFIGS / "models" / "tiny.yaml"), str(CONFIGS / "clusters" / "local-cpu.yaml")
    assert_bad_input(run_cli("validate", "--cluster", model, PREDICT[5]), "tiny.yaml", "looks like a model file",
                     "not a cluster file", "one with 'groups'")
    assert_bad_input(run_cli("validate", "--model", cluster, PREDICT[5]), "looks like a cluster file", "not a model file")
    proc = run_cli("predict", "--cluster", model, "--model", PREDICT[5], "--plan", str(CONFIGS / "devices.yaml"))
    assert_bad_input(proc, "tiny.yaml: this looks like a model file", "not a cluster file",
                     "local-cpu-tiny.yaml: this looks like a plan file", "not a model file",
                     "devices.yaml: this looks like a device catalog file", "not a plan file")
    assert len(proc.stderr.splitlines()) == 3   # one line a file, not every field the loader does not know


def test_a_cluster_with_a_typo_beside_its_devices_is_not_called_a_catalog(tmp_path):
    """`group:` for `groups:` in a cluster that defines devices: the loader's did-you-mean, not a
    claim that the file is a device catalog."""
    bad = tmp_path / "c.yaml"
    bad.write_text("name: c\ndevices:\n  slow: {base: cpu, vendor: emu-z}\n"
                   "group:\n  - {name: g, device: slow, nodes: 1, devices_per_node: 1}\n")
    for proc in (run_cli("validate", str(bad)), run_cli("predict", "--cluster", str(bad), *PREDICT[2:])):
        assert_bad_input(proc, "c.yaml", "'groups'")
        assert "device catalog" not in proc.stderr, proc.stderr


def test_top_k_below_1_is_a_usage_error():
    for k in ("0", "-2"):
        proc = run_cli("plan", *PREDICT[:4], "--global-batch-size", "16", "--top-k", k)
        assert proc.returncode == 2 and "--top-k: must be >= 1" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_profile_names_a_known_device_type(tmp_path):
    out = tmp_path / "p.csv"
    assert_bad_input(run_cli("profile", "--device", "A100-SXM4-80G", "--quick", "-o", str(out)),
                     "--device 'A100-SXM4-80G'", "did you mean 'A100-SXM4-80GB'", "--cluster FILE")
    assert_bad_input(run_cli("profile", "--device", "foo", "--quick", "-o", str(out)), "known names: A100-PCIE-40GB")
    assert not out.exists()
    # a cluster's own type is valid with --cluster (a 'base: cpu' one profiles this CPU)
    proc = run_cli("profile", "--device", "cpu-emu-b", "--cluster", PREDICT[1], "--quick", "--no-cache",
                   "--no-blocks", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().splitlines()[1].split(",")[1] == "cpu-emu-b"
    # so is one the cluster defines under 'devices:' without a group using it yet
    cluster = tmp_path / "c.yaml"
    cluster.write_text("name: c\ndevices:\n  spare: {base: cpu, vendor: emu-z}\n"
                       "groups:\n  - {name: g, device: cpu, nodes: 1, devices_per_node: 1}\n")
    proc = run_cli("profile", "--device", "spare", "--cluster", str(cluster), "--quick", "--no-cache",
                   "--no-blocks", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().splitlines()[1].split(",")[1] == "spare"
    # an empty name (an unset shell variable) is refused, not taken for "detect the device"
    assert_bad_input(run_cli("profile", "--device", "", "--quick", "-o", str(out)), "--device '': an empty device name")
    # an accelerator type on a machine without one says how to go on
    import torch

    if not torch.cuda.is_available():
        assert_bad_input(run_cli("profile", "--device", "A100-SXM4-80GB", "--quick", "-o", str(tmp_path / "a.csv")),
                         "no accelerator was found here", "leave --device out")
        assert not (tmp_path / "a.csv").exists()
    # --cluster alone says what it is for instead of being ignored
    assert_bad_input(run_cli("profile", "--cluster", str(cluster), "--quick", "-o", str(tmp_path / "q.csv")),
                     "give --device too")


def test_an_empty_output_path_is_an_error_not_ignored(tmp_path):
    """`--timeline ""` / `-o ""` / `--calibration ""` (an unset shell variable) said nothing and wrote
    nothing, or predicted uncalibrated."""
    assert_bad_input(run_cli("predict", *PREDICT, "--timeline", ""), "--timeline: no output file named")
    assert_bad_input(run_cli("plan", *PREDICT[:4], "--global-batch-size", "16", "--no-progress", "-o", ""),
                     "-o: no output file named")
    assert_bad_input(run_cli("profile", "--device", "cpu", "--quick", "--no-cache", "-o", ""), "-o: no output file named")
    assert_bad_input(run_cli("predict", *PREDICT, "--calibration", ""), "--calibration: no file named")
    assert_bad_input(run_cli("plan", *PREDICT[:4], "--global-batch-size", "16", "--no-progress", "--calibration", " "),
                     "--calibration: no file named")


def test_a_failed_run_leaves_no_output_directories_behind(tmp_path):
    """The output's missing directories are made when the file is written, not when its path is
    checked: a run failing in between (here a corrupt calibration) leaves nothing behind."""
    bad = tmp_path / "cal.json"
    bad.write_text("{")
    assert_bad_input(run_cli("predict", *PREDICT, "--calibration", str(bad), "--timeline", str(tmp_path / "a" / "b" / "t.json")),
                     "not valid JSON")
    assert_bad_input(run_cli("plan", *PREDICT[:4], "--global-batch-size", "16", "--no-progress", "--calibration", str(bad),
                             "-o", str(tmp_path / "c" / "p.yaml")), "not valid JSON")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.json"]
    # a file where a directory would have to be made is still refused before any work
    assert_bad_input(run_cli("predict", *PREDICT, "--timeline", str(bad / "sub" / "t.json")),
                     "--timeline", "cannot create its directory", "cal.json is not a directory")


def test_a_failed_write_names_the_output_not_its_temporary_file(tmp_path, monkeypatch):
    """The atomic write goes through a temporary file beside the output; when the disk refuses it,
    the error names the output the user asked for, the temporary file is gone and an existing
    output is left as it was."""
    import errno

    from hetero.specs.io import write_text_atomic

    out = tmp_path / "timeline.json"
    out.write_text("old")

    def refuse(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", src)

    monkeypatch.setattr(os, "replace", refuse)
    try:
        write_text_atomic(out, "new")
    except OSError as e:
        assert e.filename == str(out) and e.errno == errno.ENOSPC, e
    else:
        raise AssertionError("the write did not fail")
    assert out.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["timeline.json"]


PLAN_ARGS = ["plan", *PREDICT[:4], "--global-batch-size", "16", "--no-progress", "-o"]
PREDICT_ARGS = ["predict", *PREDICT, "--timeline"]
PLOT_ARGS = ["predict", *PREDICT, "--plot"]   # bytes (a PNG) through the same writer


def test_every_output_into_new_directories_is_written_the_same_way(tmp_path):
    """`plan -o`, `predict --timeline` and `predict --plot` all make the missing directories when they
    write, give the file the mode a plain open would, and refuse a file standing where a directory must be made with
    the same message before any work."""
    import importlib.util

    import pytest

    umask = os.umask(0)
    os.umask(umask)
    plots = importlib.util.find_spec("matplotlib") is not None   # --plot needs it; the others do not
    for args, name in ((PLAN_ARGS, "plan.yaml"), (PREDICT_ARGS, "t.json"), (PLOT_ARGS, "step.png"))[:3 if plots else 2]:
        out = tmp_path / name.split(".")[0] / "a" / "b" / name
        proc = run_cli(*args, str(out))
        assert proc.returncode == 0, proc.stderr
        assert out.stat().st_mode & 0o777 == 0o666 & ~umask
        assert [p.name for p in out.parent.iterdir()] == [name]   # no temporary file beside it
        flag = args[-1]
        blocked = tmp_path / name / "sub" / name
        (tmp_path / name).write_text("a file, not a directory")
        assert_bad_input(run_cli(*args, str(blocked)), f"{flag} {blocked}: cannot create its directory: "
                                                       f"{tmp_path / name} is not a directory")
    if not plots:
        pytest.skip("matplotlib is not installed: --plot was not checked (plan -o and --timeline were)")


def test_a_failed_output_write_leaves_nothing_behind_for_every_command(tmp_path, monkeypatch, capsys):
    """The disk refusing the output (here the rename of the finished temporary file) is the same
    error for `plan -o`, `predict --timeline` and `predict --plot`: it names the option and the path, and neither a
    partial or temporary file nor a directory made for it is left; an existing output keeps its old
    content."""
    import errno

    from hetero.cli import main

    def refuse(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", src)

    for args, name in ((PLAN_ARGS, "plan.yaml"), (PREDICT_ARGS, "t.json"), (PLOT_ARGS, "step.png")):
        flag, before = args[-1], sorted(tmp_path.rglob("*"))
        new = tmp_path / "new" / "nested" / name
        old = tmp_path / f"old-{name}"
        old.write_text("old")
        for out in (new, old):
            with monkeypatch.context() as m:
                m.setattr(os, "replace", refuse)
                assert main([*args[:-1], flag, str(out)]) == 1
            err = capsys.readouterr().err
            assert f"error: {flag} {out}: cannot write it: No space left on device (fix: " in err, err
            assert "Traceback" not in err
        assert old.read_text() == "old"
        assert sorted(tmp_path.rglob("*")) == sorted(before + [old]), sorted(tmp_path.rglob("*"))


def test_a_writer_handed_the_output_names_its_option_when_the_path_fails(tmp_path, monkeypatch, capsys):
    """Plan.save, Calibration.save and the profile writers check the path again when they write
    (the missing directories are made then): a failure there names the option, not "output".
    `calibrate -o` under /proc passes the early check as root (who may write anywhere) and fails to
    make the directory; then, the early check passed over (the path changed after it), a file
    standing where `plan -o` and `calibrate -o` must make a directory."""
    import hetero
    from hetero.cli import main
    from test_calibration import CLUSTER as LAB
    from test_calibration import synthetic_runs, write_runs

    lab = tmp_path / "lab.yaml"
    lab.write_text(yaml.safe_dump(LAB))
    runs = write_runs(tmp_path / "runs.csv", synthetic_runs(hetero.load_cluster(LAB))[:12])
    calibrate = ["calibrate", "--cluster", str(lab), "--runs", str(runs), "-o"]
    proc = run_cli(*calibrate, "/proc/forbidden/cal.json")
    assert_bad_input(proc, "error: -o /proc/forbidden/cal.json: cannot create")
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a directory")
    monkeypatch.setattr("hetero.cli._common.check_output", lambda path, flag: None)
    for args in (calibrate, PLAN_ARGS):
        out = blocker / "sub" / "out"
        assert main([*args, str(out)]) == 1
        err = capsys.readouterr().err
        assert f"error: -o {out}: cannot create its directory: {blocker} is not a directory" in err, err
        assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "lab.yaml", "runs.csv"]


def test_no_output_flag_may_name_an_input_file(tmp_path, capsys):
    """Every output flag of every command that names one of the command's input files (the same file
    after resolving links) is refused before any work, exit 1, naming both; two outputs on one file
    too. The inputs keep their bytes. `--plot` to a name that is not *.png warns that it writes PNG."""
    import shutil

    from hetero.cli import main

    files = {}
    for kind, name in (("clusters", "local-cpu.yaml"), ("models", "tiny.yaml"), ("plans", "local-cpu-tiny.yaml")):
        files[kind] = tmp_path / name
        shutil.copy(CONFIGS / kind / name, files[kind])
    link = tmp_path / "link.yaml"
    link.symlink_to(files["models"])
    runs = tmp_path / "runs.csv"
    runs.write_text("device\n")
    cluster, model, plan = (str(files[k]) for k in ("clusters", "models", "plans"))
    before = {p: p.read_bytes() for p in (*files.values(), runs)}
    inputs = ["--cluster", cluster, "--model", model, "--plan", plan]
    cases = [
        (["predict", *inputs, "--plot", cluster], "--plot", "--cluster"),
        (["predict", *inputs, "--timeline", plan], "--timeline", "--plan"),
        (["plan", "--cluster", cluster, "--model", model, "--global-batch-size", "8", "-o", str(link)], "-o", "--model"),
        (["launch", *inputs, "--summary", plan, "--dry-run"], "--summary", "--plan"),
        (["launch", *inputs, "--trace", model], "--trace", "--model"),
        (["launch", *inputs, "--plot", cluster, "--dry-run"], "--plot", "--cluster"),
        (["calibrate", "--cluster", cluster, "--runs", str(runs), "-o", str(runs)], "-o", "--runs"),
        (["memplan", "--model", model, "--plan", plan, "--plot", str(link)], "--plot", "--model"),
        (["profile", "--cluster", cluster, "-o", cluster], "-o", "--cluster"),
    ]
    for argv, out_flag, in_flag in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert f"{out_flag} " in err and f"is the {in_flag} file " in err and "Traceback" not in err, (argv, err)
    assert all(p.read_bytes() == data for p, data in before.items())
    same = tmp_path / "out.json"
    assert main(["launch", *inputs, "--summary", str(same), "--trace", str(same), "--dry-run"]) == 1
    assert "--trace" in capsys.readouterr().err and not same.exists()
    png = tmp_path / "step.txt"
    main(["predict", *inputs, "--plot", str(png), "--json"])
    assert "the plot is a PNG image" in capsys.readouterr().err
