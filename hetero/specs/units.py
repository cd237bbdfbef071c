"""Quantities with units: ``80 GiB``, ``300 GB/s``, ``200 Gb/s``, ``989 TFLOPS``, ``5 us``, ``1.8 GHz``.

A plain number is taken in base SI units (bytes, bytes/s, FLOP/s, seconds, hertz, watts).
Decimal prefixes are powers of 1000 (``GB``), binary ones powers of 1024 (``GiB``). In rates a
lower-case ``b`` means bits (``Gb/s``, ``Gbps``) and is divided by 8 to give bytes/s.
"""
from __future__ import annotations

import re

# The kinds of quantity a field may hold.
KINDS = ("bytes", "bandwidth", "flops", "time", "frequency", "power")

_DECIMAL = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}

_NUMBER = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(.*?)\s*$")


def _byte_units() -> dict[str, float]:
    units = {"B": 1.0, "byte": 1.0, "bytes": 1.0}
    for p, f in _DECIMAL.items():
        if p:
            units[f"{p}B"] = f
    for p, f in _BINARY.items():
        units[f"{p}B"] = f
    return units


def _bandwidth_units() -> dict[str, float]:
    units = {}
    for name, f in _byte_units().items():
        if name in ("byte", "bytes"):
            continue
        units[f"{name}/s"] = f
        units[f"{name}ps"] = f  # GBps
    for p, f in list(_DECIMAL.items()) + list(_BINARY.items()):
        units[f"{p}b/s"] = f / 8.0
        units[f"{p}bps"] = f / 8.0
        units[f"{p}bit/s"] = f / 8.0
    return units


def _flops_units() -> dict[str, float]:
    units = {}
    for p, f in _DECIMAL.items():
        for suffix in ("FLOPS", "FLOP/s", "flops", "FLOPs"):
            units[f"{p}{suffix}"] = f
    return units


_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ns": 1e-9,
               "min": 60.0, "h": 3600.0}
_FREQ_UNITS = {f"{p}Hz": f for p, f in _DECIMAL.items()}
_POWER_UNITS = {f"{p}W": f for p, f in _DECIMAL.items()}

UNITS: dict[str, dict[str, float]] = {
    "bytes": _byte_units(),
    "bandwidth": _bandwidth_units(),
    "flops": _flops_units(),
    "time": _TIME_UNITS,
    "frequency": _FREQ_UNITS,
    "power": _POWER_UNITS,
}

EXAMPLES = {
    "bytes": "'80 GiB' or '40 GB'",
    "bandwidth": "'300 GB/s' or '200 Gb/s'",
    "flops": "'312 TFLOPS'",
    "time": "'5 us' or '1.2 ms'",
    "frequency": "'1.41 GHz'",
    "power": "'400 W'",
}


class UnitError(ValueError):
    """A quantity that could not be parsed; the message says what was expected."""


def parse_quantity(value, kind: str) -> float:
    """Return ``value`` in base SI units of ``kind``; raise :class:`UnitError` otherwise.

    >>> parse_quantity("80 GiB", "bytes")
    85899345920.0
    >>> parse_quantity("200 Gb/s", "bandwidth")
    25000000000.0
    """
    if kind not in UNITS:
        raise ValueError(f"unknown quantity kind {kind!r}")
    if isinstance(value, bool):
        raise UnitError(f"expected a number or a string like {EXAMPLES[kind]}, got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        m = _NUMBER.match(value)
        if not m:
            raise UnitError(f"cannot read {value!r} as a quantity; write it like {EXAMPLES[kind]}")
        number, unit = float(m.group(1)), m.group(2)
        if unit:
            table = UNITS[kind]
            if unit not in table:
                # A unit of another kind is the most common mistake (GB where GB/s was meant).
                other = [k for k, t in UNITS.items() if unit in t and k != kind]
                hint = f" ('{unit}' is a unit of {other[0]})" if other else ""
                raise UnitError(f"unknown unit '{unit}' in {value!r} for a {kind} quantity{hint}; "
                                f"write it like {EXAMPLES[kind]}")
            number *= table[unit]
    else:
        raise UnitError(f"expected a number or a string like {EXAMPLES[kind]}, got {type(value).__name__}")
    if number != number or number in (float("inf"), float("-inf")):
        raise UnitError(f"{value!r} is not a finite number")
    if number < 0:
        raise UnitError(f"{value!r} is negative")
    return number


def format_quantity(value: float, kind: str, digits: int = 3) -> str:
    """Human-readable form, e.g. ``80 GiB``, ``300 GB/s``, ``989 TFLOPS`` (inverse of parsing)."""
    if kind == "bytes":
        for unit, f in (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
            if value >= f:
                return f"{value / f:.{digits}g} {unit}"
        return f"{value:.{digits}g} B"
    if kind == "time":
        for unit, f in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
            if value >= f:
                return f"{value / f:.{digits}g} {unit}"
        return f"{value / 1e-9:.{digits}g} ns"
    suffix = {"bandwidth": "B/s", "flops": "FLOPS", "frequency": "Hz", "power": "W"}[kind]
    for p in ("P", "T", "G", "M", "k"):
        if value >= _DECIMAL[p]:
            return f"{value / _DECIMAL[p]:.{digits}g} {p}{suffix}"
    return f"{value:.{digits}g} {suffix}"


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 replica``, ``2 replicas`` (``many``: the plural where it is not ``word + "s"``)."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"
