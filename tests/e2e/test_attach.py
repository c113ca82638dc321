"""Executors started outside the gateway (``retouch executor``) and ``--provider attach``
(real processes on loopback).

Two standalone executors on fixed ports (max batch 1: room for 2 invocations each) and a
gateway attached to both. An executor answers ``/healthz`` without a token and nothing else;
one sent more invocations than its room refuses the extra with 429 ``executor_full``, and
through the gateway every invocation still succeeds while another client fills the
executors (the gateway queues refused ones again). An executor SIGKILLed mid-run: its work
re-runs on the other, the gateway marks it dead, and takes it back once a new process
answers on the same port. SIGTERM ends an executor cleanly. Both run with
``--deterministic``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from retouch.functions.wire.codec import RawArray, pack, unpack
from retouch.functions.wire.invoke import ExecutorInvoke, InvokeResult
from retouch.platform.api.client import Client
from retouch.platform.api.server import ServerProcess
from retouch.runtime.executor.app import TOKEN_ENV
from retouch.runtime.reproducibility import SWITCHES
from tests.e2e.standalone import AUTH, TOKEN, Executor, running_each
from tests.support import wait_for

pytestmark = pytest.mark.slow

FUNCTION, TEMPLATE = "tiny-sd", "street"
STEPS = 3  # not the spec's 4: the stock path, independent of bake timing
FILL_STEPS = 12  # another client's invocations: long enough to keep an executor full
MASK = np.zeros((128, 128), bool)
MASK[24:88, 16:80] = True
ROOM = 2  # max batch 1 x (running batch + as many waiting)


@pytest.fixture(scope="module")
def executors(
    tmp_path_factory: pytest.TempPathFactory, shared_dir: Path, executor_zygote: Path
) -> Iterator[list[Executor]]:
    """The first is the ``retouch executor`` command itself, started without the
    deterministic switches (``--deterministic``: it sets them after loading torch). The
    second runs the same flags and code forked from the test process's zygote (its imports
    done, the suite's switches inherited): the one killed and started again."""
    fresh = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    flags = ("--deterministic",)
    each = [{"args": flags, "env": fresh}, {"args": flags, "zygote": executor_zygote}]
    with running_each(tmp_path_factory.mktemp("attach"), "standalone", shared_dir, each) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, executors: list[Executor], examples: Path
) -> Iterator[ServerProcess]:
    urls = ",".join(e.url for e in executors)
    args = ["--provider", "attach", "--executor-urls", urls]
    data = tmp_path_factory.mktemp("attach-gateway")
    with ServerProcess(data, env={TOKEN_ENV: TOKEN}, extra_args=args) as proc:
        with Client(proc.url) as client:
            assert client.deploy_file(examples / f"{FUNCTION}.toml")["status"] == "ready"
        yield proc


def invoke(url: str, seed: int) -> InvokeResult:
    with Client(url, timeout=None) as client:
        return client.invoke(
            FUNCTION, TEMPLATE, MASK, "a red door", seed=seed, steps=STEPS, format="raw"
        )


def direct(executor: Executor, seed: int, steps: int = STEPS) -> httpx.Response:
    """An invocation sent straight to ``executor``, as another gateway would."""
    inv = ExecutorInvoke(
        function=FUNCTION,
        template=TEMPLATE,
        mask=RawArray.of(MASK.astype(np.uint8)),
        prompt="p",
        seed=seed,
        steps=steps,
        guidance=7.5,
        format="png",
    )
    return httpx.post(
        f"{executor.url}/invoke", content=pack(inv.to_wire()), headers=AUTH, timeout=300
    )


def executor_rows(client: Client) -> dict[str, dict]:
    return {row["url"]: row for row in client.executors()["executors"]}


def queue_event(gateway: ServerProcess, event: str) -> float:
    text = httpx.get(gateway.metrics_url, timeout=10).text
    line = next(
        x for x in text.splitlines() if x.startswith(f'retouch_queue_events{{event="{event}"}}')
    )
    return float(line.rsplit(" ", 1)[1])


def test_attached_executors_are_the_pool(gateway: ServerProcess, executors: list[Executor]) -> None:
    """The gateway takes both as they are (device and node from their state) and serves."""
    with Client(gateway.url) as client:
        rows = executor_rows(client)
    assert set(rows) == {e.url for e in executors}
    for e in executors:
        assert rows[e.url]["healthy"] and rows[e.url]["device"] == "cpu"
        assert rows[e.url]["node"] == e.name
        assert FUNCTION in rows[e.url]["functions"]
        assert e.state().deterministic  # --deterministic
    assert invoke(gateway.url, 1).width == 128


def test_healthz_is_open_and_nothing_else(
    gateway: ServerProcess, executors: list[Executor]
) -> None:
    url = executors[0].url
    assert httpx.get(f"{url}/healthz").status_code == 200
    for path in ("/state", "/changes"):
        resp = httpx.get(f"{url}{path}")
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "unauthorized"


def test_an_executor_refuses_beyond_its_room(
    gateway: ServerProcess, executors: list[Executor]
) -> None:
    target = executors[1]
    with ThreadPoolExecutor(ROOM + 3) as pool:
        answers = list(pool.map(lambda s: direct(target, s, steps=FILL_STEPS), range(ROOM + 3)))
    refused = [r for r in answers if r.status_code == 429]
    assert refused and all(r.status_code in (200, 429) for r in answers)
    error = unpack(refused[0].content)["error"]
    assert error["code"] == "executor_full" and error["detail"]["room"] == ROOM
    assert sum(r.status_code == 200 for r in answers) >= ROOM


def test_a_gateway_sharing_full_executors_queues_again(
    gateway: ServerProcess, executors: list[Executor]
) -> None:
    """Another client fills both executors; the gateway's invocations are refused there,
    wait in its queue and all succeed, none an extra attempt."""
    before = queue_event(gateway, "refused")
    with ThreadPoolExecutor(2 * ROOM + 6) as pool:
        others = [
            pool.submit(direct, e, 50 + i, FILL_STEPS) for e in executors for i in range(ROOM)
        ]
        wait_for(
            "the other client to fill both executors",
            lambda: all(e.state().queued >= ROOM for e in executors),
            60,
            0.02,
        )
        ours = [pool.submit(invoke, gateway.url, seed) for seed in range(6)]
        results = [f.result(timeout=300) for f in ours]
        assert all(f.result().status_code == 200 for f in others)
    assert all(r.width == 128 and r.attempts == 1 for r in results)
    assert queue_event(gateway, "refused") > before


def test_killed_executor_is_marked_dead_and_taken_back(
    gateway: ServerProcess, executors: list[Executor]
) -> None:
    survivor, victim = executors  # the victim forks from the zygote: a quick restart
    with Client(gateway.url) as client, ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(invoke, gateway.url, 200 + s) for s in range(4)]
        wait_for("the victim to run work", lambda: victim.state().queued >= 1, 60, 0.02)
        victim.process.kill()
        victim.process.wait()
        results = [f.result(timeout=300) for f in futures]
        assert all(r.executor == survivor.name for r in results if r.attempts >= 2)
        assert max(r.attempts for r in results) >= 2  # the victim's work re-ran
        wait_for(
            "the victim marked dead",
            lambda: executor_rows(client)[victim.url]["phase"] == "dead",
            30,
        )
        victim.start().wait_healthy()  # a new process on the same port
        wait_for("the victim taken back", lambda: executor_rows(client)[victim.url]["healthy"], 120)
        assert FUNCTION in victim.state().functions  # the gateway deployed to it again
    assert invoke(gateway.url, 300).width == 128


def test_sigterm_ends_a_standalone_executor_cleanly(executors: list[Executor]) -> None:
    """Runs last (the module's gateway no longer needs them). uvicorn shuts down (the
    lifespan closes the core) and each exits as on SIGTERM, status 143, within the stop's
    wait rather than by its SIGKILL: the ``retouch`` command (``platform/cli/main.py``) and
    the forked one (``runtime/executor/main.py`` unwinds, the zygote reports its status)."""
    for e in executors:
        assert e.stop() == 128 + signal.SIGTERM, e.log()
        assert "Traceback" not in e.log()
