"""``retouch serve``: the gateway (composed in ``platform/api/composition.py``) and its local
executors in one command, on its API and metrics ports."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn

from retouch.platform.api.composition import build_gateway
from retouch.platform.api.config import ServeConfig
from retouch.platform.api.limits import return_large_frees
from retouch.platform.fleet import children
from retouch.platform.fleet.forkedprocess import ForkedProcess, ZygoteRefused
from retouch.platform.fleet.tls import tls_context
from retouch.runtime.httpserver import SERVER_OPTIONS
from retouch.runtime.parentwatch import watch_parent

log = logging.getLogger(__name__)

# How long a gateway whose starter is gone gives its graceful shutdown (open requests,
# then its executors: SIGTERM, 10 s, SIGKILL) before it exits anyway; its executors, which
# watch it, then end too.
ORPHAN_GRACE_S = 30.0
# A fork server of ``retouch serve`` (its imports done) that ServerProcess starts gateways
# from: the tests set it (``tests/gatewayzygote.py``), as ~50 gateways' imports add up.
GATEWAY_ZYGOTE_ENV = "RETOUCH_GATEWAY_ZYGOTE"
CLI = "retouch.platform.cli.main"  # the module the zygote's gateways run


def serve(config: ServeConfig) -> None:
    """The gateway on its API port and, unless ``--metrics-port 0``, its metrics on theirs
    (that port is bound first: a port in use fails the command before anything starts)."""
    metrics_socket = listen(config.host, config.metrics_port) if config.metrics_port else None
    return_large_frees()  # freed images leave the process: the decode budget bounds its growth
    if config.exit_with_parent:
        watch_parent(config.exit_with_parent, stop_orphaned)
    gateway = build_gateway(config)
    api = uvicorn.Config(
        gateway.app(),
        host=config.host,
        port=config.port,
        log_level="warning",
        timeout_graceful_shutdown=10,
        **SERVER_OPTIONS,
    )
    metrics = None
    if metrics_socket is not None:
        metrics = MetricsListener(
            MetricsServer(
                uvicorn.Config(
                    gateway.metrics_app(),
                    lifespan="off",
                    log_level="warning",
                    timeout_graceful_shutdown=2,
                    **SERVER_OPTIONS,
                )
            ),
            metrics_socket,
        )
    GatewayServer(api, metrics).run()


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` for the metrics listener, or an error naming
    the flag (the CLI prints it as one line)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"cannot listen for metrics on {host}:{port} (--metrics-port): {exc.strerror}"
        ) from None
    return sock


class MetricsServer(uvicorn.Server):
    """uvicorn's server for the metrics listener. It takes no signals: the API's server
    has them, and stops this one (two servers taking turns at the handlers would leave a
    SIGTERM to whichever took them last)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class MetricsListener:
    """The metrics server and the socket it serves on."""

    server: MetricsServer
    socket: socket.socket
    task: asyncio.Task | None = None


class GatewayServer(uvicorn.Server):
    """uvicorn's server for the API, which runs the metrics listener beside it in its event
    loop (a scrape reads the pool's state where it lives): started once the API is up (the
    gateway started), stopped before the API's own shutdown."""

    def __init__(self, config: uvicorn.Config, metrics: MetricsListener | None) -> None:
        super().__init__(config)
        self.metrics = metrics

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.metrics is not None and self.started:
            listener = self.metrics
            listener.task = asyncio.create_task(listener.server.serve([listener.socket]))
            host, port = listener.socket.getsockname()[:2]
            log.info("metrics on http://%s:%d/metrics", host, port)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.metrics is not None and self.metrics.task is not None:
            self.metrics.server.should_exit = True
            await self.metrics.task
        await super().shutdown(sockets)


def stop_orphaned() -> None:
    """The process that started this gateway is gone: stop as on SIGTERM (uvicorn's
    graceful shutdown, whose lifespan stops the executors); exit if that hangs."""
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ORPHAN_GRACE_S)
    log.error("still running %.0f s after its starter ended; exiting", ORPHAN_GRACE_S)
    os._exit(1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gateway_zygote() -> Path | None:
    return Path(os.environ[GATEWAY_ZYGOTE_ENV]) if os.environ.get(GATEWAY_ZYGOTE_ENV) else None


@dataclass
class ServerProcess:
    """``retouch serve`` as a child process: used by ``retouch demo``, benchmarks and tests.
    It stops with this process: on SIGTERM or SIGINT (:mod:`retouch.platform.fleet.children`)
    and, watching it, when this process is killed (``--exit-with-parent``). Forked from a
    ``zygote``, it watches the zygote instead, and the zygote stops it when this process's
    connection closes."""

    data_dir: Path
    executors: int = 1
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    entry: str = CLI  # the CLI module (another checkout's may differ)
    zygote: Path | None = field(default_factory=_gateway_zygote)  # forked from it if it can
    process: subprocess.Popen | ForkedProcess | None = None

    def __post_init__(self) -> None:
        while self.metrics_port == self.port:  # two free ports, not the same one twice
            self.metrics_port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        """Where its metrics are scraped (the API port answers ``/metrics`` 404)."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, timeout: float = 180.0) -> ServerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = self._forked() or self._spawned()
        children.track(self.process)
        try:
            self._wait_ready(timeout)
        except BaseException:  # not ready, or this process is stopping: stop it too
            self.stop()
            raise
        return self

    def _args(self) -> list[str]:
        return [
            "serve", "--port", str(self.port), "--metrics-port", str(self.metrics_port),
            "--data-dir", str(self.data_dir), "--executors", str(self.executors),
            *self.extra_args,
        ]  # fmt: skip

    def _forked(self) -> ForkedProcess | None:
        """The gateway forked from ``zygote``, watching it (its parent); None where that
        cannot be (no zygote answers, another CLI ``entry``, torch's or the Hugging Face
        libraries' import-time variables differ from the zygote's)."""
        if self.zygote is None or self.entry != CLI:
            return None
        env, log_path = {**os.environ, **self.env}, self.data_dir / "gateway.log"
        try:
            return ForkedProcess.start(
                self.zygote, self._args(), env, log_path, parent_flag="--exit-with-parent"
            )
        except ZygoteRefused as exc:
            log.info("starting retouch serve afresh: %s", exc)
            return None

    def _spawned(self) -> subprocess.Popen:
        cmd = [
            sys.executable, "-m", self.entry, *self._args(),
            "--exit-with-parent", str(os.getpid()),
        ]  # fmt: skip
        with (self.data_dir / "gateway.log").open("ab") as log_file:
            return subprocess.Popen(
                cmd,
                env={**os.environ, **self.env},
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0, verify=tls_context()) as http:  # one client: see tls.py
            while time.monotonic() < deadline:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(
                        f"retouch serve exited with {self.process.returncode}; see {self.data_dir / 'gateway.log'}"
                    )
                try:
                    if http.get(f"{self.url}/readyz").status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet: poll again
                time.sleep(0.1)
        raise RuntimeError(
            f"retouch serve not ready after {timeout:.0f} s; see {self.data_dir / 'gateway.log'}"
        )

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (graceful: the gateway stops its executors), SIGKILL if it hangs."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except (subprocess.TimeoutExpired, TimeoutError):  # Popen's, ForkedProcess's
                self.process.kill()
                self.process.wait()
        children.forget(self.process)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
