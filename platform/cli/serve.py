"""Server side: ``retouch serve`` (gateway and local executors) and ``retouch demo``.

``serve``'s flags are the knobs of :class:`~retouch.platform.api.config.ServeConfig` and of the
executors (:class:`~retouch.runtime.executor.options.ExecutorOptions`), declared there once.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from retouch.functions.knobs import add_flags, from_flags
from retouch.platform.api.config import ServeConfig
from retouch.platform.cli.common import existing_dir, positive_int
from retouch.runtime.executor.options import ExecutorOptions

log = logging.getLogger("retouch")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the gateway and local executors",
        description="Every setting also reads a RETOUCH_<NAME> environment variable; "
        "a flag given wins over it.",
    )
    add_flags(p, ServeConfig, unset=True)
    add_flags(p, ExecutorOptions, unset=True)
    p.set_defaults(run=_serve)

    p = sub.add_parser(
        "demo",
        help="start a platform, edit with the trained demo model, write a labelled sheet",
        description="Deploys the trained model retouch:shapes-sd, serves four edits, runs the "
        "same edits through the stock diffusers pipeline and writes OUT/shapes-sheet.png "
        "(prompt, template, mask, stock, retouch, difference); --tour adds the random-weight "
        "example models.",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("retouch-demo"),
        help="folder for the images and the platform's data (default ./retouch-demo)",
    )
    p.add_argument(
        "--examples",
        type=existing_dir,
        default=None,
        help="folder with shapes-sd.toml, tiny-sd.toml and tiny-flux.toml "
        "(default: the shipped examples)",
    )
    p.add_argument("--executors", type=positive_int, default=1, help="CPU executors (default 1)")
    p.add_argument(
        "--tour",
        action="store_true",
        help="after the trained model's edits, also deploy tiny-sd and tiny-flux (random "
        "weights: their outputs are noise) and invoke each with six masks per template",
    )
    p.set_defaults(run=_demo)


def config_of(args: argparse.Namespace) -> ServeConfig:
    """The settings of a parsed ``retouch serve``: flags, then environment, then defaults."""
    return ServeConfig.from_env(
        **from_flags(ServeConfig, args), **from_flags(ExecutorOptions, args)
    )


def _serve(args: argparse.Namespace) -> None:
    from retouch.platform.api.server import serve

    config = config_of(args)
    log.info("serving on http://%s:%d (data dir %s)", config.host, config.port, config.data_dir)
    log.info(
        "web page: http://%s:%d/#token=<your invoke token> (the fragment stays in the browser)",
        config.host,
        config.port,
    )
    serve(config)


def _demo(args: argparse.Namespace) -> None:
    from retouch.platform.lab.demo import run_demo

    run_demo(args.out, args.examples, args.executors, tour=args.tour)
