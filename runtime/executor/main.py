"""Process entry point: ``python -m retouch.runtime.executor --name N --device D ...``.

The process owns: the uvicorn server (event loop thread), the core (engine thread, worker
pool, store; started and closed by the app's lifespan) and, for an executor a provider
started (``--exit-with-parent``), a parent-watch thread that ends the process when its
gateway dies. A standalone executor (``retouch executor``, the attach provider's) outlives
any gateway: several may use it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
from types import FrameType

import torch
import uvicorn

from retouch.cachestore.devicetier import DeviceTier
from retouch.cachestore.layout import store_path
from retouch.cachestore.store import ActivationStore, StoreConfig
from retouch.runtime import forkserver
from retouch.runtime.engine import Engine, EngineConfig, EngineMode
from retouch.runtime.executor.app import build_app, read_token
from retouch.runtime.executor.changes import ChangeFeed
from retouch.runtime.executor.core import ExecutorCore
from retouch.runtime.executor.options import (
    ExecutorOptions,
    add_process_flags,
    check_process_flags,
)
from retouch.runtime.executor.stages import WorkerStages
from retouch.runtime.httpserver import SERVER_OPTIONS
from retouch.runtime.models import ModelCache
from retouch.runtime.parentwatch import watch_parent
from retouch.runtime.reproducibility import make_deterministic
from retouch.runtime.startup import StartupReport
from retouch.runtime.templates import TemplateCache
from retouch.runtime.workers import PrePostPool

log = logging.getLogger(__name__)

DEBUG_HOOKS_ENV = "RETOUCH_DEBUG_HOOKS"  # "1": SIGUSR1 kills the engine loop (fault tests)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="retouch-executor")
    add_process_flags(parser)
    args = parser.parse_args(argv)
    try:
        check_process_flags(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def build_core(args: argparse.Namespace, startup: StartupReport) -> ExecutorCore:
    """The core, not started: the app's lifespan starts and closes it."""
    options: ExecutorOptions = args.options
    device = torch.device(args.device)
    with startup.timed("store"):
        store = ActivationStore(
            StoreConfig(path=store_path(args.data_dir), host_budget_bytes=options.host_cache_bytes)
        )
    shared = args.shared_dir or args.data_dir
    # On a CPU the steps and the pre/post workers are niced, the event loop that answers
    # the gateway is not: a request waits for no denoising step's time slice.
    nice = options.cpu_nice if device.type == "cpu" else 0
    engine_config = EngineConfig(
        EngineMode(options.engine),
        options.max_batch,
        disaggregated=not options.inline_prepost,
        nice=nice,
        # a CUDA graph holds one set's weights: with graphs, sets take turns
        mixed_adapters=options.adapter_batching == "mixed" and not options.cuda_graphs,
    )
    stages = None
    if not options.inline_prepost:
        pre, post = options.workers(options.threads or None)
        log.info("%d pre and %d post workers", pre, post)
        with startup.timed("workers"):
            pool = PrePostPool(
                shared / "models",
                device,
                pre=pre,
                post=post,
                threads=options.worker_threads,
                nice=nice,
            )
        stages = WorkerStages(pool)
    return ExecutorCore(
        args.name,
        # with pre workers, the text encoders are theirs alone (one copy on the device)
        ModelCache(
            shared / "models",
            device,
            without=() if stages is None else ("text_encoders",),
            startup=startup,
        ),
        TemplateCache(store, device_tier=device_tier(options, device)),
        Engine(engine_config, stages),
        stages,
        maskaware=options.maskaware,
        data_dir=shared,
        cuda_graphs=options.cuda_graphs,
        path_choice=options.path_choice,
        graph_budget_bytes=graph_budget(options, device),
        adapter_bytes=options.adapter_cache_bytes,
        adapter_build_share=options.adapter_build_share,
    )


def device_tier(options: ExecutorOptions, device: torch.device) -> DeviceTier | None:
    """The executor's device tier: ``device_cache_bytes``, or by default (-1) a quarter of
    the GPU's memory on CUDA and none on a CPU."""
    budget = options.device_cache_bytes
    if budget < 0:
        budget = (
            torch.cuda.get_device_properties(device).total_memory // 4
            if device.type == "cuda"
            else 0
        )
    return DeviceTier(device, budget) if budget > 0 else None


def graph_budget(options: ExecutorOptions, device: torch.device) -> int | None:
    """What CUDA graphs may hold: ``graph_memory_bytes``, by default (-1) a quarter of the
    GPU's memory on CUDA and no limit on a CPU (its "graphs" are bookkeeping); 0: none."""
    budget = options.graph_memory_bytes
    if budget < 0:
        if device.type != "cuda":
            return None
        budget = torch.cuda.get_device_properties(device).total_memory // 4
    return budget or None


def main(argv: list[str] | None = None) -> None:
    """``python -m retouch.runtime.executor``: the providers' child process."""
    args = parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("RETOUCH_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s",
    )
    try:
        token = read_token(args.token_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    run(args, token)


def run(args: argparse.Namespace, token: str) -> None:
    """Serve one executor until SIGTERM/SIGINT (then the app's lifespan closes the core:
    unfinished invocations fail with ``engine_unavailable``, which a gateway re-places).
    ``args``: parsed by :func:`~retouch.runtime.executor.options.add_process_flags` and
    checked; the one way an executor process starts, child or standalone."""
    startup = StartupReport()  # from the process's creation (a fork from the zygote: now)
    if args.options.deterministic:  # before anything computes or forks (MKL reads it then)
        make_deterministic()
    if torch.device(args.device).type == "cpu":
        forkserver.fork_from_here()  # before any thread starts (the parent watch is one)
    unwind_on_sigterm()  # after the fork server's fork: its workers keep their own
    if args.exit_with_parent is not None:
        watch_parent(args.exit_with_parent, _exit_orphaned)
    if args.options.threads > 0:
        torch.set_num_threads(args.options.threads)
    core = build_core(args, startup)
    if os.environ.get(DEBUG_HOOKS_ENV) == "1":
        signal.signal(signal.SIGUSR1, lambda *_: core.engine.inject_fault("SIGUSR1 debug hook"))
    # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose
    # proto says TCP, and without it every response waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    if args.port_file is not None:
        # Publish the port only once bound: the pool reads it, then polls /healthz.
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(str(sock.getsockname()[1]))
        tmp.replace(args.port_file)
    startup.since_birth("listening")
    log.info("executor %s on %s at %s:%d", args.name, args.device, *sock.getsockname()[:2])
    config = uvicorn.Config(
        build_app(core, token),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        **SERVER_OPTIONS,
    )
    ExecutorServer(config, core.changes).run(sockets=[sock])


class ExecutorServer(uvicorn.Server):
    """uvicorn's server that, on a shutdown signal, first answers the change feed's long
    polls: graceful shutdown waits for open requests, and a poll would hold it for the
    whole graceful timeout (measured: a 2-executor server took 7.2 s to stop, 0.4 s
    without the polls)."""

    def __init__(self, config: uvicorn.Config, changes: ChangeFeed) -> None:
        super().__init__(config)
        self._changes = changes

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._changes.close()
        super().handle_exit(sig, frame)


def unwind_on_sigterm() -> None:
    """SIGTERM unwinds the process (``SystemExit(143)``, a shell's status for it) rather
    than ending it where it stands. uvicorn re-raises the signal that stopped it once it
    has shut down gracefully; with the default action the process then died without its
    exit handlers (the pre/post pool's close, multiprocessing's temporary directory: one
    left in /tmp by every executor a gateway stopped). A handler a caller has set (the
    ``retouch`` command's) stays."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _unwind)


def _unwind(signum: int, frame: FrameType | None) -> None:
    # once: a second stop (a zygote's lifeline closing) must not cut the exit handlers
    # short; a stop that hangs is SIGKILLed by whoever stops it
    signal.signal(signum, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def _exit_orphaned() -> None:
    """Executors are children of one gateway: if it dies (even by SIGKILL), so do they."""
    os._exit(0)
