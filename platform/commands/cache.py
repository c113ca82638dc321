"""``retouch cache ls | stats | verify | gc``: the activation store of a data directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from retouch.platform.commands.common import add_json, report
from retouch.platform.config import default_data_dir


def register(sub: argparse._SubParsersAction) -> None:
    cache = sub.add_parser("cache", help="inspect the activation store of a data directory")
    cache.add_argument(
        "--data-dir", type=Path, default=None, help="default $RETOUCH_DATA_DIR or ~/.retouch"
    )
    cache_sub = cache.add_subparsers(dest="cache", required=True)
    for name, helptext in (
        ("ls", "list baked templates"),
        ("stats", "store counters and occupancy"),
        ("verify", "check every checksum; mark corrupt templates invalid"),
        ("gc", "remove invalid templates, partial bakes and orphans"),
    ):
        p = cache_sub.add_parser(name, help=helptext)
        add_json(p)
        p.set_defaults(run=_cache)


def _cache(args: argparse.Namespace) -> None:
    from retouch.platform.cachecli import run_cache_command

    data_dir = args.data_dir or default_data_dir()
    result = run_cache_command(args.cache, data_dir)
    if args.json or args.cache != "ls":
        report(result, args.json)
        return
    # ad-hoc templates (uploaded images) are ``upload:<hash>``, keys ``~<hash>``
    width = max([12, *(len(str(r["meta"].get("template", ""))) for r in result)])
    print(f"{'KEY':<34} {'TIER':<5} {'MB':>9} {'FUNCTION':<16} {'TEMPLATE':<{width}} VALID")
    for row in result:
        meta = row["meta"]
        print(
            f"{row['key']:<34} {row['tier']:<5} {row['bytes'] / 1e6:>9.1f} {meta.get('function', ''):<16} {meta.get('template', ''):<{width}} {'yes' if row['valid'] else 'no: ' + row['reason']}"
        )
