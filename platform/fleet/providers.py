"""Providers start and stop executor processes, behind one protocol (:class:`Provider`).

``LocalProvider`` (the embedded default) runs one executor process per GPU found with NVML,
or a number of CPU slots when there is no GPU. Each executor binds a free loopback port and
publishes it in a file; the provider waits for it and for ``/healthz`` before handing the
executor to the pool; it ends with its gateway (``--exit-with-parent``).
``platform/fleet/rayprovider.py`` runs each executor under a Ray actor.

``AttachProvider`` (``--provider attach --executor-urls ...``) starts nothing: its
executors run on their own (``retouch executor``, e.g. a Kubernetes StatefulSet), and
several gateways may share them. Its "devices" are their URLs; "starting" one waits until
it answers and reads its device from its state, "stopping" one only lets go of it, so the
fleet's restart of a dead one waits for its URL to answer again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import httpx

from retouch.functions.errors import RetouchError, Unavailable
from retouch.functions.wire.codec import unpack
from retouch.functions.wire.executor import ExecutorState
from retouch.platform.fleet.forkedprocess import ForkedProcess, ZygoteRefused
from retouch.platform.fleet.tls import tls_context
from retouch.runtime.asgi import MSGPACK
from retouch.runtime.executor.app import TOKEN_ENV

log = logging.getLogger(__name__)

# An executor process this gateway started: a fresh one, or one the zygote forked (Popen-like)
Child = subprocess.Popen | ForkedProcess

START_TIMEOUT_S = 120.0
ZYGOTE_ENV = "RETOUCH_EXECUTOR_ZYGOTE"  # a machine's executor zygote socket (``--executor-zygote``)


def gpu_devices() -> list[str]:
    """``cuda:<i>`` for every GPU the executors' torch will see: those that
    ``CUDA_VISIBLE_DEVICES`` names when it is set (empty or ``-1``: none, a CPU pool on a GPU
    machine), else every GPU NVML sees; empty when there is no driver or no GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        # torch renumbers the visible GPUs from 0 and stops at the first invalid entry ("-1").
        names = [v.strip() for v in visible.split(",") if v.strip()]
        count = next((i for i, v in enumerate(names) if v.startswith("-")), len(names))
        return [f"cuda:{i}" for i in range(count)] if count else []
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [f"cuda:{i}" for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver: a CPU machine
        return []


class Executor(Protocol):
    """A started executor as its provider hands it to the pool."""

    name: str
    device: str
    url: str

    @property
    def alive(self) -> bool: ...

    @property
    def exit_code(self) -> int | None: ...

    @property
    def node(self) -> str: ...


class Provider(Protocol):
    """What the pool needs to start and stop executors (and how many it may run)."""

    token: str
    # False: its executors run on their own (attach); a static fleet takes in those that
    # answer, and the others when they do, instead of failing to start
    owns_processes: bool

    def devices(self) -> list[str]: ...

    def threads_per_executor(self, count: int) -> int: ...

    async def start(self, name: str, device: str, threads: int) -> Executor: ...

    async def stop(self, executor: Executor, *, failed: bool = False) -> None:
        """Stop ``executor``; ``failed``: the pool saw it die (a provider may then avoid
        where it ran, before its own health checks tell it)."""
        ...


@dataclass
class ExecutorProcess:
    """An executor process on this machine."""

    name: str
    device: str
    url: str
    process: Child

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def exit_code(self) -> int | None:
        return self.process.returncode

    @property
    def node(self) -> str:
        return "local"


def one_gpu(device: str, env: dict[str, str]) -> tuple[dict[str, str], str]:
    """The environment and ``--device`` of an executor on ``device`` (``cuda:<i>`` as the
    gateway numbers its visible GPUs): the process sees only that GPU, as ``cuda:0``, so
    every thread, pinned registration and synchronisation of it and of its pre/post
    workers lands on its own GPU, never on GPU 0. A CPU device is passed as it is."""
    if not device.startswith("cuda"):
        return env, device
    index = int(device.partition(":")[2] or 0)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    names = [v.strip() for v in visible.split(",")] if visible else None
    physical = names[index] if names is not None else str(index)
    return {**env, "CUDA_VISIBLE_DEVICES": physical}, "cuda:0"


def start_executor_process(
    argv: list[str], env: dict[str, str], log_path: Path, zygote: Path | None, device: str
) -> Child:
    """An executor process with ``argv``: on a CPU, forked by the executor zygote at
    ``zygote`` when one is given and takes the request (it watches the zygote, which stops
    it when this process goes); else a fresh interpreter watching this process. Shared by
    the local provider and the Ray actors (a node's zygote: its ``RETOUCH_EXECUTOR_ZYGOTE``)."""
    if zygote is not None and device == "cpu":
        try:
            return ForkedProcess.start(zygote, [*argv, "--exit-with-parent", "0"], env, log_path)
        except ZygoteRefused as exc:
            log.warning("%s; starting a fresh executor process", exc)
    with log_path.open("ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "retouch.runtime.executor", *argv,
             "--exit-with-parent", str(os.getpid())],
            env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip


@dataclass
class LocalProvider:
    owns_processes: ClassVar[bool] = True
    data_dir: Path
    token: str
    cpu_slots: int = 1
    executor_args: tuple[str, ...] = ()  # passed to every executor process
    threads: int = 0  # torch threads per executor (0: the machine's cores shared out)
    zygote: Path | None = None  # an executor zygote's socket: CPU executors fork from it

    def devices(self) -> list[str]:
        gpus = gpu_devices()
        return gpus if gpus else ["cpu"] * self.cpu_slots

    def threads_per_executor(self, count: int) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // max(1, count))

    async def start(self, name: str, device: str, threads: int) -> ExecutorProcess:
        run_dir = self.data_dir / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        port_file = run_dir / f"{name}.port"
        port_file.unlink(missing_ok=True)
        log_path = run_dir / f"{name}.log"
        env, own_device = one_gpu(device, {**os.environ, TOKEN_ENV: self.token})
        argv = [
            "--name", name, "--device", own_device, "--data-dir", str(self.data_dir),
            "--port-file", str(port_file), "--threads", str(threads),
            *self.executor_args,
        ]  # fmt: skip
        proc = start_executor_process(argv, env, log_path, self.zygote, own_device)
        try:
            port = await self._wait_port(proc, port_file)
            url = f"http://127.0.0.1:{port}"
            await wait_healthy(url, self.token, lambda: proc.poll())
        except BaseException:
            self.stop_now(proc)
            raise
        log.info("executor %s on %s at %s (pid %d)", name, device, url, proc.pid)
        return ExecutorProcess(name, device, url, proc)

    async def stop(self, executor: Executor, *, failed: bool = False) -> None:
        assert isinstance(executor, ExecutorProcess)
        await asyncio.get_running_loop().run_in_executor(None, self.stop_now, executor.process)

    @staticmethod
    def stop_now(proc: Child) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except (subprocess.TimeoutExpired, TimeoutError):
                proc.kill()
                proc.wait()

    async def _wait_port(self, proc: subprocess.Popen, port_file: Path) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise Unavailable(
                    f"executor exited with code {proc.returncode} while starting (see {port_file.with_suffix('.log')})"
                )
            if port_file.exists():
                return int(port_file.read_text())
            await asyncio.sleep(0.05)
        raise Unavailable("executor did not start in time")


async def wait_healthy(url: str, token: str, exit_code: Callable[[], int | None]) -> None:
    """Poll ``url``'s ``/healthz`` until it answers 200; fail if the executor exits first
    (``exit_code`` not None) or after :data:`START_TIMEOUT_S`."""
    headers = {"authorization": f"Bearer {token}"}
    deadline = time.monotonic() + START_TIMEOUT_S
    async with httpx.AsyncClient(timeout=2.0, verify=tls_context()) as client:
        while time.monotonic() < deadline:
            code = exit_code()
            if code is not None:
                raise Unavailable(f"executor exited with code {code} while starting")
            try:
                if (await client.get(f"{url}/healthz", headers=headers)).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet: poll again
            await asyncio.sleep(0.05)
    raise Unavailable("executor did not become healthy in time")


@dataclass
class AttachedExecutor:
    """An executor started outside the gateway, at ``url``: no process here to watch, so
    it counts as alive and the fleet's probes of ``url`` judge its health."""

    name: str
    device: str  # as the executor reports it
    url: str
    host: str  # the executor's own name (its host name by default: the pod's)

    @property
    def alive(self) -> bool:
        return True

    @property
    def exit_code(self) -> int | None:
        return None

    @property
    def node(self) -> str:
        return self.host


@dataclass
class AttachProvider:
    """Executors already running at ``urls`` (one fleet member each), never started or
    stopped here; ``token`` is the internal token they were started with."""

    owns_processes: ClassVar[bool] = False
    urls: tuple[str, ...]
    token: str

    def devices(self) -> list[str]:
        return list(self.urls)

    def threads_per_executor(self, count: int) -> int:
        return 0  # the executor chose its own at its start

    async def start(self, name: str, device: str, threads: int) -> AttachedExecutor:
        """Wait until the executor at ``device`` (its URL) answers, and read what it runs on
        (raises :class:`Unavailable` after :data:`START_TIMEOUT_S`; the fleet retries)."""
        url = device.rstrip("/")
        await wait_healthy(url, self.token, lambda: None)
        headers = {
            "authorization": f"Bearer {self.token}",
            "content-type": MSGPACK,
            "accept": MSGPACK,
        }
        async with httpx.AsyncClient(timeout=10.0, verify=tls_context()) as client:
            try:
                resp = await client.get(f"{url}/state", headers=headers)
            except httpx.TransportError as exc:
                raise Unavailable(f"executor at {url} stopped answering: {exc!r}") from None
        try:
            if resp.status_code != 200:
                error = RetouchError.from_wire(resp.status_code, unpack(resp.content))
                raise Unavailable(
                    f"executor at {url} refused its state: {error.code}: {error.message}"
                    + (" (is it started with the same token?)" if resp.status_code == 401 else "")
                )
            state = ExecutorState.from_wire(unpack(resp.content))
        except (ValueError, TypeError, KeyError) as exc:  # not an executor's answer (a proxy?)
            raise Unavailable(
                f"executor at {url} answered {resp.status_code} with what is not its state: {exc}"
            ) from None
        log.info("executor %s (%s) on %s at %s, attached", name, state.name, state.device, url)
        return AttachedExecutor(name, state.device, url, state.name)

    async def stop(self, executor: Executor, *, failed: bool = False) -> None:
        """Nothing to stop: the executor belongs to whoever started it (other gateways may
        use it); the fleet only lets go of it."""
