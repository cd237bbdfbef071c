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
