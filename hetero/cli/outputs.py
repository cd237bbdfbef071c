"""Outputs kept apart from inputs: no command writes over a file it reads, or into a folder it reads.

Every path a command reads is an input: a file (``--model``, ``--data``, ``--runs``, memplan's
``--trace``) or a folder, every file inside it included (``--load DIR``, ``--load hf:DIR``, a
``--tokenizer`` folder, export-hf's ``--checkpoint``). Every path it writes is an output: a file
(``--summary``, launch's ``--trace``, ``--plot``, ``-o``, ``--timeline``) or a folder it replaces as
a whole (``--save``, import-hf's ``-o``), with the folders it stages them in (``DIR.partial``) and the
sidecars it writes beside them. :func:`check_outputs` refuses, before any work, an output that is an
input, lies inside an input folder or holds an input, and two outputs that would overwrite each other.
Paths are compared as the files they resolve to: links followed (``os.path.realpath``), and the same
file by any name (a hard link) found by device and inode.
"""
from __future__ import annotations

import os

__all__ = ["check_outputs", "check_outputs_apart", "folder_outputs"]


def check_outputs(inputs, outputs, work_dirs=()) -> None:
    """Raise :class:`~hetero.errors.HeteroError` (one line naming both paths and the fix) unless the
    command's outputs are apart from its inputs and from each other. Call it before any work.

    ``inputs``: ``(flag, path)`` pairs, a file or a folder the command reads (every file inside a
    folder counts); ``outputs``: ``(flag, path)`` pairs, a file the command writes or a folder it
    replaces; ``work_dirs``: ``(flag, path)`` pairs, folders the command adds files of its own to
    (``launch --run-dir``): they may hold inputs and outputs, but may not be an input or an output,
    nor lie inside an input folder or an output. A path of None or "" is skipped (an empty path is
    the output check's error). ``flag`` is how the message names the path: ``--summary``,
    or for a path derived from a flag's, that flag first: ``"--save's staging folder"``.

    For example ``check_outputs([("--model", args.model), ("--load", folder)], [("--summary", args.summary)])``.
    """
    from hetero.errors import HeteroError

    inputs, outputs, work_dirs = _given(inputs), _given(outputs), _given(work_dirs)
    for i, (flag, path) in enumerate(outputs):
        mine = _user_flag(flag)
        for in_flag, in_path in inputs:
            clash = _clash(path, in_path)
            if clash == "same":
                other = {"folder": "a new folder", "file": "a new file name"}.get(_kind(in_path), "another path")
                raise HeteroError(f"{flag} {path} is the {in_flag} {_kind(in_path)} {in_path}{_resolved(path, in_path)}: "
                                  f"writing it would replace that input (fix: give {mine} {other})")
            if clash in ("inside", "linked"):
                where = "lies inside" if clash == "inside" else "is another name of a file inside"
                fix = f"a path outside {in_path}" if clash == "inside" else "a new file name"
                raise HeteroError(f"{flag} {path} {where} the {in_flag} folder {in_path}: writing it would change "
                                  f"that input (fix: give {mine} {fix})")
            if clash == "holds":
                raise HeteroError(f"{flag} {path} holds the {in_flag} {_kind(in_path)} {in_path}: writing {flag} "
                                  f"would replace it (fix: give {mine} a path apart from the inputs)")
        for other_flag, other in outputs[:i]:
            clash = _clash(path, other)
            if clash:
                how = {"same": "is also the path of", "inside": "lies inside", "linked": "is another name of a file in",
                       "holds": "holds"}[clash]
                raise HeteroError(f"{flag} {path} {how} {other_flag} {other}: one would replace the other "
                                  f"(fix: give each output a path of its own)")
    for flag, path in work_dirs:
        for other_flag, other in inputs + outputs:
            clash = _clash(path, other)
            if clash in ("same", "inside"):
                what = "input" if (other_flag, other) in inputs else "output"
                raise HeteroError(f"{flag} {path} {'is' if clash == 'same' else 'lies inside'} the {other_flag} "
                                  f"{what} {other}: the command writes its own files there (fix: give {flag} a new "
                                  f"folder apart from the inputs and outputs)")


def check_outputs_apart(args) -> None:
    """:func:`check_outputs` over the paths a subcommand's parser lists: ``inputs``, ``outputs`` and
    ``work_dirs`` (``set_defaults`` tables ``{flag: attribute}``; the attribute may hold a list, and a
    function of ``args`` stands for a path derived from them: ``--save``'s staging folder). An input
    ``hf:DIR`` is the folder DIR. ``main`` calls it before every command. ``--plot`` with a name not
    ending in ``.png`` is written anyway (it is the user's name) with a warning on stderr."""
    def given(table) -> list[tuple[str, str]]:
        pairs = []
        for flag, attribute in (table or {}).items():
            value = attribute(args) if callable(attribute) else getattr(args, attribute, None)
            for v in (value if isinstance(value, (list, tuple)) else [value]):
                pairs.append((flag, v))
        return pairs

    from hetero.hf import hf_dir_of

    # ``--load hf:DIR`` reads the folder DIR
    inputs = [(flag, hf_dir_of(v) or v if isinstance(v, str) else v) for flag, v in given(getattr(args, "inputs", None))]
    outputs = given(getattr(args, "outputs", None))
    check_outputs(inputs, outputs, given(getattr(args, "work_dirs", None)))
    for flag, path in _given(outputs):
        if flag == "--plot" and not path.lower().endswith(".png"):
            from rich.markup import escape

            from hetero.console import console

            console(stderr=True).print(f"[yellow]warning[/yellow]: --plot {escape(path)}: the plot is a PNG image whatever "
                                       f"the name (name it *.png to open it as one)")


def folder_outputs(flag: str = "--save", attribute: str = "save", previous: bool = True) -> dict:
    """The ``outputs`` table entries of an option naming a folder the command writes whole (``--save
    DIR``, import-hf's ``-o OUT``): the folder, where it is staged (``DIR.partial``, removed first)
    and, with ``previous`` (a checkpoint replaced by :func:`hetero.runtime.checkpoint.put_in_place`),
    where the previous one waits while the new one is put in place (``DIR.old``, removed)."""
    from hetero.specs.io import previous_path, staging_path

    def derived(name):
        return lambda args: name(getattr(args, attribute)) if getattr(args, attribute, None) else None

    out = {flag: attribute, f"{flag}'s staging folder": derived(staging_path)}
    if previous:
        out[f"{flag}'s previous checkpoint"] = derived(previous_path)
    return out


def _given(pairs) -> list[tuple[str, str]]:
    return [(flag, str(path)) for flag, path in pairs if path is not None and str(path) != ""]


def _user_flag(label: str) -> str:
    """The flag a derived output's label starts with: ``--save`` of ``"--save's staging folder"``."""
    return label.split()[0].removesuffix("'s")


def _kind(path: str) -> str:
    return "folder" if os.path.isdir(path) else "file" if os.path.exists(path) else "path"


def _resolved(a: str, b: str) -> str:
    """`` (both are /real/path)`` when the two spellings differ, so a link's target is named."""
    if os.path.abspath(a) == os.path.abspath(b):
        return ""
    real = os.path.realpath(b)
    return f" (both are {real})" if os.path.realpath(a) == real else " (the same file)"


def _clash(out: str, other: str) -> str | None:
    """How path ``out`` clashes with path ``other``: "same" (one file or folder), "inside" (``out``
    lies inside the folder ``other``), "linked" (``out`` is another name of a file inside the folder
    ``other``), "holds" (``other`` lies inside ``out``), or None."""
    a, b = os.path.realpath(out), os.path.realpath(other)
    if a == b or _same_file(out, other):
        return "same"
    if _within(a, b) and not os.path.isfile(b):   # an existing file holds nothing (a missing path may become a folder)
        return "inside"
    if _within(b, a):
        return "holds"
    if os.path.isdir(b) and _linked_inside(out, b):
        return "linked"
    return None


def _within(path: str, folder: str) -> bool:
    """``path`` lies strictly inside ``folder`` (both resolved)."""
    return path != folder and path.startswith(folder.rstrip(os.sep) + os.sep)


def _same_file(a: str, b: str) -> bool:
    """Two existing paths of one file or folder: a hard link, or two spellings realpath does not join."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _linked_inside(path: str, folder: str) -> bool:
    """An existing file ``path`` with more than one name, one of them inside ``folder``: writing it in
    place would change that input too. Only a file with other names is looked for (rare), by walking
    ``folder``."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if st.st_nlink < 2 or not os.path.isfile(path):
        return False
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                other = os.stat(os.path.join(root, name))
            except OSError:
                continue
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                return True
    return False
