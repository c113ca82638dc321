"""``retouch bench ...``: one registration function and one run function per benchmark,
grouped by what they measure (one module each).

The benchmarks themselves live in :mod:`retouch.platform.lab.bench` (imported when run: most
of them need torch); these modules only declare their options and print their results.
"""

from __future__ import annotations

import argparse

from retouch.platform.cli.bench import engine, pool, production, quality, serving

# in the order ``retouch bench --help`` lists them
SUBCOMMANDS = (
    serving.add_gateway,
    serving.add_wire,
    serving.add_coldstart,
    serving.add_wake,
    serving.add_deploy,
    engine.add_engine,
    quality.add_fidelity,
    pool.add_load,
    pool.add_placement,
    pool.add_sim,
    pool.add_validate,
    engine.add_plan,
    engine.add_adapters,
    engine.add_mixed_adapters,
    quality.add_edits,
    serving.add_store,
    serving.add_memory,
    serving.add_crop,
    production.add_ops,
    production.add_production,
)


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (ratios measured side by side in one run)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for add in SUBCOMMANDS:
        add(bench_sub)
