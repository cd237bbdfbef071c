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
