"""Providers start and stop executor processes.

``LocalProvider`` (the embedded default) runs one executor process per GPU found with NVML,
or a number of CPU slots when there is no GPU. Each executor binds a free loopback port and
publishes it in a file; the provider waits for it and for ``/healthz`` before handing the
executor to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from retouch.functions.errors import Unavailable
from retouch.runtime.executor.app import TOKEN_ENV

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0


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


@dataclass
class ExecutorProcess:
    name: str
    device: str
    url: str
    process: subprocess.Popen

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class LocalProvider:
    data_dir: Path
    token: str
    cpu_slots: int = 1
    executor_args: tuple[str, ...] = ()  # passed to every executor process
    threads: int = 0  # torch threads per executor (0: the machine's cores shared out)

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
        log_file = (run_dir / f"{name}.log").open("ab")
        cmd = [
            sys.executable, "-m", "retouch.runtime.executor",
            "--name", name, "--device", device, "--data-dir", str(self.data_dir),
            "--port-file", str(port_file), "--threads", str(threads), *self.executor_args,
        ]  # fmt: skip
        env = {**os.environ, TOKEN_ENV: self.token}
        proc = subprocess.Popen(
            cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log_file.close()
        try:
            port = await self._wait_port(proc, port_file)
            url = f"http://127.0.0.1:{port}"
            await self._wait_healthy(proc, url)
        except BaseException:
            self.stop_now(proc)
            raise
        log.info("executor %s on %s at %s (pid %d)", name, device, url, proc.pid)
        return ExecutorProcess(name, device, url, proc)

    async def stop(self, executor: ExecutorProcess) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.stop_now, executor.process)

    @staticmethod
    def stop_now(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
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

    async def _wait_healthy(self, proc: subprocess.Popen, url: str) -> None:
        headers = {"authorization": f"Bearer {self.token}"}
        deadline = time.monotonic() + START_TIMEOUT_S
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise Unavailable(f"executor exited with code {proc.returncode} while starting")
                try:
                    if (await client.get(f"{url}/healthz", headers=headers)).status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet: poll again
                await asyncio.sleep(0.05)
        raise Unavailable("executor did not become healthy in time")
