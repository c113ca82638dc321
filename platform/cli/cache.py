"""``retouch cache ls | stats | verify | gc``: the activation store of a data directory,
or (``stats --url``) the counters of a running server's executors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from retouch.platform.api.config import default_data_dir
from retouch.platform.cli.common import (
    add_json,
    client_options,
    connect,
    print_table,
)

DATA_DIR_HELP = "default $RETOUCH_DATA_DIR or ~/.retouch"


def register(sub: argparse._SubParsersAction) -> None:
    cache = sub.add_parser("cache", help="inspect the activation store of a data directory")
    cache.add_argument("--data-dir", type=Path, default=None, help=DATA_DIR_HELP)
    cache_sub = cache.add_subparsers(dest="cache", required=True)
    for name, helptext in (
        ("ls", "list baked templates"),
        ("stats", "store counters and occupancy (--url: a running server's executors')"),
        ("verify", "check every checksum; mark corrupt templates invalid"),
        ("gc", "remove invalid templates, partial bakes and orphans"),
    ):
        p = cache_sub.add_parser(name, help=helptext)
        # after the subcommand too; SUPPRESS keeps a --data-dir given before it
        p.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS, help=DATA_DIR_HELP)
        add_json(p)
        if name == "stats":
            client_options(p)
        p.set_defaults(run=_cache)


def _cache(args: argparse.Namespace) -> None:
    if args.cache == "stats" and args.url is not None:
        _server_stats(args)
        return
    from retouch.platform.lab.cachecli import run_cache_command  # torch: only for a data dir

    data_dir = args.data_dir or default_data_dir()
    result = run_cache_command(args.cache, data_dir)
    if args.json:
        print(json.dumps(result))
        return
    if args.cache != "ls":
        _print_fields(result)
        return
    # ad-hoc templates (uploaded images) are ``upload:<hash>``, keys ``~<hash>``
    rows = [
        [
            row["key"],
            row["tier"],
            f"{row['bytes'] / 1e6:.1f}",
            row["meta"].get("function", ""),
            row["meta"].get("template", ""),
            "yes" if row["valid"] else "no: " + row["reason"],
        ]
        for row in result
    ]
    print_table(["KEY", "TIER", "MB", "FUNCTION", "TEMPLATE", "VALID"], rows)


def _server_stats(args: argparse.Namespace) -> None:
    """Each executor's store counters and host-tier occupancy, as the server reports them
    (``GET /v1/executors``): the counters live in the executors, not in this process."""
    with connect(args) as client:
        executors = client.executors()["executors"]
    stats = {e["name"]: (e.get("state") or {}).get("cache") or {} for e in executors}
    if args.json:
        print(json.dumps(stats))
        return
    for name, fields in stats.items():
        print(f"{name}:")
        _print_fields(fields, indent="  ")


def _print_fields(result: dict[str, Any], indent: str = "") -> None:
    """A mapping as aligned ``name  value`` lines (nested values as JSON)."""
    width = max([0, *(len(str(k)) for k in result)])
    for key, value in result.items():
        shown = value if isinstance(value, int | float | str) else json.dumps(value)
        print(f"{indent}{key:<{width}}  {shown}")
