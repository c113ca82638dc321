"""What several command groups share: argument types, output, the gateway connection."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from retouch.platform.client import Client
from retouch.platform.config import ServeConfig, default_url


def _numbers(text: str, kind: type, what: str) -> list:
    try:
        return [kind(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None


def floats(text: str) -> list[float]:
    return _numbers(text, float, "numbers")


def ints(text: str) -> list[int]:
    return _numbers(text, int, "integers")


def words(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.split(",") if w.strip())


def report(result: object, as_json: bool) -> None:
    """Benchmarks print JSON with ``--json``, an indented summary otherwise."""
    print(json.dumps(result) if as_json else json.dumps(result, indent=2))


def one_line_error(message: str) -> None:
    """A bad option value: one line and exit status 2 (no usage dump, no traceback)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def bar(fraction: float, width: int = 30) -> str:
    done = round(fraction * width)
    return "[" + "#" * done + "." * (width - done) + "]"


def add_models_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where demo models are built (default $RETOUCH_DATA_DIR)",
    )


def models_dir(args: argparse.Namespace) -> Path:
    return (args.data_dir or ServeConfig.from_env().data_dir) / "models"


def client_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--url`` and ``--token`` of the commands that talk to a gateway."""
    p.add_argument(
        "--url", default=None, help="gateway URL (default $RETOUCH_URL or http://127.0.0.1:8000)"
    )
    p.add_argument(
        "--token",
        default=os.environ.get("RETOUCH_TOKEN"),
        help="bearer token (default $RETOUCH_TOKEN)",
    )
    return p


def connect(args: argparse.Namespace) -> Client:
    return Client(args.url or default_url(), args.token)
