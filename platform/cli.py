"""The ``retouch`` command line.

Server side: ``serve``, ``demo``. Client side (``--url``, default ``$RETOUCH_URL`` or
http://127.0.0.1:8000; ``--token``, default ``$RETOUCH_TOKEN``): ``deploy``, ``ls``, ``rm``,
``invoke`` (``--async``: submit a job), ``jobs ls|watch|cancel``. A user error prints one line (``error: <code>: <message>``) and exits 1; no
traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from retouch.functions import wire
from retouch.functions.errors import RetouchError
from retouch.platform.client import Client
from retouch.platform.config import DEFAULT_PORT, ServeConfig, default_url

log = logging.getLogger("retouch")


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
        args.run(args)
    except RetouchError as exc:
        where = f" (field: {exc.field})" if exc.field else ""
        print(f"error: {exc.code}: {exc.message}{where}", file=sys.stderr)
        sys.exit(1)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="retouch", description="Serverless masked image editing.")
    sub = parser.add_subparsers(dest="command", required=True)

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
    p.add_argument("--placement", default=None, help="least-requests (default) or round-robin")
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
        type=_words,
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

    bench = sub.add_parser("bench", help="benchmarks (ratios measured side by side in one run)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    p = bench_sub.add_parser("gateway", help="the gateway's own time per invocation")
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--examples", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_bench_gateway)

    p = bench_sub.add_parser(
        "deploy",
        help="a served function's latency while a second model deploys and profiles (same run)",
    )
    p.add_argument(
        "--requests", type=int, default=12, help="undisturbed invocations before and after"
    )
    p.add_argument("--steps", type=int, default=10, help="denoising steps per invocation")
    p.add_argument("--examples", type=Path, default=None, help="folder of example specs")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_bench_deploy)

    p = bench_sub.add_parser(
        "engine", help="mask-aware vs stock diffusers edits, same model, same run"
    )
    p.add_argument("--model", default="retouch:small-flux")
    p.add_argument("--mask-ratios", type=_floats, default=[0.05, 0.1, 0.2, 0.35, 0.5, 1.0])
    p.add_argument("--batch", type=_ints, default=[1, 4])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--full-steps",
        type=int,
        default=0,
        help="warm-up steps of the mask-aware edits computed over every token",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or process CPU time (steadier on a shared machine)",
    )
    _add_models_dir(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_bench_engine)

    p = bench_sub.add_parser(
        "fidelity", help="mask-aware edits against the stock pipeline: PSNR, SSIM, unmasked PSNR"
    )
    p.add_argument("--model", default="retouch:small-sd")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument(
        "--full-steps", type=_ints, default=[0], help="warm-up steps to compare, e.g. 0,1,2"
    )
    p.add_argument("--mask-ratio", type=float, default=0.2)
    _add_models_dir(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_bench_fidelity)

    p = bench_sub.add_parser(
        "load", help="load generator comparing executor configurations in one run"
    )
    p.add_argument("--model", default="retouch:small-flux")
    p.add_argument(
        "--compare",
        default="continuous,static",
        help="configurations: +-joined tokens of continuous|static, maskaware|stock, disaggregated|naive",
    )
    p.add_argument(
        "--rate",
        default="auto:0.7",
        help="invocations/s, or auto:F = F x measured capacity of the first configuration",
    )
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--arrivals", choices=("poisson", "gamma"), default="poisson")
    p.add_argument(
        "--cv", type=float, default=1.0, help="coefficient of variation of gamma inter-arrivals"
    )
    p.add_argument(
        "--mask-mean",
        type=float,
        default=0.19,
        help="beta mean: 0.11 (production), 0.19 (public), 0.35 (VITON-HD)",
    )
    p.add_argument(
        "--mask-file",
        type=Path,
        default=None,
        help="mask ratios, one per line (instead of the beta)",
    )
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--templates", type=int, default=4)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="platform data dir reused by every configuration (default: a temporary one)",
    )
    p.add_argument("--plot", type=Path, default=None, help="write latency CDFs to this PNG")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_bench_load)

    p = bench_sub.add_parser(
        "plan", help="bubble-free plan vs naive sequential loading, whole edits, same run"
    )
    p.add_argument("--model", default="retouch:small-flux")
    p.add_argument("--mask-ratio", type=float, default=0.2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--link-gbps",
        type=float,
        default=None,
        help="emulate a host->device link of this bandwidth (GB/s) behind every row read",
    )
    _add_models_dir(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_bench_plan)

    p = bench_sub.add_parser(
        "edits",
        help="edit-success rate: does the masked region get the requested colour? (stock pipeline)",
    )
    p.add_argument(
        "--model", default="retouch:shapes-sd", help="retouch:shapes-sd or a diffusers folder"
    )
    p.add_argument(
        "--edits", type=int, default=50, help="number of edits (half recolour, half replace)"
    )
    p.add_argument("--steps", type=int, default=25, help="denoising steps per edit")
    p.add_argument("--guidance", type=float, default=5.0, help="classifier-free guidance scale")
    p.add_argument("--seed", type=int, default=0, help="selects the held-out scenes and noise")
    p.add_argument("--sheet", type=Path, default=None, help="write a PNG of every edit here")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    _add_models_dir(p)
    p.add_argument("--json", action="store_true", help="print JSON with every edit's row")
    p.set_defaults(run=_bench_edits)

    p = bench_sub.add_parser("store", help="activation store vs memcpy and raw disk reads")
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_bench_store)

    p = sub.add_parser(
        "train-demo",
        help="train the retouch:shapes-sd demo model on procedural shapes (resumable)",
        description="Train a small SD-style inpainting model (VAE, CLIP text encoder, 9-channel "
        "UNet) on the procedural shapes data set and export it as a diffusers folder in fp16. "
        "Checkpoints in --ckpt-dir let an interrupted run resume where it stopped.",
    )
    p.error = _one_line_error  # type: ignore[method-assign]
    p.add_argument(
        "--out",
        type=Path,
        default=Path("shapes-sd"),
        help="diffusers folder to export to (default ./shapes-sd)",
    )
    p.add_argument(
        "--ckpt-dir",
        type=Path,
        default=Path("train-demo-ckpt"),
        help="checkpoints and encoded latents; rerun with the same folder to resume",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of data, initialisation and noise")
    p.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when available, else CPU), cpu, cuda or cuda:N",
    )
    p.add_argument(
        "--threads", type=int, default=0, help="CPU threads for torch (default: torch's choice)"
    )
    p.add_argument("--vae-steps", type=int, default=1500, help="VAE training steps")
    p.add_argument("--vae-batch", type=int, default=16, help="VAE batch of 64 px crops")
    p.add_argument(
        "--samples",
        type=int,
        default=12000,
        help="(scene, mask) pairs encoded once for the UNet phase",
    )
    p.add_argument("--unet-steps", type=int, default=8000, help="UNet training steps")
    p.add_argument("--batch", type=int, default=32, help="UNet batch size")
    p.add_argument("--lr", type=float, default=4e-4, help="UNet and text encoder learning rate")
    p.add_argument(
        "--cond-dropout",
        type=float,
        default=0.1,
        help="fraction of captions replaced by the empty prompt (classifier-free guidance)",
    )
    p.add_argument(
        "--save-every", type=int, default=100, help="checkpoint every N steps of a phase"
    )
    p.add_argument(
        "--export-every",
        type=int,
        default=500,
        help="also export the EMA weights every N UNet steps (0: only at the end)",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="end the UNet phase after this much wall time, then export (0: no limit)",
    )
    p.add_argument(
        "--export-only",
        action="store_true",
        help="export the latest checkpoint without training further",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(run=_train_demo)

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
        p.add_argument("--json", action="store_true")
        p.set_defaults(run=_cache)

    p = _client(sub.add_parser("deploy", help="deploy a function from a TOML spec"))
    p.add_argument("spec", type=Path)
    p.add_argument(
        "--no-wait", action="store_true", help="return once stored, before executors load it"
    )
    p.add_argument(
        "--wait",
        choices=("baked", "ready"),
        default="baked",
        help="baked (default): until every template is baked, so first edits are mask-aware; "
        "ready: once executors have loaded it",
    )
    p.set_defaults(run=_deploy)

    p = _client(sub.add_parser("ls", help="list functions"))
    p.set_defaults(run=_ls)

    p = _client(sub.add_parser("rm", help="delete a function"))
    p.add_argument("name")
    p.set_defaults(run=_rm)

    p = _client(sub.add_parser("invoke", help="edit a template: paint the masked region"))
    p.add_argument("name")
    p.add_argument("--template", required=True)
    p.add_argument("--mask", type=Path, required=True, help="image file, nonzero = edit")
    p.add_argument("--prompt", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--format", choices=("png", "webp", "raw"), default="png")
    p.add_argument("-o", "--output", type=Path, default=Path("out.png"))
    p.add_argument(
        "--async",
        dest="as_job",
        action="store_true",
        help="submit a job and print its id at once (then: retouch jobs watch ID)",
    )
    p.add_argument("--webhook", default=None, help="with --async: URL told about the job")
    p.add_argument(
        "--webhook-events",
        type=_words,
        default=None,
        help="with --webhook: started,progress,completed (default completed)",
    )
    p.set_defaults(run=_invoke)

    jobs = sub.add_parser("jobs", help="async jobs: list, watch, cancel")
    jobs_sub = jobs.add_subparsers(dest="jobs", required=True)
    p = _client(jobs_sub.add_parser("ls", help="list jobs, newest first"))
    p.add_argument("--status", default=None, help="queued, running, succeeded, failed, canceled")
    p.add_argument("--function", default=None)
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_jobs_ls)
    p = _client(jobs_sub.add_parser("watch", help="follow a job with a progress bar"))
    p.add_argument("id")
    p.add_argument(
        "-o", "--output", type=Path, default=None, help="write the image here when it succeeds"
    )
    p.set_defaults(run=_jobs_watch)
    p = _client(jobs_sub.add_parser("cancel", help="cancel a queued or running job"))
    p.add_argument("id")
    p.set_defaults(run=_jobs_cancel)
    return parser


def _client(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--url", default=None, help="gateway URL (default $RETOUCH_URL or http://127.0.0.1:8000)"
    )
    p.add_argument(
        "--token",
        default=os.environ.get("RETOUCH_TOKEN"),
        help="bearer token (default $RETOUCH_TOKEN)",
    )
    return p


def _connect(args: argparse.Namespace) -> Client:
    return Client(args.url or default_url(), args.token)


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


def _bench_gateway(args: argparse.Namespace) -> None:
    from retouch.platform.bench.gateway import run_gateway_bench
    from retouch.platform.demo import find_examples

    _report(run_gateway_bench(find_examples(args.examples), args.requests), args.json)


def _bench_deploy(args: argparse.Namespace) -> None:
    from retouch.platform.bench.deploy import run_deploy_bench
    from retouch.platform.demo import find_examples

    if args.requests < 1 or args.steps < 1:
        raise ValueError("--requests and --steps must be >= 1")
    _report(run_deploy_bench(find_examples(args.examples), args.requests, args.steps), args.json)


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def _words(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.split(",") if w.strip())


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _add_models_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where demo models are built (default $RETOUCH_DATA_DIR)",
    )


def _models_dir(args: argparse.Namespace) -> Path:
    return (args.data_dir or ServeConfig.from_env().data_dir) / "models"


def _bench_engine(args: argparse.Namespace) -> None:
    from retouch.platform.bench.engine import run_engine_bench

    models_dir = _models_dir(args)
    rows = run_engine_bench(
        args.model,
        args.mask_ratios,
        args.batch,
        args.steps,
        args.repeats,
        models_dir,
        clock=args.clock,
        full_steps=args.full_steps,
    )
    if args.json:
        print(json.dumps(rows))
        return
    print(
        f"{'model':<20} {'mask':>6} {'batch':>6} {'stock s':>9} {'maskaware s':>12} {'ratio':>7} {'flop ratio':>11}"
    )
    for r in rows:
        print(
            f"{r['model']:<20} {r['mask_ratio']:>6.2f} {r['batch']:>6} {r['stock_s']:>9.3f} {r['maskaware_s']:>12.3f} {r['ratio']:>7.3f} {r['flop_ratio']:>11.3f}"
        )


def _bench_fidelity(args: argparse.Namespace) -> None:
    from retouch.platform.bench.fidelity import run_fidelity_bench

    rows = run_fidelity_bench(
        args.model, args.steps, args.full_steps, _models_dir(args), mask_ratio=args.mask_ratio
    )
    _report(rows, args.json)


def _bench_plan(args: argparse.Namespace) -> None:
    from retouch.platform.bench.plan import run_plan_bench

    models_dir = _models_dir(args)
    result = run_plan_bench(
        args.model,
        args.mask_ratio,
        args.batch,
        args.steps,
        args.repeats,
        models_dir,
        link_gbps=args.link_gbps,
    )
    _report(result, args.json)


def _bench_load(args: argparse.Namespace) -> None:
    import tempfile

    from retouch.platform.bench.load import LoadSpec, Workload, run_load_bench, table

    workload = Workload(
        args.requests,
        args.warmup,
        args.arrivals,
        args.cv,
        args.mask_mean,
        args.mask_file,
        args.zipf,
        args.seed,
    )
    spec = LoadSpec(
        args.model,
        [c for c in args.compare.split(",") if c],
        args.rate,
        workload,
        args.steps,
        args.templates,
        args.max_batch,
        plot=args.plot,
    )
    with tempfile.TemporaryDirectory(prefix="retouch-bench-load-") as tmp:
        result = run_load_bench(spec, args.data_dir or Path(tmp))
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"model {result['model']}, offered load {result['rate_rps']:.3f} invocations/s, {result['requests']} measured requests per configuration"
    )
    print(table(result["configs"]))


def _bench_edits(args: argparse.Namespace) -> None:
    if args.edits < 1 or args.steps < 1 or args.threads < 0:
        _one_line_error("--edits and --steps must be >= 1, --threads >= 0")
    import torch

    from retouch.platform.bench.edits import load_pipeline, run_edit_bench

    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.model, _models_dir(args))
    result = run_edit_bench(
        pipe, args.edits, steps=args.steps, guidance=args.guidance, seed=args.seed, sheet=args.sheet
    )
    if not args.json:
        result = {k: v for k, v in result.items() if k != "rows"}
    _report(result, args.json)


def _bench_store(args: argparse.Namespace) -> None:
    import tempfile

    from retouch.platform.bench.store import run_store_bench

    with tempfile.TemporaryDirectory(prefix="retouch-bench-store-") as tmp:
        _report(run_store_bench(Path(tmp), size_mb=args.size_mb, repeats=args.repeats), args.json)


def _one_line_error(message: str) -> None:
    """Bad ``train-demo`` options end with one line and exit status 2 (no usage dump)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _train_demo(args: argparse.Namespace) -> None:
    checks = (
        (args.vae_steps >= 0, "--vae-steps must be >= 0"),
        (args.unet_steps >= 0, "--unet-steps must be >= 0"),
        (args.vae_batch >= 1, "--vae-batch must be >= 1"),
        (args.batch >= 1, "--batch must be >= 1"),
        (args.samples >= 1, "--samples must be >= 1"),
        (args.threads >= 0, "--threads must be >= 0"),
        (args.lr > 0, "--lr must be > 0"),
        (0.0 <= args.cond_dropout < 1.0, "--cond-dropout must be in [0, 1)"),
        (args.save_every >= 1, "--save-every must be >= 1"),
        (args.export_every >= 0, "--export-every must be >= 0"),
        (args.max_minutes >= 0, "--max-minutes must be >= 0"),
        (
            args.device == "auto" or args.device == "cpu" or args.device.startswith("cuda"),
            f"--device must be auto, cpu or cuda[:N], not {args.device!r}",
        ),
    )
    for ok, message in checks:
        if not ok:
            _one_line_error(message)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            _one_line_error("--device cuda: no CUDA device is available")

    from retouch.functions.demo.train import TrainConfig, Trainer, train_demo

    config = TrainConfig(
        seed=args.seed,
        vae_steps=args.vae_steps,
        vae_batch=args.vae_batch,
        samples=args.samples,
        unet_steps=args.unet_steps,
        batch=args.batch,
        lr=args.lr,
        cond_dropout=args.cond_dropout,
        save_every=args.save_every,
        export_every=args.export_every,
        max_minutes=args.max_minutes,
    )
    if args.export_only:
        if not (args.ckpt_dir / "state.pt").exists():
            _one_line_error(f"--export-only: no checkpoint in {args.ckpt_dir}")
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        trainer = Trainer(config, args.ckpt_dir, args.out, torch.device("cpu"), progress=False)
        trainer.export()
        _report(trainer.summary(), False)
        return
    summary = train_demo(
        config,
        args.ckpt_dir,
        args.out,
        device=args.device,
        threads=args.threads,
        progress=not args.no_progress,
    )
    _report(summary, False)


def _cache(args: argparse.Namespace) -> None:
    from retouch.platform.cachecli import run_cache_command

    data_dir = args.data_dir or ServeConfig.from_env().data_dir
    result = run_cache_command(args.cache, data_dir)
    if args.json or args.cache != "ls":
        _report(result, args.json)
        return
    print(f"{'KEY':<34} {'TIER':<5} {'MB':>9} {'FUNCTION':<16} {'TEMPLATE':<12} VALID")
    for row in result:
        meta = row["meta"]
        print(
            f"{row['key']:<34} {row['tier']:<5} {row['bytes'] / 1e6:>9.1f} {meta.get('function', ''):<16} {meta.get('template', ''):<12} {'yes' if row['valid'] else 'no: ' + row['reason']}"
        )


def _report(result: object, as_json: bool) -> None:
    """Benchmarks print JSON with ``--json``, an indented summary otherwise."""
    print(json.dumps(result) if as_json else json.dumps(result, indent=2))


def _deploy(args: argparse.Namespace) -> None:
    with _connect(args) as client:
        doc = client.deploy_file(args.spec, wait=not args.no_wait)
        baking = ""
        if not args.no_wait and args.wait == "baked" and doc["status"] == "ready":
            tty = sys.stderr.isatty()

            def progress(baked: int, total: int) -> None:
                line = f"baking templates {_bar(baked / max(1, total))} {baked}/{total}"
                print(line, end="\r" if tty else "\n", file=sys.stderr)

            doc = client.wait_baked(doc["name"], on_progress=progress)
            if tty:
                print(file=sys.stderr)
            states = [t["state"] for t in doc["templates"].values()]
            baking = f", {states.count('baked')}/{len(states)} templates baked"
    error = f" ({doc['error']})" if doc.get("error") else ""
    print(f"{doc['name']}: {doc['status']}{baking}{error}")
    if doc["status"] == "failed":
        sys.exit(1)


def _ls(args: argparse.Namespace) -> None:
    with _connect(args) as client:
        functions = client.list()
    print(f"{'NAME':<20} {'STATUS':<10} {'FAMILY':<13} {'MODEL':<28} {'TEMPLATES':<24} STATES")
    for f in functions:
        states = ",".join(t["state"] for t in f["templates"].values())
        print(
            f"{f['name']:<20} {f['status']:<10} {f['family']:<13} {f['model']:<28} {','.join(f['templates']):<24} {states}"
        )


def _rm(args: argparse.Namespace) -> None:
    with _connect(args) as client:
        client.delete(args.name)
    print(f"deleted {args.name}")


def _invoke(args: argparse.Namespace) -> None:
    try:
        mask = args.mask.read_bytes()
    except OSError as exc:
        raise RetouchError(
            f"cannot read mask {args.mask}: {exc.strerror}", field="mask", code="invalid_argument"
        ) from exc
    options = {"steps": args.steps, "guidance": args.guidance, "format": args.format}
    if args.as_job:
        options |= {"webhook": args.webhook, "webhook_events": args.webhook_events}
        with _connect(args) as client:
            job = client.submit(
                args.name,
                args.template,
                mask,
                args.prompt,
                args.seed,
                **{k: v for k, v in options.items() if v is not None},
            )
        position = job.doc.get("queue_position")
        where = f" (queue position {position})" if position is not None else ""
        print(f"{job.id} {job.doc['status']}{where}")
        return
    if args.webhook is not None:
        raise RetouchError("--webhook needs --async", field="webhook", code="invalid_argument")
    with _connect(args) as client:
        result = client.invoke(
            args.name,
            args.template,
            mask,
            args.prompt,
            args.seed,
            **{k: v for k, v in options.items() if v is not None},
        )
    args.output.write_bytes(result.image)  # already encoded in the requested format
    t = result.timings
    print(
        f"{args.output}: {result.width}x{result.height} mask_ratio={result.mask_ratio:.3f} path={result.path} executor={result.executor} total={t.total_ms:.0f}ms run={t.run_ms:.0f}ms queue={t.queue_ms:.0f}ms"
    )


def _jobs_ls(args: argparse.Namespace) -> None:
    with _connect(args) as client:
        jobs = client.jobs(args.status, args.function, args.limit)
    if args.json:
        print(json.dumps(jobs))
        return
    print(f"{'ID':<34} {'STATUS':<10} {'FUNCTION':<16} {'CREATED':<25} DETAIL")
    for job in jobs:
        detail = ""
        if job["status"] == "queued":
            detail = f"position {job.get('queue_position')}"
        elif job["status"] == "running" and job.get("progress"):
            detail = f"step {job['progress']['step']}/{job['progress']['total']}"
        elif job.get("error"):
            detail = f"{job['error']['code']}: {job['error']['message']}"
        elif job.get("result"):
            detail = (
                f"path={job['result']['path']} total={job['result']['timings']['total_ms']:.0f}ms"
            )
        print(
            f"{job['id']:<34} {job['status']:<10} {job['function']:<16} {job['created_at']:<25} {detail}"
        )


def _bar(fraction: float, width: int = 30) -> str:
    done = round(fraction * width)
    return "[" + "#" * done + "." * (width - done) + "]"


def _jobs_watch(args: argparse.Namespace) -> None:
    """Follow the job's events: queue position, then a step progress bar (on stderr)."""
    tty = sys.stderr.isatty()
    end = "\r" if tty else "\n"
    with _connect(args) as client:
        job = client.job(args.id)
        for event in job.events():
            data = event.data
            if event.kind is wire.JobEventKind.QUEUED and data.get("position") is not None:
                print(f"queued, position {data['position']}", end=end, file=sys.stderr)
            elif event.kind is wire.JobEventKind.STARTED:
                print(f"started on {data['executor']}" + " " * 20, end=end, file=sys.stderr)
            elif event.kind is wire.JobEventKind.PROGRESS:
                eta = f" eta {data['eta_s']:.1f}s" if data.get("eta_s") is not None else ""
                line = f"{_bar(data['fraction'])} {data['step']}/{data['total']}{eta}"
                print(line + " " * 10, end=end, file=sys.stderr)
        if tty:
            print(file=sys.stderr)
        job.status()
        status = job.doc["status"]
        if status != "succeeded":
            error = job.doc.get("error") or {}
            message = f": {error.get('code')}: {error.get('message')}" if error else ""
            print(f"{job.id} {status}{message}")
            sys.exit(1)
        result = job.wait()
    if args.output is not None:
        args.output.write_bytes(result.image)
    out = f" -> {args.output}" if args.output is not None else ""
    print(
        f"{job.id} succeeded{out}: {result.width}x{result.height} path={result.path} total={result.timings.total_ms:.0f}ms"
    )


def _jobs_cancel(args: argparse.Namespace) -> None:
    with _connect(args) as client:
        doc = client.job(args.id).cancel()
    print(f"{doc['id']} {doc['status']}")


if __name__ == "__main__":
    main()
