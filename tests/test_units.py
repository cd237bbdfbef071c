"""Quantities with units: bits vs bytes, GiB vs GB, every kind, and the errors."""
import pytest

from hetero.specs.units import UnitError, format_quantity, parse_quantity


@pytest.mark.parametrize("text,kind,expected", [
    ("80 GiB", "bytes", 80 * 2**30),
    ("80 GB", "bytes", 80e9),
    ("96 MiB", "bytes", 96 * 2**20),
    ("40MB", "bytes", 40e6),
    (1024, "bytes", 1024.0),
    ("300 GB/s", "bandwidth", 300e9),
    ("200 Gb/s", "bandwidth", 25e9),          # bits: divided by 8
    ("200 Gbps", "bandwidth", 25e9),
    ("1.6 TB/s", "bandwidth", 1.6e12),
    ("16 GiB/s", "bandwidth", 16 * 2**30),
    ("989 TFLOPS", "flops", 989e12),
    ("19.5 TFLOP/s", "flops", 19.5e12),
    ("5 us", "time", 5e-6),
    ("5 µs", "time", 5e-6),
    ("1.2 ms", "time", 1.2e-3),
    ("2 s", "time", 2.0),
    ("1.8 GHz", "frequency", 1.8e9),
    ("400 W", "power", 400.0),
    ("1e3 GB", "bytes", 1e12),
])
def test_parse(text, kind, expected):
    assert parse_quantity(text, kind) == pytest.approx(expected, rel=1e-12)


def test_bits_and_bytes_differ_by_eight():
    assert parse_quantity("100 GB/s", "bandwidth") == 8 * parse_quantity("100 Gb/s", "bandwidth")


def test_binary_and_decimal_prefixes_differ():
    assert parse_quantity("1 GiB", "bytes") / parse_quantity("1 GB", "bytes") == pytest.approx(1.073741824)


@pytest.mark.parametrize("text,kind,fragment", [
    ("80 GB", "bandwidth", "unit of bytes"),   # a size where a rate was meant
    ("300 GB/s", "bytes", "unit of bandwidth"),
    ("80 parsecs", "bytes", "unknown unit 'parsecs'"),
    ("fast", "bandwidth", "cannot read"),
    ("-5 GB", "bytes", "negative"),
    (True, "bytes", "expected a number"),
    ([1], "bytes", "expected a number"),
])
def test_errors(text, kind, fragment):
    with pytest.raises(UnitError, match=fragment):
        parse_quantity(text, kind)


@pytest.mark.parametrize("value,kind", [(80 * 2**30, "bytes"), (300e9, "bandwidth"), (312e12, "flops"),
                                        (5e-6, "time"), (1.41e9, "frequency"), (400.0, "power")])
def test_format_parses_back(value, kind):
    assert parse_quantity(format_quantity(value, kind, digits=6), kind) == pytest.approx(value, rel=1e-5)
