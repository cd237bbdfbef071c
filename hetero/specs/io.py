"""Reading spec files (YAML, safe loader only) and writing them back atomically."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import yaml

from .errors import Problem, SpecError


def read_mapping(path_or_dict, what: str, source: str | None = None) -> tuple[dict, str]:
    """Return ``(data, source)`` for a path or an already-parsed dict (named ``source`` in error
    messages when given, e.g. the file it was read from); bad files raise SpecError."""
    if isinstance(path_or_dict, dict):
        return path_or_dict, source or f"<{what} dict>"
    path = Path(path_or_dict)
    source = str(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError([Problem("", f"{what} file not found", "check the path", source)]) from None
    except OSError as e:
        raise SpecError([Problem("", f"cannot read {what} file: {e.strerror}", "check the path", source)]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError([Problem(where, f"not valid YAML: {getattr(e, 'problem', e)}",
                                 "fix the YAML syntax", source)]) from None
    if not isinstance(data, dict):
        raise SpecError([Problem("", f"expected a YAML mapping at the top of the {what} file, got "
                                     f"{type(data).__name__}", f"see SCHEMAS.md for the {what} format", source)])
    return data, source


def write_yaml_atomic(path, data: dict, header: str = "") -> None:
    """Write ``data`` as YAML to ``path`` via a temporary file, so nothing half-written remains."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (header if header.endswith("\n") or not header else header + "\n")
    text += yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)
    write_text_atomic(path, text)


def write_text_atomic(path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
