"""Knobs: settings declared once, as dataclass fields, and read from every place alike.

A knob is a field made with :func:`knob`: its default, help text and (derived from its
name) its command-line flag and ``RETOUCH_*`` environment variable. From one declaration
:func:`add_flags` adds the flags to an ``argparse`` parser, :func:`from_flags` and
:func:`from_env` read them back, and :func:`to_flags` writes a value as the flags that
reproduce it (how the gateway starts its executors). So a knob has one default and one
help text whether it is set on ``retouch serve``, in the environment or on an executor.
Plain data and the standard library only: the CLI imports this without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

ENV_PREFIX = "RETOUCH_"


def knob(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    env: bool = True,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    shown: str | None = None,
    metavar: str | None = None,
) -> Any:
    """A dataclass field that is a knob.

    ``flag``: the command-line flag (default ``--<name-with-dashes>``; ``""``: none);
    ``env``: whether ``RETOUCH_<NAME>`` sets it; ``parse``: text to value (default: from
    the default's type); ``shown``: the default as help texts print it; ``metavar``: the
    value's name in help texts (default the field's name in capitals).
    """
    meta = {
        "help": help,
        "flag": flag,
        "env": env,
        "parse": parse,
        "choices": choices,
        "shown": shown,
        "metavar": metavar,
    }
    if isinstance(default, list | dict | set):
        raise TypeError("knob defaults are immutable values")
    return dataclasses.field(default=default, metadata={"knob": meta})


def words(text: str) -> tuple[str, ...]:
    """A comma-separated list."""
    return tuple(w.strip() for w in text.split(",") if w.strip())


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


def checked(kind: Callable[[str], Any], what: str, ok: Callable[[Any], bool]) -> Callable:
    """A parser: ``kind(text)`` that must satisfy ``ok``, else "expected <what>"."""

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise ValueError(f"expected {what}, got {text!r}")
        return value

    convert.__name__ = what  # argparse names the type in some messages
    return convert


positive_int = checked(int, "an integer >= 1", lambda v: v >= 1)
non_negative_int = checked(int, "an integer >= 0", lambda v: v >= 0)
positive_float = checked(float, "a number > 0", lambda v: v > 0)
non_negative_float = checked(float, "a number >= 0", lambda v: v >= 0)
mask_ratio = checked(float, "a mask ratio in (0, 1]", lambda v: 0 < v <= 1)


def listed(item: Callable[[str], Any], what: str) -> Callable[[str], tuple]:
    """A parser of comma-separated ``item`` values (at least one)."""

    def convert(text: str) -> tuple:
        try:
            values = tuple(item(v) for v in text.split(",") if v.strip())
        except ValueError:
            values = ()
        if not values:  # nothing given, or an item that does not parse
            raise ValueError(f"expected comma-separated {what}, got {text!r}")
        return values

    return convert


def existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise ValueError(f"no such file: {text}")
    return path


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def knobs(cls: type) -> list[dataclasses.Field]:
    """The knob fields of a dataclass, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "knob" in f.metadata]


def flag_of(field: dataclasses.Field) -> str:
    flag = field.metadata["knob"]["flag"]
    return "--" + field.name.replace("_", "-") if flag is None else flag


def env_of(field: dataclasses.Field) -> str | None:
    return ENV_PREFIX + field.name.upper() if field.metadata["knob"]["env"] else None


def _parser(field: dataclasses.Field) -> Callable[[str], Any]:
    meta = field.metadata["knob"]
    if meta["parse"] is not None:
        return meta["parse"]
    default = field.default
    if isinstance(default, bool):
        return boolean
    if isinstance(default, tuple):
        return words
    if isinstance(default, Path) or (default is None and "Path" in str(field.type)):
        return Path
    if isinstance(default, int):
        return integer
    if isinstance(default, float):
        return number
    return str


def _shown(field: dataclasses.Field, default: Any) -> str:
    meta = field.metadata["knob"]
    if meta["shown"] is not None and default == field.default:
        return meta["shown"]
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, tuple):
        return ",".join(str(v) for v in default)
    return "none" if default is None else str(default)


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    unset: bool = False,
    skip: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """One flag per knob of ``cls``. ``unset``: flags not given parse as None (so that
    the environment and the declared default can fill them in, in that order);
    ``defaults``: other defaults than the declared ones (a command whose value of ``cls``
    has its own, e.g. a benchmark's workload)."""
    for field in knobs(cls):
        flag = flag_of(field)
        if not flag or field.name in skip:
            continue
        meta = field.metadata["knob"]
        declared = (defaults or {}).get(field.name, field.default)
        default = None if unset else declared
        env = env_of(field)
        where = f"; ${env}" if env and unset else ""
        text = f"{meta['help']} (default {_shown(field, declared)}{where})"
        if isinstance(field.default, bool):
            parser.add_argument(
                flag,
                dest=field.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=text,
            )
            continue
        parse = _parser(field)
        parser.add_argument(
            flag,
            dest=field.name,
            type=argument_type(parse),
            choices=meta["choices"],
            default=default,
            help=text,
            metavar=None if meta["choices"] else meta["metavar"] or field.name.upper(),
        )


def argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with its ``ValueError`` message kept (argparse prefixes the flag)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def from_flags(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The knobs of ``cls`` given on the command line (None: not given)."""
    return {
        f.name: getattr(args, f.name) for f in knobs(cls) if getattr(args, f.name, None) is not None
    }


def from_env(cls: type, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The knobs of ``cls`` set in the environment; a bad value names its variable."""
    environ = os.environ if environ is None else environ
    found = {}
    for field in knobs(cls):
        name = env_of(field)
        if name is None or name not in environ:
            continue
        text = environ[name]
        try:
            found[field.name] = _parser(field)(text)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    return found


def to_flags(value: Any, *, skip: Iterable[str] = ()) -> list[str]:
    """The command-line flags that give every knob of ``value`` its current value."""
    out: list[str] = []
    for field in knobs(type(value)):
        flag = flag_of(field)
        if not flag or field.name in skip:
            continue
        current = getattr(value, field.name)
        if isinstance(field.default, bool):
            out.append(flag if current else "--no-" + flag[2:])
        elif current is not None:
            text = ",".join(current) if isinstance(current, tuple) else str(current)
            out += [flag, text]
    return out
