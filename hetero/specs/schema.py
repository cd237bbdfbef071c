"""A small declarative loader: frozen dataclasses in, every problem of a file out.

Each spec is a frozen dataclass whose fields carry their type (``int``, ``float``, ``str``,
``bool``, ``Literal[...]``, ``list[X]``, ``dict[str, X]``, ``tuple[int, int]``, ``X | None``,
nested dataclasses) and, for quantities, a unit kind in ``metadata={"kind": "bytes"}``.
:func:`load_dataclass` walks a plain dict (from YAML) against that description, collecting
every unknown field (with a did-you-mean), missing field, wrong type and bad unit, each named by
its path. Cross-field rules live in an optional ``_check(self, path, problems)`` method.
An ``int`` field takes an integer only: not a quoted number, a boolean or a float (even ``2.0``).
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, get_args, get_origin

from .errors import Problems, closest, did_you_mean, join_path
from .kinds import LABEL, belongs_to
from .units import UnitError, parse_quantity

_MISSING = object()


def quantity(kind: str, default=dataclasses.MISSING, doc: str = ""):
    """A dataclass field holding a quantity of ``kind`` (see :mod:`hetero.specs.units`)."""
    return dataclasses.field(default=default, metadata={"kind": kind, "doc": doc})


def _type_name(tp) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp) if a is not type(None))
    if origin in (list, dict, tuple):
        return {list: "a list", dict: "a mapping", tuple: "a pair"}[origin]
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _convert(value, tp, kind: str | None, path: str, problems: Problems):
    """Convert ``value`` to type ``tp``; record a problem and return _MISSING on failure."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, args[0], kind, path, problems)
    if kind is not None and tp is float:
        try:
            return parse_quantity(value, kind)
        except UnitError as e:
            problems.add(path, str(e), "use a number in base SI units or a value with a unit")
            return _MISSING
    if origin is Literal:
        choices = get_args(tp)
        if all(isinstance(c, int) for c in choices):   # zero_stage: 0 | 1 | 2, an integer like any other
            value = _convert(value, int, None, path, problems)
            if value is _MISSING:
                return _MISSING
        if value in choices:
            return value
        close = closest(value, choices) if isinstance(value, str) else None
        problems.add(path, f"{value!r} is not one of {', '.join(repr(c) for c in choices)}",
                     f"did you mean '{close}'?" if close else f"choose one of {', '.join(str(c) for c in choices)}")
        return _MISSING
    if tp is bool:
        if isinstance(value, bool):
            return value
        problems.add(path, f"expected true or false, got {value!r}", "write true or false")
        return _MISSING
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            # integers in our files are written as integers: `2.0` is refused like `"2"`, not read as 2
            problems.add(path, f"expected an integer, got {value!r} (a float)",
                         f"write {int(value)} without the decimal point")
            return _MISSING
        quoted = isinstance(value, str) and value.strip().lstrip("+-").isdigit()
        problems.add(path, f"expected an integer, got {value!r}" + (" (a string)" if quoted else ""),
                     f"write {value.strip()} without quotes" if quoted else "write a whole number")
        return _MISSING
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):
            return number
        problems.add(path, f"expected a finite number, got {value!r}", "write a number")
        return _MISSING
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        problems.add(path, f"expected a string, got {value!r}", "write a string")
        return _MISSING
    if origin is list:
        (item_tp,) = get_args(tp)
        if not isinstance(value, (list, tuple)):
            problems.add(path, f"expected a list, got {type(value).__name__}", "write a YAML list")
            return _MISSING
        out = [_convert(v, item_tp, kind, join_path(path, i), problems) for i, v in enumerate(value)]
        return _MISSING if any(o is _MISSING for o in out) else tuple(out)
    if origin is tuple:
        item_tps = get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(item_tps):
            problems.add(path, f"expected a list of {len(item_tps)} items, got {value!r}",
                         f"write [start, end]" if len(item_tps) == 2 else "")
            return _MISSING
        out = [_convert(v, t, kind, join_path(path, i), problems) for i, (v, t) in enumerate(zip(value, item_tps))]
        return _MISSING if any(o is _MISSING for o in out) else tuple(out)
    if origin is dict:
        key_tp, val_tp = get_args(tp)
        if not isinstance(value, dict):
            problems.add(path, f"expected a mapping, got {type(value).__name__}", "write key: value pairs")
            return _MISSING
        out = {}
        for k, v in value.items():
            conv = _convert(v, val_tp, kind, join_path(path, str(k)), problems)
            if conv is not _MISSING:
                out[str(k)] = conv
        return out
    if dataclasses.is_dataclass(tp):
        return load_dataclass(tp, value, path, problems)
    if tp is dict:  # a raw mapping, validated later by its owner (e.g. device entries)
        if isinstance(value, dict):
            return value
        problems.add(path, f"expected a mapping, got {type(value).__name__}", "write key: value pairs")
        return _MISSING
    if tp is Any:
        return value
    raise TypeError(f"schema cannot handle type {tp!r} at {path}")


def load_dataclass(cls, data, path: str, problems: Problems):
    """Build ``cls`` from the mapping ``data``; returns _MISSING (and records why) on failure."""
    if not isinstance(data, dict):
        problems.add(path, f"expected a mapping, got {type(data).__name__}", "write key: value pairs")
        return _MISSING
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    before, misplaced = len(problems.items), 0
    kind = getattr(cls, "_file_kind", None)   # the top of a cluster, model or plan file
    for key in data:
        if key not in fields:
            other = belongs_to(str(key), kind) if kind and not path else None
            if other:
                problems.add_misplaced(join_path(path, str(key)), f"'{key}' is a field of {LABEL[other]} file, "
                                                                  f"not of {LABEL[kind]} file",
                                       f"move it to the {other} file")
                misplaced += 1
            else:
                problems.add(join_path(path, str(key)), f"unknown field '{key}'", did_you_mean(key, fields))
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                problems.add(join_path(path, name), "required field is missing",
                             f"add '{name}: <{_type_name(hints[name])}>'")
            continue
        value = _convert(data[name], hints[name], f.metadata.get("kind"), join_path(path, name), problems)
        if value is not _MISSING:
            kwargs[name] = value
    # A misplaced field is no misspelling of one of cls's own (those would be missing or left at a
    # default): the object is built and its range checks run, so the file's other errors show too.
    if len(problems.items) - before > misplaced:
        return _MISSING
    obj = cls(**kwargs)
    check = getattr(obj, "_check", None)
    if check is not None:
        check(path, problems)
    return obj


def is_missing(obj) -> bool:
    return obj is _MISSING


def to_plain(obj):
    """Dataclasses, tuples and dicts to plain YAML-safe Python data (inverse of loading)."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            if not f.init or f.metadata.get("derived"):
                continue
            value = getattr(obj, f.name)
            if value is None and f.default is None:
                continue
            out[f.name] = to_plain(value)
        return out
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    return obj
