"""``retouch executor`` processes for the tests: executors started on their own, on
fixed loopback ports, that gateways attach to (``--provider attach``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from retouch.functions.wire.codec import unpack
from retouch.functions.wire.executor import ExecutorState
from retouch.platform.api.server import free_port
from retouch.platform.fleet.forkedprocess import ForkedProcess
from retouch.platform.fleet.tls import tls_context
from retouch.runtime.executor.app import TOKEN_ENV
from tests.support import reap, wait_for

TOKEN = "attach-test-executor-token"
AUTH = {"authorization": f"Bearer {TOKEN}", "content-type": "application/msgpack"}


@dataclass
class Executor:
    """One ``retouch executor`` process on a fixed port (restartable on the same port)."""

    name: str
    port: int
    data_dir: Path
    shared_dir: Path
    process: subprocess.Popen | ForkedProcess | None = None
    args: tuple[str, ...] = ()  # more flags
    env: Mapping[str, str] | None = None  # its environment (default: this process's)
    # An executor zygote's socket: the executor is forked from it (the flags and code of the
    # `retouch executor` command, the imports skipped) instead of run as that command.
    zygote: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Executor:
        flags = [
            "--name", self.name, "--port", str(self.port), "--data-dir", str(self.data_dir),
            "--shared-dir", str(self.shared_dir), "--max-batch", "1", "--threads", "1",
            *self.args,
        ]  # fmt: skip
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {**(os.environ if self.env is None else self.env), TOKEN_ENV: TOKEN}
        log_path = self.data_dir / "executor.log"
        if self.zygote is not None:  # the executor `retouch executor` runs, imports done
            self.process = ForkedProcess.start(
                self.zygote, [*flags, "--exit-with-parent", "0"], env, log_path
            )
            return self
        cmd = [sys.executable, "-m", "retouch.platform.cli.main", "executor", *flags]
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        return self

    def wait_healthy(self) -> None:
        def healthy() -> bool:
            assert self.process is not None and self.process.poll() is None, self.log()
            try:
                return (
                    httpx.get(f"{self.url}/healthz", timeout=2, verify=tls_context()).status_code
                    == 200
                )
            except httpx.TransportError:
                return False

        wait_for(f"executor {self.name} healthy", healthy)

    def state(self) -> ExecutorState:
        resp = httpx.get(f"{self.url}/state", headers=AUTH, timeout=5, verify=tls_context())
        return ExecutorState.from_wire(unpack(resp.content))

    def log(self) -> str:
        return (self.data_dir / "executor.log").read_text()[-3000:]

    def stop(self) -> int:
        """SIGTERM; the exit status (SIGKILL and -9 if it hangs)."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            reap(self.process)
        return self.process.returncode


@contextmanager
def running(
    base: Path, prefix: str, shared_dir: Path, count: int = 2, **options: Any
) -> Iterator[list[Executor]]:
    """``count`` healthy executors on free ports (``options``: more :class:`Executor`
    fields, the same for each), stopped on the way out."""
    with running_each(base, prefix, shared_dir, [options] * count) as started:
        yield started


@contextmanager
def running_each(
    base: Path, prefix: str, shared_dir: Path, options: list[dict[str, Any]]
) -> Iterator[list[Executor]]:
    """A healthy executor on a free port for each of ``options`` (its more
    :class:`Executor` fields), stopped on the way out."""
    started = [
        Executor(f"{prefix}-{i}", free_port(), base / f"exec-{i}", shared_dir, **more).start()
        for i, more in enumerate(options)
    ]
    try:
        for e in started:
            e.wait_healthy()
        yield started
    finally:
        for e in started:
            e.stop()
