"""``python -m hetero``: the command line.

Run by a Python without hetero's dependencies (the system ``python3`` in a clone, outside the
virtual environment ``make setup`` makes), a missing module is one line saying what to run instead,
not a traceback. Optional extras (matplotlib, transformers, DeepSpeed) say their own install line.
"""
import sys


def _run() -> int:
    try:
        from hetero.cli import main

        return main()
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        if not missing or missing == "hetero":   # a module of hetero itself: a bug, keep the traceback
            raise
        print(f"error: this Python ({sys.executable}) has no module '{missing}', which hetero needs (fix: "
              f"{_instead()})", file=sys.stderr)
        return 1


def _instead() -> str:
    """What to run instead: the clone's virtual environment, made first when it is not there."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    venv = os.path.join(root, ".venv")
    command = " ".join([".venv/bin/hetero", *sys.argv[1:]])
    if not os.path.isfile(os.path.join(root, "setup.py")):   # installed, not a clone
        return "install hetero with pip into this Python, which brings its dependencies"
    if os.path.realpath(sys.prefix) == os.path.realpath(venv):   # the venv itself is incomplete
        return f"run `make setup` in {root} again to reinstall the dependencies"
    if os.path.isfile(os.path.join(venv, "bin", "hetero")):
        return f"run `{command}` in {root}, or `source .venv/bin/activate` first"
    return f"run `make setup` in {root} once (it makes .venv with the dependencies), then `{command}`"


raise SystemExit(_run())
