"""``retouch executor``: one executor process on its own, for gateways started elsewhere.

The executor a gateway's ``--provider attach --executor-urls ...`` uses (a Kubernetes
StatefulSet pod, one per GPU): a fixed ``--port``, the internal token from
``$RETOUCH_EXECUTOR_TOKEN`` or ``--token-file``, and no tie to a parent process: it runs
until SIGTERM, whichever gateways come and go. It starts exactly as the executors the local
and Ray providers start (:func:`retouch.runtime.executor.main.run`, the same flags).
"""

from __future__ import annotations

import argparse

from retouch.runtime.executor.app import TOKEN_ENV
from retouch.runtime.executor.options import add_process_flags, check_process_flags


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "executor",
        help="run one executor for gateways started elsewhere (--provider attach)",
        description="Serves the executor API on --host:--port until SIGTERM (running "
        "invocations then fail over to the gateways' other executors). The internal token "
        f"comes from --token-file or ${TOKEN_ENV}; /healthz answers without it, for "
        "liveness probes.",
    )
    add_process_flags(p)
    p.set_defaults(run=_executor)


def _executor(args: argparse.Namespace) -> None:
    from retouch.runtime.executor.app import read_token

    check_process_flags(args)
    token = read_token(args.token_file)
    from retouch.runtime.executor.main import run  # torch: only once the flags are good

    run(args, token)
