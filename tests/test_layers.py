"""The layers point one way: the predictor and the planner import neither the CLI nor the runtime,
directly or through any module they import.

The CLI is the top floor and the runtime trains; the predictor and planner sit below both (the
runtime's elastic replanning calls the planner, not the other way round). An import that goes up,
even a lazy one inside a function, would make the predict path depend on the training code.
"""
from __future__ import annotations

import ast
import pathlib

import pytest
from helpers.imports import from_source, literal_import

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOWER = {"hetero.predictor": ROOT / "predictor", "hetero.planner": ROOT / "planner"}
UPPER = ("hetero.cli", "hetero.runtime")

pytestmark = pytest.mark.timeout(60)


def imported_modules(path: pathlib.Path, package: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in a file, at any depth (functions included), relative
    imports resolved against ``package``, and ``importlib.import_module("...")`` with a literal."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = from_source(node, package)
            out.append((node.lineno, module))
            out += [(node.lineno, f"{module}.{a.name}") for a in node.names]
        elif (literal := literal_import(node)) is not None:
            out.append((node.lineno, literal))
    return out


def _upward(root_package: str, folder: pathlib.Path) -> list[str]:
    bad = []
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        # the package a relative import in this file is relative to
        package = ".".join([root_package, *parts[:-1]] if path.name != "__init__.py" else [root_package, *parts])
        for line, module in imported_modules(path, package):
            if any(module == up or module.startswith(up + ".") for up in UPPER):
                bad.append(f"{path.relative_to(folder.parent)}:{line} imports {module}")
    return bad


def test_predictor_and_planner_import_neither_cli_nor_runtime():
    bad = [b for package, folder in LOWER.items() for b in _upward(package, folder)]
    assert not bad, "imports that point up a layer:\n" + "\n".join(bad)


def test_the_scan_sees_lazy_relative_and_from_imports(tmp_path):
    # a scan that found nothing because it looked at too little would pass the test above vacuously
    (tmp_path / "a.py").write_text(
        "import os\n"
        "def f():\n"
        "    from hetero.cli._common import console\n"
        "    from ..runtime import model\n"
        "    import hetero.runtime.grads as g\n"
        "    from hetero import cli\n"
        "    importlib.import_module('hetero.runtime.zero')\n")
    found = _upward("hetero.predictor", tmp_path)
    assert [b.split(" imports ")[1] for b in found] == [
        "hetero.cli._common", "hetero.cli._common.console", "hetero.runtime", "hetero.runtime.model",
        "hetero.runtime.grads", "hetero.cli", "hetero.runtime.zero"]


HETERO = {"hetero": ROOT / "hetero", **LOWER, "hetero.backends": ROOT / "backends", "hetero.configs": ROOT / "configs"}


def _all_modules() -> dict[str, tuple[pathlib.Path, str]]:
    """Every module of the installed namespace: name -> (file, the package its relative imports are
    relative to), the folders setup.py maps into ``hetero`` included."""
    out = {}
    for root, folder in HETERO.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if root == "hetero" and parts[0] in ("predictor", "planner", "backends", "configs"):
                continue   # a symlink or stray copy: setup.py maps the top-level folders
            package = ".".join([root, *parts[:-1]])
            name = package if parts[-1] == "__init__" else f"{package}.{parts[-1]}"
            out[name] = (path, package)
    return out


def _edges(name: str, modules: dict) -> list[tuple[int, str]]:
    """The modules ``name``'s file makes Python run, lazily or not: each import's module, and the
    packages above it that the importing module does not sit in (their ``__init__`` runs first)."""
    path, package = modules[name]
    out = []
    for line, imported in imported_modules(path, package):
        while imported not in modules and "." in imported:   # ``from a import name``: module a
            imported = imported.rsplit(".", 1)[0]
        if imported not in modules:
            continue
        parts = imported.split(".")
        for i in range(1, len(parts) + 1):
            target = ".".join(parts[:i])
            # the top package, every module's parent, counts only where it is named itself
            if (target == imported or (i > 1 and not (name + ".").startswith(target + "."))) and target != name:
                out.append((line, target))
    return out


def _reaches_up(modules: dict) -> list[str]:
    """For each module above the predictor and planner that their code reaches through any chain of
    imports (lazy ones included), the chain."""
    seen: dict[str, tuple[str, int] | None] = {n: None for n in modules if n.startswith(tuple(LOWER))}
    todo = list(seen)
    while todo:
        name = todo.pop()
        for line, target in _edges(name, modules):
            if target not in seen:
                seen[target] = (name, line)
                if not target.startswith(UPPER):
                    todo.append(target)
    bad = []
    for name in sorted(n for n in seen if n.startswith(UPPER)):
        chain, at = [name], name
        while seen[at] is not None:
            at, line = seen[at]
            chain.append(f"{at}:{line}")
        bad.append(" <- ".join(chain))
    return bad


def test_nothing_the_predictor_and_planner_import_reaches_the_runtime_or_the_cli():
    """Not through another module either: the predictor once replayed a stage's requests through
    hetero.memplan.record, which imports the runtime's model inside a function; it now calls the
    StageRecorder the ``hetero`` package registers (hetero.predictor.allocator)."""
    bad = _reaches_up(_all_modules())
    assert not bad, "chains of imports from the predictor or planner up a layer:\n" + "\n".join(bad)


def test_the_chain_scan_follows_lazy_imports_through_other_modules(tmp_path):
    # the predictor importing a module that imports the runtime inside a function is caught
    (tmp_path / "mid.py").write_text("def f():\n    from hetero.runtime import model\n")
    (tmp_path / "low.py").write_text("def g():\n    import hetero.middle.mid\n")
    modules = {"hetero.predictor.low": (tmp_path / "low.py", "hetero.predictor"),
               "hetero.middle.mid": (tmp_path / "mid.py", "hetero.middle"),
               "hetero.middle": (tmp_path / "mid.py", "hetero.middle"),
               "hetero.runtime": (tmp_path / "mid.py", "hetero.runtime"),
               "hetero.runtime.model": (tmp_path / "mid.py", "hetero.runtime")}
    assert _reaches_up(modules)[0].startswith("hetero.runtime <- hetero.middle.mid:2 <- hetero.predictor.low:2")


def test_every_predictor_and_planner_module_imports_without_torch():
    # the measuring code (hetero.measure) runs torch; what predicts and plans never loads it
    import subprocess
    import sys

    code = ("import importlib, pkgutil, sys\n"
            "import hetero.predictor, hetero.planner\n"
            "names = [m.name for p in (hetero.predictor, hetero.planner)\n"
            "         for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]\n"
            "for name in names:\n"
            "    importlib.import_module(name)\n"
            "assert len(names) > 20, names\n"
            "up = sorted(k for k in sys.modules if k == 'torch' or k.startswith(('hetero.cli', 'hetero.runtime')))\n"
            "assert not up, up\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_the_caching_replay_records_through_the_registered_recorder():
    """The predictor's replay asks the StageRecorder the package registered (the runtime's, by
    default) and says clearly when none is."""
    import hetero
    from hetero.errors import HeteroError
    from hetero.predictor import allocator

    calls = []

    def recorder(model, plan, pipeline, stage, *, chunks=None, marks=False, micro_batches=None):
        calls.append((pipeline, stage, micro_batches))
        raise NotImplementedError("a recorder that cannot run this model")

    model = hetero.load_model(ROOT / "configs" / "models" / "tiny.yaml")
    plan = hetero.load_plan(ROOT / "configs" / "plans" / "local-cpu-tiny.yaml")
    assert allocator.stage_recorder() is hetero._record_stage
    try:
        allocator.register_stage_recorder(recorder)
        assert allocator.simulated_caching_bytes(model, plan, 0, 0) is None   # falls back to the fitted ratio
        assert calls and calls[0][:2] == (0, 0)
        allocator.register_stage_recorder(None)
        with pytest.raises(HeteroError, match="no stage recorder is registered"):
            allocator.simulated_trace(model, plan, 0, 0)
    finally:
        allocator.register_stage_recorder(hetero._record_stage)


def test_the_launcher_checks_and_lays_out_a_run_without_importing_torch(tmp_path):
    """The launcher only checks the plan and starts node launchers: importing torch there (about 1 s
    of CPU, 2 with dynamo) would delay every launch before its first worker starts."""
    import subprocess
    import sys

    moe = tmp_path / "moe.yaml"   # an MoE model: its refusals are checked too
    moe.write_text((ROOT / "configs" / "models" / "tiny.yaml").read_text()
                   + "moe: {num_experts: 4, top_k: 2}\n")
    code = ("import sys\n"
            "from hetero.cli import main\n"
            f"for model in ({str(ROOT / 'configs' / 'models' / 'tiny.yaml')!r}, {str(moe)!r}):\n"
            f"    rc = main(['launch', '--cluster', {str(ROOT / 'configs' / 'clusters' / 'local-cpu.yaml')!r},\n"
            f"               '--model', model, '--plan', {str(ROOT / 'configs' / 'plans' / 'local-cpu-tiny.yaml')!r},\n"
            f"               '--dry-run', '--run-dir', {str(tmp_path / 'run')!r}])\n"
            "    assert rc in (0, None), rc\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
