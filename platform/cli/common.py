"""What several command groups share: argument types, output, the gateway connection."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from retouch.functions import knobs
from retouch.functions.errors import RetouchError
from retouch.functions.knobs import argument_type
from retouch.functions.modelcheck import model_family
from retouch.functions.models import is_builtin, known_builtin
from retouch.platform.api.client import Client
from retouch.platform.api.config import default_data_dir, default_url


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``error: retouch <command>: ...``) and
    exit status 2, without the usage dump; subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message}\n")


class UsageError(Exception):
    """A bad value or file found after parsing: one line and exit status 2."""


def describe(exc: RetouchError) -> str:
    """``<code>: <message> (field: <field>)``: a structured error on one line."""
    where = f" (field: {exc.field})" if exc.field else ""
    return f"{exc.code}: {exc.message}{where}"


def local_input(what: Callable[[], Any]) -> Any:
    """``what()``, reading the user's local files: its errors are usage errors (exit 2)."""
    try:
        return what()
    except RetouchError as exc:
        raise UsageError(describe(exc)) from None


def _checked(kind: Callable[[str], Any], what: str, ok: Callable[[Any], bool]) -> Callable:
    """An argument type: ``kind(text)`` that must satisfy ``ok``, else "expected <what>"."""
    return argument_type(knobs.checked(kind, what, ok))


def _listed(item: Callable[[str], Any], what: str) -> Callable[[str], list]:
    """A comma-separated list of ``item`` values (at least one)."""

    def convert(text: str) -> list:
        values = [v for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        try:
            return [item(v) for v in values]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {what}, got {text!r}"
            ) from None

    return convert


positive_int = argument_type(knobs.positive_int)
non_negative_int = argument_type(knobs.non_negative_int)
positive_float = argument_type(knobs.positive_float)
non_negative_float = argument_type(knobs.non_negative_float)
ratio = argument_type(knobs.mask_ratio)
unit_interval = _checked(float, "a number in (0, 1]", lambda v: 0.0 < v <= 1.0)
floats = _listed(ratio, "mask ratios in (0, 1]")
ints = _listed(positive_int, "integers >= 1")
non_negative_ints = _listed(non_negative_int, "integers >= 0")
existing_file = argument_type(knobs.existing_file)


def existing_dir(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"no such folder: {text}")
    return path


def builtin(text: str) -> str:
    """A built-in ``retouch:`` model of the catalogue."""
    if not is_builtin(text):
        raise argparse.ArgumentTypeError(f"expected a built-in retouch: model, got {text!r}")
    try:
        known_builtin(text)
    except RetouchError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return text


def model(text: str) -> str:
    """A built-in model, or a local diffusers folder (or cached hub id) a family can load."""
    try:
        model_family(text)
    except RetouchError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return text


def report(result: object, as_json: bool) -> None:
    """Benchmarks print JSON with ``--json``, an indented summary otherwise."""
    print(json.dumps(result) if as_json else json.dumps(result, indent=2))


def print_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """Columns as wide as their widest cell (the last one unpadded), two spaces apart: a
    listing stays aligned however long its names are. Numbers are right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    numeric = [bool(cells) and all(_is_number(r[i]) for r in cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        padded = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values[:-1], widths, numeric, strict=False)
        ]
        return "  ".join([*padded, values[-1]]).rstrip()

    print(line(list(headers)))
    for row in cells:
        print(line(row))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def one_line_error(message: str) -> NoReturn:
    """A bad option value found while running: one line and exit status 2."""
    raise UsageError(message)


def bar(fraction: float, width: int = 30) -> str:
    done = round(fraction * width)
    return "[" + "#" * done + "." * (width - done) + "]"


def add_models_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where demo models are built, under models/ (default $RETOUCH_DATA_DIR)",
    )


def add_json(p: argparse.ArgumentParser, what: str = "the result") -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as one line of JSON")


def models_dir(args: argparse.Namespace) -> Path:
    return (args.data_dir or default_data_dir()) / "models"


def client_options(
    p: argparse.ArgumentParser, *, top_level: bool = False
) -> argparse.ArgumentParser:
    """``--url`` and ``--token`` of the commands that talk to a gateway. Given to the
    ``retouch`` parser itself (``top_level``, with the defaults) and to each such command
    (no defaults: a value given after the command wins, one given before it stays), so
    they go before or after the subcommand alike."""
    default_token = os.environ.get("RETOUCH_TOKEN") if top_level else argparse.SUPPRESS
    p.add_argument(
        "--url",
        default=None if top_level else argparse.SUPPRESS,
        help="gateway URL (default $RETOUCH_URL or http://127.0.0.1:8000)",
    )
    p.add_argument("--token", default=default_token, help="bearer token (default $RETOUCH_TOKEN)")
    return p


def connect(args: argparse.Namespace) -> Client:
    return Client(args.url or default_url(), args.token)
