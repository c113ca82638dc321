"""Server side: ``retouch serve`` (gateway and local executors) and ``retouch demo``."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from retouch.platform.commands.common import words
from retouch.platform.config import DEFAULT_PORT, ServeConfig

log = logging.getLogger("retouch")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the gateway and local executors")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help=f"port (default {DEFAULT_PORT})")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="registry, models, caches (default $RETOUCH_DATA_DIR or ~/.retouch)",
    )
    p.add_argument(
        "--executors", type=int, default=None, help="CPU executors when no GPU is found (default 1)"
    )
    p.add_argument(
        "--token-file", type=Path, default=None, help="lines of '<admin|invoke> <token>'"
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=None, help="payload limit (default 32 MiB)"
    )
    p.add_argument(
        "--placement",
        default=None,
        help="maskaware (default: predicted completion + template residency), or a baseline: "
        "least-requests, round-robin, least-masked-tokens, template-hash",
    )
    p.add_argument(
        "--no-admission",
        dest="admission",
        action="store_false",
        default=None,
        help="queue invocations predicted to miss their SLO instead of refusing them (429)",
    )
    p.add_argument(
        "--admission-dry-run",
        action="store_true",
        default=None,
        help="log what SLO admission would refuse, refuse nothing",
    )
    p.add_argument(
        "--host-cache-bytes",
        type=int,
        default=None,
        help="per-executor host-RAM budget of the activation store (default 4 GiB)",
    )
    p.add_argument(
        "--no-maskaware",
        dest="maskaware",
        action="store_false",
        default=None,
        help="compute every token, never read the cache (for comparisons)",
    )
    p.add_argument(
        "--engine",
        choices=("continuous", "static"),
        default=None,
        help="step-level continuous batching (default) or static batches (for comparisons)",
    )
    p.add_argument(
        "--max-batch", type=int, default=None, help="running batch limit per model (default 8)"
    )
    p.add_argument(
        "--inline-prepost",
        action="store_true",
        default=None,
        help="pre/post-processing on the engine thread (naive batching, for comparisons)",
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=None,
        help="invocations that may wait in the gateway before 429 overloaded (default 256)",
    )
    p.add_argument(
        "--max-queued-per-function",
        type=int,
        default=None,
        help="the same limit for each function (default 0: none of its own)",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=None,
        help="seconds an invocation may wait for an executor, e.g. during a restart (default 120)",
    )
    p.add_argument(
        "--invoke-timeout",
        type=float,
        default=None,
        help="seconds an invocation may take in all before 504 timeout (default 600)",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        default=None,
        help="executors an invocation may be sent to when one dies mid-run (default 3)",
    )
    p.add_argument(
        "--job-retention",
        type=float,
        default=None,
        help="seconds finished jobs and their results are kept (default 86400)",
    )
    p.add_argument(
        "--progress-interval",
        type=float,
        default=None,
        help="least seconds between a job's progress events (default 0.25; 0: every step)",
    )
    p.add_argument(
        "--webhook-allow",
        type=words,
        default=None,
        help="comma-separated hosts and IP networks webhooks may target "
        "(default 127.0.0.0/8,::1/128,localhost; secret: $RETOUCH_WEBHOOK_SECRET)",
    )
    p.set_defaults(run=_serve)

    p = sub.add_parser(
        "demo", help="start a platform, deploy the demo functions, invoke, write images"
    )
    p.add_argument("--out", type=Path, default=Path("retouch-demo"))
    p.add_argument(
        "--examples", type=Path, default=None, help="folder with tiny-sd.toml and tiny-flux.toml"
    )
    p.add_argument("--executors", type=int, default=1)
    p.set_defaults(run=_demo)


def _serve(args: argparse.Namespace) -> None:
    from retouch.platform.server import serve

    config = ServeConfig.from_env(
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        executors=args.executors,
        token_file=args.token_file,
        max_body_bytes=args.max_body_bytes,
        placement=args.placement,
        admission=args.admission,
        admission_dry_run=args.admission_dry_run,
        host_cache_bytes=args.host_cache_bytes,
        maskaware=args.maskaware,
        engine=args.engine,
        max_batch=args.max_batch,
        inline_prepost=args.inline_prepost,
        max_queued=args.max_queued,
        max_queued_per_function=args.max_queued_per_function,
        queue_timeout_s=args.queue_timeout,
        invoke_timeout_s=args.invoke_timeout,
        max_attempts=args.max_attempts,
        job_retention_s=args.job_retention,
        progress_interval_s=args.progress_interval,
        webhook_allow=args.webhook_allow,
    )
    log.info("serving on http://%s:%d (data dir %s)", config.host, config.port, config.data_dir)
    serve(config)


def _demo(args: argparse.Namespace) -> None:
    from retouch.platform.demo import run_demo

    run_demo(args.out, args.examples, args.executors)
