"""The one parser of numbers and ids from a request: ASCII digits only, bounded, in range,
and every refusal a 400 naming the parameter (never an exception of Python's parsers)."""

from __future__ import annotations

import re

import pytest

from retouch.functions.errors import BadRequest
from retouch.runtime import requestparams

NOT_INTEGERS = [
    "²",  # str.isdigit() says yes, int() raises
    "١٢",  # Arabic-Indic digits: int() reads 12
    "１２",  # fullwidth digits
    "1_000",  # int() reads 1000
    " 5",
    "5 ",
    "+5",
    "",
    "0x10",
    "1.0",
    "9" * 5000,  # int() raises beyond 4300 digits
    "5\x00",
]


@pytest.mark.parametrize("raw", NOT_INTEGERS, ids=[repr(r)[:12] for r in NOT_INTEGERS])
def test_an_integer_is_ascii_digits_only(raw: str) -> None:
    with pytest.raises(BadRequest) as err:
        requestparams.integer(raw, "limit", 0, 10**30)
    assert (err.value.code, err.value.field) == ("invalid_field", "limit")


def test_an_integer_in_range_or_its_default() -> None:
    assert requestparams.integer("42", "n", 0, 100) == 42
    assert requestparams.integer("0", "n", 0, 100) == 0
    assert requestparams.integer(None, "n", 0, 100, default=7) == 7
    for out in ("101", "-1"):
        with pytest.raises(BadRequest):
            requestparams.integer(out, "n", 0, 100)
    with pytest.raises(BadRequest) as missing:
        requestparams.integer(None, "expires", 0, 100)
    assert (missing.value.code, missing.value.field) == ("missing_field", "expires")


@pytest.mark.parametrize(
    "raw",
    ["nan", "inf", "-inf", "1e400", "1_0", "²", "٣", "1.", ".5", "5" * 40, "", "1e"],
    ids=repr,
)
def test_a_decimal_is_ascii_and_finite(raw: str) -> None:
    with pytest.raises(BadRequest) as err:
        requestparams.decimal(raw, "Prefer", 0.0, 1e300)
    assert (err.value.code, err.value.field) == ("invalid_field", "Prefer")


def test_a_decimal_reads_what_python_writes() -> None:
    for value in (0.0, 7.5, 1e-05, 12.0, 49.999):
        assert requestparams.decimal(str(value), "guidance_scale", 0.0, 50.0) == value
    with pytest.raises(BadRequest):
        requestparams.decimal("50.5", "guidance_scale", 0.0, 50.0)


def test_an_identifier_matches_its_pattern() -> None:
    hexid = re.compile(r"[0-9a-f]{4}")
    assert requestparams.identifier("0a1b", "id", hexid, "4 hex digits") == "0a1b"
    for raw in ("0A1B", "0a1", "０a1b", "0a1b\n"):
        with pytest.raises(BadRequest) as err:
            requestparams.identifier(raw, "id", hexid, "4 hex digits")
        assert err.value.field == "id" and "4 hex digits" in err.value.message
