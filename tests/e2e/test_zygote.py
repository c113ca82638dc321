"""Executors forked by the executor zygote (``runtime/executor/zygote.py``): a server's CPU
executors start from it, its gateway learns their exit codes through it, they end with
their gateway or their zygote, and a request it cannot fork starts a fresh process. The
tests' gateways fork from a zygote of their own the same way (``tests/gatewayzygote.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from retouch.platform.api.client import Client
from retouch.platform.api.server import ServerProcess
from retouch.platform.fleet.forkedprocess import ForkedProcess, ZygoteRefused
from retouch.platform.lab.bench.load import wait_baked
from retouch.runtime.executor.app import TOKEN_ENV
from tests.support import REPO, wait_for


def _ready(zygote: Path, folder: Path | None = None) -> ForkedProcess:
    """An executor forked by ``zygote`` once it has imported (it refuses until then),
    serving from ``folder``."""
    argv_env = _executor_request(folder or zygote.parent / f"exec-{time.monotonic_ns()}")
    refusals: list[str] = []

    def fork() -> ForkedProcess | None:
        try:
            return ForkedProcess.start(zygote, *argv_env)
        except ZygoteRefused as exc:
            refusals[:] = [str(exc)]
            return None

    return wait_for("the zygote to fork an executor", fork, timeout=120, detail=lambda: refusals)


def _executor_request(folder: Path) -> tuple[list[str], dict[str, str], Path]:
    folder.mkdir(parents=True)
    argv = [
        "--name", "z0", "--device", "cpu", "--data-dir", str(folder),
        "--port-file", str(folder / "port"), "--threads", "1", "--exit-with-parent", "0",
    ]  # fmt: skip
    return argv, {**os.environ, TOKEN_ENV: "secret"}, folder / "executor.log"


def _is_zygote(pid: int) -> bool:
    return "retouch.runtime.executor.zygote" in " ".join(psutil.Process(pid).cmdline())


def test_a_servers_executors_fork_from_the_zygote_and_end_with_it(
    tmp_path: Path, examples: Path
) -> None:
    mask = np.zeros((128, 128), bool)
    mask[30:90, 20:100] = True
    _ready(Path(os.environ["RETOUCH_EXECUTOR_ZYGOTE"])).kill()  # the zygote has imported
    server = ServerProcess(tmp_path / "data")
    server.__enter__()
    try:
        with Client(server.url) as client:
            pid = client.executors()["executors"][0]["state"]["pid"]
            assert _is_zygote(psutil.Process(pid).ppid())  # forked, not started afresh
            client.deploy_file(examples / "tiny-sd.toml")
            wait_baked(client, "tiny-sd")
            assert client.invoke("tiny-sd", "street", mask, "a lamp", seed=1).image
            _reports_its_start_by_phase(client.executors()["executors"][0]["state"], server)
    finally:
        os.kill(server.process.pid, signal.SIGKILL)  # no clean-up runs in the gateway
        server.process.wait()
    # its connection to the zygote closed with it: the zygote stops its executor
    wait_for("the executor to end with its gateway", lambda: not _alive(pid), timeout=30)


def _reports_its_start_by_phase(state: dict, server: ServerProcess) -> None:
    """The executor's cold start, phase by phase (``runtime/startup.py``), in its state
    and in the gateway's metrics; the model's phases once its first edit is done."""
    phases = state["startup_ms"]
    assert {"process", "store", "workers", "listening", "first_edit"} <= phases.keys()
    assert phases["process"] <= phases["listening"] <= phases["first_edit"]
    [model] = state["model_startup_ms"].values()
    assert {"weights", "profile", "graphs"} <= model.keys() and model["weights"] > 0
    metrics = httpx.get(server.metrics_url).text
    assert (
        f'retouch_executor_startup_seconds{{executor="{state["name"]}",model="",phase="process"}}'
        in metrics
    )


def test_the_gateway_learns_an_executors_exit_code(tmp_path: Path) -> None:
    zygote = Path(os.environ["RETOUCH_EXECUTOR_ZYGOTE"])
    executor = _ready(zygote)
    assert executor.poll() is None and _is_zygote(psutil.Process(executor.pid).ppid())
    os.kill(executor.pid, signal.SIGKILL)
    assert executor.wait(timeout=30) == -signal.SIGKILL
    argv, env, log = _executor_request(tmp_path / "bad")
    bad = ForkedProcess.start(zygote, [*argv, "--no-such-flag"], env, log)
    assert bad.wait(timeout=30) == 2  # argparse's usage error, as a fresh process exits
    assert "--no-such-flag" in log.read_text()  # its stderr went to its log


def test_other_import_time_variables_are_refused_and_start_afresh(tmp_path: Path) -> None:
    zygote = Path(os.environ["RETOUCH_EXECUTOR_ZYGOTE"])
    _ready(zygote).kill()
    argv, env, log = _executor_request(tmp_path / "other")
    # a variable read on each use, as Ray's driver sets in its process, is no refusal
    read_on_use = {**env, "PYTHONBREAKPOINT": "ray.util.rpdb._driver_set_trace"}
    ForkedProcess.start(zygote, argv, read_on_use, log).kill()
    other = {**env, "ATEN_CPU_CAPABILITY": "default" if env.get("ATEN_CPU_CAPABILITY") else "avx2"}
    with pytest.raises(ZygoteRefused, match="ATEN_CPU_CAPABILITY"):
        ForkedProcess.start(zygote, argv, other, log)
    # a server with such a variable starts its executor as a fresh process of its own
    with ServerProcess(
        tmp_path / "data", env={"ATEN_CPU_CAPABILITY": other["ATEN_CPU_CAPABILITY"]}
    ) as server:
        with Client(server.url) as client:
            pid = client.executors()["executors"][0]["state"]["pid"]
        assert psutil.Process(pid).ppid() == server.process.pid


def test_executors_stop_when_their_zygote_dies(tmp_path: Path) -> None:
    socket_path = tmp_path / "own.sock"
    zygote = subprocess.Popen(
        [sys.executable, "-m", "retouch.runtime.executor.zygote", "--socket", str(socket_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        executor = _ready(socket_path, tmp_path / "executor")
        wait_for("the executor to serve", (tmp_path / "executor" / "port").exists, timeout=60)
        zygote.kill()
        zygote.wait()
        # its parent is gone: it stops by itself, and its handle reports an end
        assert executor.wait(timeout=30) in (-signal.SIGTERM, -signal.SIGKILL)
        wait_for("the executor to stop", lambda: not _alive(executor.pid), timeout=30)
    finally:
        if zygote.poll() is None:
            zygote.kill()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _temp_dir(executor_pid: int) -> Path:
    """The executor's multiprocessing temporary directory: where its worker fork server
    (a child of the executor) listens."""

    def listening() -> Path | None:
        for child in psutil.Process(executor_pid).children():
            for conn in child.net_connections(kind="unix"):
                if conn.laddr and Path(conn.laddr).name.startswith("listener-"):
                    return Path(conn.laddr).parent
        return None

    return wait_for("the executor's worker fork server", listening, timeout=60)


@pytest.mark.parametrize("start", ["forked", "fresh"])
def test_a_stopped_executor_runs_its_exit_handlers(tmp_path: Path, start: str) -> None:
    """SIGTERM (how a gateway stops its executors) ends a graceful shutdown with the
    process's exit handlers, forked or fresh: status 143, as a shell reports it, and no
    temporary directory left in /tmp (uvicorn re-raises the signal after its shutdown)."""
    if start == "forked":
        executor: ForkedProcess | subprocess.Popen = _ready(
            Path(os.environ["RETOUCH_EXECUTOR_ZYGOTE"]), tmp_path / "executor"
        )
    else:
        argv, env, log = _executor_request(tmp_path / "executor")
        with log.open("ab") as out:
            executor = subprocess.Popen(
                [sys.executable, "-m", "retouch.runtime.executor", *argv],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
    try:
        wait_for("the executor to serve", (tmp_path / "executor" / "port").exists, timeout=120)
        temp = _temp_dir(executor.pid)
        assert temp.is_dir()
        executor.terminate()
        assert executor.wait(timeout=30) == 128 + signal.SIGTERM
        assert not temp.exists()
    finally:
        if executor.poll() is None:
            executor.kill()


def test_one_handle_waited_on_and_stopped_from_two_threads(tmp_path: Path) -> None:
    """A Ray actor's threads: one waits on its executor for good, another stops it; both
    learn the exit, and the stopping thread's polls never wait for the other's read."""
    executor = _ready(Path(os.environ["RETOUCH_EXECUTOR_ZYGOTE"]), tmp_path / "executor")
    try:
        wait_for("the executor to serve", (tmp_path / "executor" / "port").exists, timeout=120)
        with ThreadPoolExecutor(1) as waiter:
            waited = waiter.submit(executor.wait)
            time.sleep(1.0)  # the waiter is inside its blocking read
            started = time.monotonic()
            assert executor.poll() is None
            assert time.monotonic() - started < 0.1
            executor.terminate()
            assert executor.wait(timeout=30) == 128 + signal.SIGTERM
            assert waited.result(timeout=5) == 128 + signal.SIGTERM
    finally:
        if executor.poll() is None:
            executor.kill()


def test_a_server_process_forks_its_gateway_from_a_gateway_zygote_or_starts_it_afresh(
    tmp_path: Path, zygotes: dict[str, Path]
) -> None:
    """ServerProcess forks ``retouch serve`` from the zygote ``RETOUCH_GATEWAY_ZYGOTE`` names
    (the tests' gateways: ``tests/gatewayzygote.py``): the same command in a process of its
    own, answering and stopping as a fresh one does; a socket that does not answer starts
    it afresh."""
    socket_path = zygotes["RETOUCH_GATEWAY_ZYGOTE"]
    zygote_pid = int((socket_path.parent / "ready").read_text())
    codes = {}
    for start, zygote in (("forked", socket_path), ("fresh", tmp_path / "none.sock")):
        server = ServerProcess(tmp_path / start, zygote=zygote, extra_args=["--autoscale"])
        with server, Client(server.url) as client:
            assert client.executors()["executors"] == []
            parent = psutil.Process(server.process.pid).ppid()
            assert (parent == zygote_pid) == (start == "forked"), start
            assert isinstance(server.process, ForkedProcess) == (start == "forked")
        codes[start] = server.process.returncode
    # SIGTERM: a graceful stop, its status as a shell reports it
    assert codes["forked"] == codes["fresh"] == 128 + signal.SIGTERM, codes


STARTER = """
import sys, time
from pathlib import Path
from retouch.platform.api.server import ServerProcess
server = ServerProcess(Path(sys.argv[1]), zygote=Path(sys.argv[2]), extra_args=["--autoscale"])
Path(sys.argv[3]).write_text(str(server.start().process.pid))
time.sleep(600)
"""


def test_a_forked_gateway_stops_with_its_starter_and_with_its_zygote(tmp_path: Path) -> None:
    """What a fresh gateway's ``--exit-with-parent PID`` gives, a forked one gets from its
    zygote: a starter killed (no clean-up runs in it) closes its connection and the zygote
    stops its gateway; a zygote killed leaves its gateways without their parent, and they
    stop by themselves."""
    socket_path, ready = tmp_path / "gateways.sock", tmp_path / "ready"
    zygote = subprocess.Popen(
        [sys.executable, "-m", "tests.gatewayzygote", "--socket", str(socket_path),
         "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
    )  # fmt: skip
    try:
        wait_for("the gateway zygote's imports", ready.exists, timeout=60)
        pid_file = tmp_path / "gateway.pid"
        starter = subprocess.Popen(
            [sys.executable, "-c", STARTER, str(tmp_path / "a"), str(socket_path), str(pid_file)]
        )
        wait_for("the starter's gateway", pid_file.exists, timeout=60)
        gateway = int(pid_file.read_text())
        assert psutil.Process(gateway).ppid() == zygote.pid
        starter.kill()
        starter.wait()
        wait_for("the gateway to end with its starter", lambda: not _alive(gateway), timeout=30)
        server = ServerProcess(tmp_path / "b", zygote=socket_path, extra_args=["--autoscale"])
        server.start()
        assert isinstance(server.process, ForkedProcess)
        zygote.kill()
        zygote.wait()
        assert server.process.wait(timeout=30) is not None  # its handle learns the end
        wait_for("the gateway to end with its zygote", lambda: not _alive(server.process.pid))
    finally:
        if zygote.poll() is None:
            zygote.kill()
