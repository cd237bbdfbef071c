"""Reading spec files (YAML, safe loader only, duplicate keys refused) and writing them back atomically."""
from __future__ import annotations

import contextlib
import contextvars
import os
import stat
import tempfile
from pathlib import Path

import yaml

from hetero.errors import HeteroError

from .errors import Problem, SpecError
from .kinds import MARKERS, wrong_kind


MAX_INPUT_BYTES = 256 * 2**20
"""Input files (specs, run logs, calibrations) larger than this are refused, not read into memory."""


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A key given twice in one YAML mapping (plain YAML keeps the last silently)."""

    def __init__(self, key, first, again):
        super().__init__(None, None, f"duplicate key '{key}' (first given at line {first.line + 1})", again)
        self.key = key


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (same tags, nothing executable) that refuses a key given twice in one
    mapping, naming its line, instead of keeping the last one: ``nodes: 1`` ... ``nodes: 4`` is a
    mistake, not an override. Keys merged in with ``<<:`` may still be overridden."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.setdefault(key, key_node.start_mark)
                except TypeError:   # an unhashable key: the base constructor names it
                    continue
                if first is not key_node.start_mark:
                    raise DuplicateKeyError(key, first, key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str):
    """Parse YAML text safely (:class:`UniqueKeyLoader`): what every spec reader uses."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


class InputFileError(HeteroError, ValueError):
    """An input file that cannot be read as text; ``message`` and ``fix`` name the problem."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.message, self.fix = message, fix


def read_user_text(path, what: str) -> str:
    """The text of a user's input file, UTF-8 (a byte-order mark is dropped), at most
    :data:`MAX_INPUT_BYTES`; anything else raises :class:`InputFileError` saying what and the fix."""
    path = Path(path)
    try:
        if path.is_dir():
            raise InputFileError(f"{what} path is a directory", f"give the path of the {what} file")
        with open(path, "rb") as f:
            data = f.read(MAX_INPUT_BYTES + 1)
    except FileNotFoundError:
        raise InputFileError(f"{what} file not found", "check the path") from None
    except OSError as e:
        raise InputFileError(f"cannot read {what} file: {e.strerror}", "check the path and its permissions") from None
    if len(data) > MAX_INPUT_BYTES:
        raise InputFileError(f"{what} file is larger than {MAX_INPUT_BYTES // 2**20} MiB",
                             f"give the {what} file itself (not a device or a data dump)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputFileError(f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})",
                             "save the file as UTF-8") from None


def nearest_existing(path) -> Path:
    """``path`` itself if it exists, else its nearest existing ancestor (where missing directories
    would be made)."""
    existing = Path(os.path.abspath(path))
    while not existing.exists():
        existing = existing.parent
    return existing


def staging_path(path) -> str:
    """Where a folder output (a ``--save`` checkpoint, import-hf's or export-hf's ``OUT``) is written
    before it is moved into place: ``PATH.partial``, removed first. An output of its command too."""
    return os.path.normpath(path) + ".partial"


def previous_path(path) -> str:
    """Where a ``--save`` checkpoint's previous version waits while the new one is moved into place:
    ``PATH.old``, removed first and after. An output of its command too."""
    return os.path.normpath(path) + ".old"


def check_output_path(path, what: str) -> Path:
    """Fail early, before any work, when ``path`` cannot receive an output file: a directory or a
    non-regular file is there, or no writable directory would hold it. Returns the path to write
    (a symbolic link's target, so the link itself is kept). Missing directories are not made here:
    :func:`write_text_atomic` makes them when it writes, so a run that fails in between leaves none
    behind."""
    if not str(path):
        raise InputFileError(f"{what}: no output file named", "give a file path")
    path = Path(os.path.realpath(path))
    if path.exists():
        if path.is_dir():
            raise InputFileError(f"{what} {path} is a directory", "give a file path inside it")
        if not stat.S_ISREG(path.stat().st_mode):
            raise InputFileError(f"{what} {path} is not a regular file", "write to a regular file")
        if not os.access(path, os.W_OK):
            raise InputFileError(f"{what} {path} is not writable", "choose another path or fix its permissions")
    existing = nearest_existing(path.parent)
    if not existing.is_dir():
        raise InputFileError(f"{what} {path}: cannot create its directory: {existing} is not a directory",
                             "choose a writable directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputFileError(f"{what} {path}: cannot create files in {existing}", "choose a writable directory")
    return path


def _make_parents(path: Path, what: str) -> list[Path]:
    """Make the missing directories above ``path``; returns those it made, deepest first."""
    made, parent = [], path.parent
    while not parent.exists():
        made.append(parent)
        parent = parent.parent
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _remove_empty(made)
        raise InputFileError(f"{what} {path}: cannot create its directory: {e.strerror}",
                             "choose a writable directory") from None
    return made


def _remove_empty(dirs: list[Path]) -> None:
    """Remove ``dirs`` (deepest first) as far as they are empty: what a failed write made."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return


def read_mapping(path_or_dict, what: str, source: str | None = None) -> tuple[dict, str]:
    """Return ``(data, source)`` for a path or an already-parsed dict (named ``source`` in error
    messages when given, e.g. the file it was read from); bad files raise SpecError, and so does a
    file of another kind when ``what`` names one (a model file read as a cluster)."""
    if isinstance(path_or_dict, dict):
        return _check_kind(path_or_dict, what, source or f"<{what} dict>")
    path = Path(path_or_dict)
    source = str(path)
    try:
        text = read_user_text(path, what)
    except InputFileError as e:
        raise SpecError([Problem("", e.message, e.fix, source)]) from None
    try:
        data = load_yaml(text)
    except DuplicateKeyError as e:
        mark = e.problem_mark
        raise SpecError([Problem(f"line {mark.line + 1}, column {mark.column + 1}", e.problem,
                                 f"keep one '{e.key}:' in this mapping (YAML would silently keep the last)",
                                 source)]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError([Problem(where, f"not valid YAML: {getattr(e, 'problem', e)}",
                                 "fix the YAML syntax", source)]) from None
    if data is None:
        raise SpecError([Problem("", f"the {what} file is empty", f"see docs/formats.md for the {what} format", source)])
    if not isinstance(data, dict):
        raise SpecError([Problem("", f"expected a YAML mapping at the top of the {what} file, got "
                                     f"{type(data).__name__}", f"see docs/formats.md for the {what} format", source)])
    return _check_kind(data, what, source)


def _check_kind(data: dict, what: str, source: str) -> tuple[dict, str]:
    problem = wrong_kind(data, what, source) if what in MARKERS else None
    if problem:
        raise SpecError([problem])
    return data, source


_OUTPUT_NAME = contextvars.ContextVar("output_name", default="output")


@contextlib.contextmanager
def output_named(what: str):
    """Inside the block, an output written without a name of its own (a writer such as
    ``Plan.save``, ``Calibration.save`` or a profile writer, handed the path by the CLI) is named
    ``what`` in errors (``-o``, ``--timeline``), not "output"."""
    token = _OUTPUT_NAME.set(what)
    try:
        yield
    finally:
        _OUTPUT_NAME.reset(token)


def write_yaml_atomic(path, data: dict, header: str = "") -> None:
    """Write ``data`` as YAML to ``path`` with :func:`write_text_atomic`: one top-level field a line
    (a mapping of plain values would otherwise be written as one ``{...}`` flow mapping), nested
    lists of plain values inline (``layers: [0, 4]``)."""
    text = (header if header.endswith("\n") or not header else header + "\n")
    for key, value in data.items():
        nested = isinstance(value, (dict, list, tuple))
        text += yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=None if nested else False, width=100)
    write_text_atomic(path, text)


def write_text_atomic(path, text: str | bytes, what: str | None = None) -> None:
    """Write ``text`` (or ``bytes``: a PNG) to ``path`` via a temporary file in its directory, so a
    reader never sees half of it: every output file is written this way. Missing parent directories are made; when the
    write fails, neither the temporary file nor a directory made for it is left behind, and an
    existing file keeps its old content. A symbolic link is written through (the link stays), a
    device or directory is refused, and the file gets the mode a plain ``open`` would give it (an
    existing file keeps its own). ``what`` names the output in errors (``-o``, ``--timeline``);
    without it, the name an enclosing :func:`output_named` gives, else "output"."""
    what = what or _OUTPUT_NAME.get()
    path = check_output_path(path, what)
    made = _make_parents(path, what)
    if path.exists():
        mode = stat.S_IMODE(path.stat().st_mode)
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with (os.fdopen(fd, "wb") if isinstance(text, bytes) else os.fdopen(fd, "w", encoding="utf-8")) as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as e:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
        _remove_empty(made)
        if isinstance(e, OSError):
            # name the file the user asked for, not the temporary one beside it
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise
