"""The ``retouch`` command line: the parser, assembled from one module per command group
(:mod:`retouch.platform.cli`), and the one place errors are turned into exit codes.

Server side: ``serve``, ``executor`` (one executor on its own, for ``--provider attach``),
``demo``, ``train-demo``, ``cache``, ``bench``. Client side
(``--url``, default ``$RETOUCH_URL`` or http://127.0.0.1:8000; ``--token``, default
``$RETOUCH_TOKEN``; both before or after the subcommand): ``deploy``, ``ls``, ``rm``,
``invoke`` (``--async``: submit a job), ``jobs ls|watch|cancel``, ``cache stats --url``. No traceback for a user's mistake: a bad option value, a missing
or invalid local file (a spec with a misspelt field included) prints one line
(``error: ...``) and exits 2; an error answered by the gateway prints one line
(``error: <code>: <message>``) and exits 1. SIGTERM and SIGINT stop the servers a command
started (:mod:`retouch.platform.fleet.children`) and unwind it: exit 143 and 130.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from retouch.functions.errors import RetouchError
from retouch.platform.cli import (
    bench,
    cache,
    capacity,
    executor,
    functions,
    jobs,
    models,
    serve,
    train,
)
from retouch.platform.cli.common import Parser, UsageError, client_options, describe
from retouch.platform.fleet import children

GROUPS = (serve, executor, functions, jobs, cache, models, capacity, train, bench)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("RETOUCH_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("httpx", "httpcore", "diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        with children.stop_on_signals():
            args.run(args)
    except RetouchError as exc:
        print(f"error: {describe(exc)}", file=sys.stderr)
        sys.exit(1)
    except (UsageError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="retouch", description="Serverless masked image editing.")
    client_options(parser, top_level=True)  # before the subcommand, or after it
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    return parser


if __name__ == "__main__":
    main()
