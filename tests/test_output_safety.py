"""No command writes over what it reads: an output (``--summary``, ``--trace``, ``--plot``, ``-o``,
``--save``, their staging folders and sidecars) that is an input, lies inside an input folder
(``--load DIR``, ``--load hf:DIR``, a ``--tokenizer`` folder, export-hf's ``--checkpoint``) or holds
an input is refused before the command starts: exit 1, one line naming both paths and the fix, and
every input keeps its bytes. The command's own ``run`` is replaced by one that fails the test, so a
refusal is seen to come before any work (no process is launched)."""
from __future__ import annotations

import argparse
import os
import shutil

import pytest

from conftest import CONFIGS

COMMANDS = ("launch", "predict", "plan", "memplan", "calibrate", "profile", "import_hf", "export_hf")


@pytest.fixture
def nothing_runs(monkeypatch):
    """Every command's ``run`` fails the test if it is reached."""
    def ran(args):
        raise AssertionError(f"`hetero {args.command}` started its work; the outputs should have been refused")

    for name in COMMANDS:
        monkeypatch.setattr(f"hetero.cli.{name}.run", ran)


@pytest.fixture
def files(tmp_path):
    """Specs, a text and its tokenizer, a Hugging Face folder, a checkpoint: what the checks compare
    (their contents are never read before the refusal)."""
    f = {}
    for kind, name in (("clusters", "local-cpu.yaml"), ("models", "tiny.yaml"), ("plans", "local-cpu-tiny.yaml")):
        f[kind[:-1]] = tmp_path / name
        shutil.copy(CONFIGS / kind / name, f[kind[:-1]])
    f["text"] = tmp_path / "t.txt"
    f["text"].write_text("some text\n")
    f["tok"] = tmp_path / "tok.json"
    f["tok"].write_text('{"model": {}}')
    f["hf"] = tmp_path / "hf"
    f["hf"].mkdir()
    (f["hf"] / "config.json").write_text('{"model_type": "llama"}')
    (f["hf"] / "model.safetensors").write_bytes(b"weights")
    f["ckpt"] = tmp_path / "ckpt"
    f["ckpt"].mkdir()
    (f["ckpt"] / ".metadata").write_bytes(b"metadata")
    (f["ckpt"] / "__0_0.distcp").write_bytes(b"tensors")
    return f


def _snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _refused(capsys, argv, *words):
    """``hetero ARGV`` exits 1 before its work with one line holding ``words`` (both paths, the fix)."""
    from hetero.cli import main

    assert main([str(a) for a in argv]) == 1, argv
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "fix:" in lines[0] and "Traceback" not in err, err
    for word in words:
        assert str(word) in lines[0], (word, lines[0])
    return lines[0]


def _launch(f, *extra):
    return ["launch", "--cluster", f["cluster"], "--model", f["model"], "--plan", f["plan"], "--steps", "2", *extra]


def test_the_issue_cases_are_refused_and_the_inputs_keep_their_bytes(tmp_path, files, nothing_runs, capsys):
    """The five cases found on a fresh clone: each replaced an input and exited 0."""
    f = files
    before = _snapshot(tmp_path)
    cases = [   # the arguments, the output and the input the message names
        (("--data", f["text"], "--tokenizer", f["tok"], "--summary", f["tok"]),
         f"--summary {f['tok']}", f"--tokenizer file {f['tok']}"),
        (("--load", f"hf:{f['hf']}", "--trace", f["hf"] / "model.safetensors"),
         f"--trace {f['hf'] / 'model.safetensors'}", f"inside the --load folder {f['hf']}"),
        (("--load", f"hf:{f['hf']}", "--summary", f["hf"] / "config.json"),
         f"--summary {f['hf'] / 'config.json'}", f"inside the --load folder {f['hf']}"),
        (("--load", f["ckpt"], "--summary", f["ckpt"] / ".metadata"),
         f"--summary {f['ckpt'] / '.metadata'}", f"inside the --load folder {f['ckpt']}"),
        (("--data", f["text"], "--tokenizer", f["tok"], "--plot", f["tok"]),
         f"--plot {f['tok']}", f"--tokenizer file {f['tok']}"),
    ]
    for extra, output, source in cases:
        _refused(capsys, _launch(f, *extra), output, source)
    assert _snapshot(tmp_path) == before


def test_folders_read_and_written_on_launch(tmp_path, files, nothing_runs, capsys):
    """--save is an output (and its staging folder, and where the previous checkpoint waits); a
    --tokenizer folder is an input; --run-dir may not be put inside an input or an output."""
    f = files
    tokdir = tmp_path / "tokdir"
    tokdir.mkdir()
    (tokdir / "tokenizer.json").write_text("{}")
    before = _snapshot(tmp_path)
    _refused(capsys, _launch(f, "--load", f["ckpt"], "--save", f["ckpt"]), "--save", "is the --load folder",
             "give --save a new folder")
    _refused(capsys, _launch(f, "--load", f"hf:{f['hf']}", "--save", f["hf"] / "tuned"), "--save",
             "inside the --load folder")
    _refused(capsys, _launch(f, "--data", f["text"], "--tokenizer", tokdir, "--summary", tokdir / "tokenizer.json"),
             "--summary", "inside the --tokenizer folder")
    _refused(capsys, _launch(f, "--save", tmp_path, "--summary", tmp_path / "s.json"), "--save", "holds")
    old = tmp_path / "ckpt.old"   # put_in_place removes PATH.old: a checkpoint kept there is an input
    shutil.copytree(f["ckpt"], old)
    _refused(capsys, _launch(f, "--load", old, "--save", f["ckpt"]), "--save's previous checkpoint", "--load folder",
             "give --save")
    _refused(capsys, _launch(f, "--load", old, "--save", tmp_path / "ckpt.old.x", "--summary",
                             tmp_path / "ckpt.old.x.partial"), "--save's staging folder", "--summary")
    _refused(capsys, _launch(f, "--load", f["ckpt"], "--run-dir", f["ckpt"] / "run"), "--run-dir",
             "inside the --load input")
    _refused(capsys, _launch(f, "--save", tmp_path / "new", "--run-dir", tmp_path / "new" / "run"), "--run-dir",
             "inside the --save output")
    shutil.rmtree(old)
    assert _snapshot(tmp_path) == before


def test_links_and_other_names_of_an_input(tmp_path, files, nothing_runs, capsys):
    """A symbolic link to an input folder, an output reached through a linked folder, a hard link
    to an input file, a hard link to a file inside an input folder: all the same input."""
    f = files
    link = tmp_path / "hf-link"
    link.symlink_to(f["hf"])
    _refused(capsys, _launch(f, "--load", f"hf:{link}", "--summary", f["hf"] / "config.json"), "--summary",
             "inside the --load folder")
    _refused(capsys, _launch(f, "--load", f"hf:{f['hf']}", "--summary", link / "config.json"), "--summary",
             "inside the --load folder")
    hard = tmp_path / "hard.json"
    os.link(f["tok"], hard)
    _refused(capsys, _launch(f, "--data", f["text"], "--tokenizer", f["tok"], "--summary", hard),
             "--summary", "is the --tokenizer file", "(the same file)")
    inner = tmp_path / "inner.bin"
    os.link(f["ckpt"] / "__0_0.distcp", inner)
    _refused(capsys, _launch(f, "--load", f["ckpt"], "--trace", inner), "--trace",
             "another name of a file inside the --load folder")


def test_every_other_command(tmp_path, files, nothing_runs, capsys):
    f = files
    before = _snapshot(tmp_path)
    _refused(capsys, ["import-hf", f["hf"], "-o", f["hf"] / "out"], "-o", "inside the HF_DIR folder")
    # import-hf stages OUT in OUT.partial, removed first: a folder of that name is an input to keep
    staged = tmp_path / "x.partial"
    shutil.copytree(f["hf"], staged)
    _refused(capsys, ["import-hf", staged, "-o", tmp_path / "x"], "-o's staging folder", "is the HF_DIR folder")
    shutil.rmtree(staged)
    _refused(capsys, ["export-hf", "--model", f["model"], "--checkpoint", f["ckpt"], "-o", f["ckpt"] / "hf"], "-o",
             "inside the --checkpoint folder")
    _refused(capsys, ["export-hf", "--model", f["model"], "--checkpoint", f["ckpt"], "--base", f["hf"],
                      "-o", f["hf"]], "-o", "is the --base folder")
    snapshot = tmp_path / "snap.pickle"
    snapshot.write_bytes(b"snapshot")
    _refused(capsys, ["memplan", "--trace", snapshot, "--plot", snapshot], "--plot", "is the --trace file")
    meta = tmp_path / "lab.meta.json"   # profile -o lab.csv writes lab.meta.json beside it
    shutil.copy(f["cluster"], meta)
    _refused(capsys, ["profile", "--cluster", meta, "-o", tmp_path / "lab.csv"], "-o (its .meta.json)", "--cluster")
    meta.unlink()
    cal = tmp_path / "cal.json"
    cal.write_text("{}")
    _refused(capsys, ["plan", "--cluster", f["cluster"], "--model", f["model"], "--global-batch-size", "8",
                      "--calibration", cal, "-o", cal], "-o", "is the --calibration file")
    _refused(capsys, ["predict", "--cluster", f["cluster"], "--model", f["model"], "--plan", f["plan"],
                      "--timeline", f["hf"] / "t.json", "--plot", f["hf"] / "t.json"], "--plot", "--timeline")
    runs = tmp_path / "runs.csv"
    runs.write_text("device\n")
    _refused(capsys, ["calibrate", "--cluster", f["cluster"], "--runs", runs, "-o", runs], "-o", "is the --runs file")
    runs.unlink()
    cal.unlink()
    snapshot.unlink()
    assert _snapshot(tmp_path) == before


def test_outputs_apart_from_the_inputs_pass():
    """Siblings, a name that only starts like an input folder's, outputs inside a work folder, inputs
    inside a work folder: nothing is refused."""
    from hetero.cli._common import check_outputs

    check_outputs([("--load", "/r/ckpt"), ("--data", "/r/t.txt")],
                  [("--save", "/r/ckpt2"), ("--summary", "/r/ckpt-summary.json"), ("--trace", "/r/run/trace.json")],
                  work_dirs=[("--run-dir", "/r/run")])
    check_outputs([("--model", "/r/run/m.yaml")], [("--summary", "/r/s.json")], work_dirs=[("--run-dir", "/r/run")])
    check_outputs([("--model", None), ("--plan", "")], [("--summary", None)])


def test_every_command_with_outputs_lists_every_path_it_takes():
    """A command that writes files lists each path flag of its parser among the paths the check
    compares (``inputs``, ``outputs``, ``work_dirs``), so a new flag cannot slip past it."""
    from hetero.cli import build_parser

    paths = {"cluster", "model", "plan", "data", "load", "save", "tokenizer", "calibration", "runs", "trace",
             "summary", "plot", "timeline", "output", "run_dir", "checkpoint", "base", "hf_dir", "prompts", "files",
             "job", "rewards"}
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    checked = 0
    for name, p in sub.choices.items():
        defaults = p._defaults
        if not defaults.get("outputs"):
            continue
        listed = {v for table in ("inputs", "outputs", "work_dirs") for v in (defaults.get(table) or {}).values()}
        named = {getattr(v, "__name__", v) for v in listed}
        for action in p._actions:
            if action.dest in paths:
                assert action.dest in named or any(action.dest in n for n in named), (name, action.dest)
        checked += 1
    assert checked >= 8
