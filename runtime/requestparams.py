"""Numbers and ids read from a request's query string, headers, path or form fields: the one
parser of the gateway and the executor API.

Python's own parsers are too lenient for input from a stranger: ``str.isdigit()`` accepts
``'²'`` (which ``int()`` then refuses with an exception), ``int()`` accepts ``'١٢'``,
``'1_000'`` and surrounding whitespace and refuses more than 4300 digits with an exception,
``float()`` accepts ``'nan'``, ``'inf'`` and ``'1_0'``. Here a number is ASCII digits only
(a decimal may have a fraction and an exponent), at most :data:`MAX_CHARS` characters, and
within a range; an id is a bounded string matching its pattern. Anything else is a
structured 400 ``invalid_field`` naming the parameter (a missing required one:
``missing_field``), never a 500 or a dropped connection.
"""

from __future__ import annotations

import re

from retouch.functions.errors import BadRequest

MAX_CHARS = 32  # digits enough for any range here (2**63 has 19), short enough to echo
INTEGER = re.compile(r"-?[0-9]{1,30}")
DECIMAL = re.compile(r"-?[0-9]{1,20}(\.[0-9]{1,20})?([eE][-+]?[0-9]{1,3})?")


def integer(raw: str | None, name: str, lo: int, hi: int, default: int | None = None) -> int:
    """An integer in ``[lo, hi]`` written in ASCII digits (``default`` when absent)."""
    if raw is None and default is not None:
        return default
    text = required(raw, name)
    if len(text) > MAX_CHARS or not INTEGER.fullmatch(text) or not lo <= int(text) <= hi:
        raise BadRequest(
            f"{name} must be an integer in [{lo}, {hi}] written in ASCII digits",
            field=name,
            code="invalid_field",
        )
    return int(text)


def decimal(raw: str | None, name: str, lo: float, hi: float) -> float:
    """A number in ``[lo, hi]``: ASCII digits, an optional fraction and exponent (what
    ``str(float)`` writes, so Python clients' values read back); no NaN, no infinity."""
    text = required(raw, name)
    ok = len(text) <= MAX_CHARS and DECIMAL.fullmatch(text) is not None
    if not ok or not lo <= float(text) <= hi:
        raise BadRequest(
            f"{name} must be a number in [{lo:g}, {hi:g}] written in ASCII digits",
            field=name,
            code="invalid_field",
        )
    return float(text)


def identifier(raw: str | None, name: str, pattern: re.Pattern[str], what: str) -> str:
    """An id that matches ``pattern`` (a bounded, ASCII-only pattern; ``what`` describes
    it in the error)."""
    if not pattern.fullmatch(text := required(raw, name)):
        raise BadRequest(f"{name} must be {what}", field=name, code="invalid_field")
    return text


def required(raw: str | None, name: str) -> str:
    """The parameter's text; absent is a 400 ``missing_field``."""
    if raw is None:
        raise BadRequest(f"{name} is required", field=name, code="missing_field")
    return raw
