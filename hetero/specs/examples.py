"""The examples index (``configs/examples.yaml``): which plan goes with which cluster and model.

An index is a mapping with one field, ``examples:``, a list of ``{cluster, model, plan}`` entries.
Each value is a name: the file of that name in the ``clusters/``, ``models/`` or ``plans/`` folder
beside the index (``cluster: local-cpu`` is ``clusters/local-cpu.yaml``), the layout of the shipped
``configs/``. ``hetero validate`` checks that every named file exists and that each plan fits its
cluster and model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import Problem, Problems, did_you_mean, join_path
from .schema import is_missing, load_dataclass

FOLDERS = {"cluster": "clusters", "model": "models", "plan": "plans"}
"""The folder beside the index that holds the files of each kind an entry names."""


@dataclass(frozen=True)
class ExampleEntry:
    """One entry as written: the names of its cluster, model and plan files."""

    cluster: str
    model: str
    plan: str


@dataclass
class Example:
    """An entry of the index and what was found of it."""

    where: str
    """Its field path in the index, e.g. ``examples[3]``."""
    entry: ExampleEntry | None
    """None when the entry itself is malformed (see ``problems``)."""
    paths: dict[str, Path] = field(default_factory=dict)
    """The file of each kind the entry names that exists (``cluster``, ``model``, ``plan``)."""
    problems: list[Problem] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Every file of the entry was found, so the plan can be checked against the others."""
        return self.entry is not None and len(self.paths) == len(FOLDERS)


def read_examples(data: dict, source: str) -> tuple[list[Problem], list[Example]]:
    """The problems of the index itself (its top-level fields) and each of its entries with its
    files looked up beside ``source``. Every problem names the index and the entry's field."""
    problems = Problems(source=source)
    for key in data:
        if key != "examples":
            problems.add(str(key), f"unknown field '{key}'", did_you_mean(str(key), ["examples"]))
    entries = data.get("examples")
    if not isinstance(entries, list) or not entries:
        got = "nothing" if entries is None else (f"a {type(entries).__name__}" if not isinstance(entries, list)
                                                  else "an empty list")
        problems.add("examples", f"expected a list of {{cluster, model, plan}} entries, got {got}",
                     "list one '- {cluster: NAME, model: NAME, plan: NAME}' per example")
        return problems.items, []
    base = Path(source).parent
    out = []
    for i, raw in enumerate(entries):
        where = join_path("examples", i)
        found = Problems(source=source)
        entry = load_dataclass(ExampleEntry, raw, where, found)
        example = Example(where, None if is_missing(entry) else entry)
        if example.entry is not None:
            example.paths = _find_files(example.entry, base, where, found)
        example.problems = found.items
        out.append(example)
    return problems.items, out


def _find_files(entry: ExampleEntry, base: Path, where: str, problems: Problems) -> dict[str, Path]:
    """The file of each kind ``entry`` names, in its folder under ``base``; a name that is a path
    or names no file is a problem."""
    paths = {}
    for kind, folder in FOLDERS.items():
        name, at = getattr(entry, kind), join_path(where, kind)
        stem = name.removesuffix(".yaml").removesuffix(".yml")
        if not name or Path(name).name != name or name.startswith(".") or stem != name:
            # a name, not a path: the index stays valid wherever configs/ is copied to
            problems.add(at, f"'{name}' is not a {kind} name",
                         f"give the name of a file in {folder}/ without its folder or '.yaml', e.g. "
                         f"'{Path(stem).name or 'NAME'}'")
            continue
        path = base / folder / f"{name}.yaml"
        if not path.is_file():
            known = sorted(p.stem for p in (base / folder).glob("*.yaml"))
            hint = did_you_mean(name, known) if known else f"{base / folder} holds no .yaml file"
            problems.add(at, f"no {kind} named '{name}': {path} does not exist", hint)
            continue
        paths[kind] = path
    return paths


__all__ = ["Example", "ExampleEntry", "FOLDERS", "read_examples"]
