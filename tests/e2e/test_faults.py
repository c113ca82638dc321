"""Nothing accepted is lost and nothing hangs (real processes on loopback).

A server with two executors: eight invocations are in flight when one executor is
SIGKILLed, its pre or post worker is SIGKILLed, or its engine thread dies (a test hook:
SIGUSR1 with RETOUCH_DEBUG_HOOKS=1); every one is answered 200 with the image an
undisturbed run gives, and invocations that arrive during the executor's restart are
answered too (they wait in the gateway queue or go to the other executor).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from retouch.functions.wire import InvokeResult
from retouch.platform.client import Client
from retouch.platform.server import ServerProcess
from tests.support import wait_for

pytestmark = pytest.mark.slow

FUNCTION, TEMPLATE = "tiny-sd", "street"
STEPS = 8  # not the spec's 10: the stock path, independent of bake timing
IN_FLIGHT = 8
LATE = 2  # invocations sent while the executor restarts
MASK = np.zeros((128, 128), bool)
MASK[24:88, 16:80] = True
# Images of a request batched with others differ from its solo run by float rounding only.
MAX_PIXEL_DIFF = 3


def invoke(url: str, seed: int) -> InvokeResult:
    with Client(url, timeout=None) as client:
        return client.invoke(
            FUNCTION, TEMPLATE, MASK, "a red door", seed=seed, steps=STEPS, format="raw"
        )


def pixels(result: InvokeResult) -> np.ndarray:
    return np.frombuffer(result.image, np.uint8).reshape(result.height, result.width, 3)


def executor_state(client: Client, index: int = 0) -> dict:
    return client.executors()["executors"][index]


def busy(client: Client, index: int = 0) -> bool:
    state = executor_state(client, index).get("state") or {}
    engine = state.get("engine") or {}
    return engine.get("running", 0) >= 1


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, examples: Path) -> Iterator[ServerProcess]:
    data = tmp_path_factory.mktemp("faults")
    env = {"RETOUCH_DEBUG_HOOKS": "1"}
    with ServerProcess(data, executors=2, env=env, extra_args=["--max-batch", "4"]) as proc:
        with Client(proc.url) as client:
            client.deploy_file(examples / "tiny-sd.toml")
        yield proc


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> dict[int, np.ndarray]:
    """Each seed's image from an undisturbed run, one at a time."""
    seeds = [*range(IN_FLIGHT), *range(100, 100 + LATE)]
    return {seed: pixels(invoke(server.url, seed)) for seed in seeds}


def run_with_fault(
    url: str, reference: dict[int, np.ndarray], fault: Callable[[Client], None], index: int = 0
) -> list[InvokeResult]:
    """Start 8 invocations, inject ``fault`` once the engine runs some of them, send two
    more, and check that all ten are answered with the undisturbed images."""
    with Client(url) as client, ThreadPoolExecutor(IN_FLIGHT + LATE) as pool:
        first = {seed: pool.submit(invoke, url, seed) for seed in range(IN_FLIGHT)}
        wait_for("the engine to run the invocations", lambda: busy(client, index), 120, 0.05)
        fault(client)
        late = {seed: pool.submit(invoke, url, seed) for seed in range(100, 100 + LATE)}
        results = {seed: f.result(timeout=300) for seed, f in {**first, **late}.items()}
    for seed, result in results.items():
        diff = np.abs(pixels(result).astype(int) - reference[seed].astype(int)).max()
        assert diff <= MAX_PIXEL_DIFF, f"seed {seed}: image differs by {diff}"
    return list(results.values())


def kill_executor(client: Client, index: int = 0) -> int:
    pid = executor_state(client, index)["state"]["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def test_executor_sigkill_loses_nothing(server: ServerProcess, reference) -> None:
    killed: list[int] = []
    results = run_with_fault(server.url, reference, lambda c: killed.append(kill_executor(c)))
    assert max(r.attempts for r in results) >= 2  # some were re-placed after the kill
    with Client(server.url) as client:
        wait_for("the restarted executor", lambda: executor_state(client)["healthy"], 120, 0.05)
        assert executor_state(client)["state"]["pid"] != killed[0]


def test_worker_sigkill_loses_nothing(server: ServerProcess, reference) -> None:
    """Both the pre and the post worker are killed while invocations run: the pool restarts
    them and the executor re-runs their jobs."""

    def kill_workers(client: Client) -> None:
        workers = executor_state(client)["state"]["workers"]
        for role in ("pre", "post"):
            os.kill(workers[f"{role} worker 0"], signal.SIGKILL)

    run_with_fault(server.url, reference, kill_workers)


def test_dead_engine_thread_is_seen_and_loses_nothing(server: ServerProcess, reference) -> None:
    killed: list[int] = []

    def crash_engine(client: Client) -> None:
        pid = executor_state(client)["state"]["pid"]
        killed.append(pid)
        os.kill(pid, signal.SIGUSR1)  # the engine loop raises at its next iteration

    results = run_with_fault(server.url, reference, crash_engine)
    assert max(r.attempts for r in results) >= 2
    with Client(server.url) as client:  # /healthz said engine_dead: the pool restarted it
        wait_for("the restarted executor", lambda: executor_state(client)["healthy"], 120, 0.05)
        assert executor_state(client)["state"]["pid"] != killed[0]
