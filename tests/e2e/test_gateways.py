"""Several gateways behind one Service: two ``retouch serve`` processes share a real
PostgreSQL (started by the test set-up) and place onto the same two executors (what
``retouch executor`` runs, forked from the zygote; ``--provider attach``). A function deployed through one is served
by both; jobs are submitted to either; one gateway is SIGKILLed with jobs queued and
running, and every accepted job ends exactly once (one terminal record, one ``completed``
webhook delivery id) and is readable from the survivor, which re-runs the dead one's."""

from __future__ import annotations

import signal
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from retouch.platform.api.client import Client
from retouch.platform.api.server import ServerProcess
from retouch.runtime.executor.app import TOKEN_ENV
from tests.e2e.receiver import Receiver
from tests.e2e.standalone import TOKEN, Executor, running
from tests.postgres import PostgresServer
from tests.support import one_template, wait_for

from .conftest import ADMIN, INVOKE, TOKENS

pytestmark = pytest.mark.slow

FUNCTION, TEMPLATE, STEPS, JOBS = "shared-sd", "street", 3, 6
LONG_STEPS = 60
TTL_S = 3  # a gateway silent this long is dead: the survivor takes its jobs
MASK = np.zeros((128, 128), bool)
MASK[24:88, 16:80] = True


def gateway(data: Path, url: str, executors: list[Executor]) -> ServerProcess:
    args = ["--state-store", url, "--state-store-ttl", str(TTL_S), "--provider", "attach"]
    args += ["--executor-urls", ",".join(e.url for e in executors)]
    return ServerProcess(data, env={**TOKENS, TOKEN_ENV: TOKEN}, extra_args=args)


@pytest.fixture
def executors(tmp_path: Path, shared_dir: Path, executor_zygote: Path) -> Iterator[list[Executor]]:
    """Two executors of max batch 1 (room for 2 invocations each) both gateways share,
    forked from the test process's zygote (the command itself: tests/e2e/test_attach.py)."""
    with running(tmp_path, "shared", shared_dir, zygote=executor_zygote) as started:
        yield started


def ended(hooks: Receiver) -> set[str]:
    """The jobs whose ``completed`` delivery arrived (signed, answered 200)."""
    return {a.body["job"]["id"] for a in hooks.accepted(kind="completed")}


def test_two_gateways_share_jobs_and_survive_a_sigkill(
    tmp_path: Path, examples: Path, postgres: PostgresServer, executors: list[Executor]
) -> None:
    url = postgres.database()
    first = gateway(tmp_path / "a", url, executors).start()
    second = gateway(tmp_path / "b", url, executors).start()
    try:
        spec, images = one_template(examples, FUNCTION, STEPS, TEMPLATE)
        with Client(first.url, ADMIN) as admin:
            assert admin.deploy(spec, images)["status"] == "ready"
        with Client(second.url, ADMIN) as admin:  # deployed through the other one
            wait_for(
                "the function ready on the second gateway",
                lambda: any(f["name"] == FUNCTION and f["status"] == "ready" for f in admin.list()),
                120,
                0.2,
            )
        with Client(first.url, INVOKE) as a, Client(second.url, INVOKE) as b:
            secret = a.webhook_secret()
            assert b.webhook_secret() == secret  # one secret for every gateway
            # a cancel asked of the gateway that does not run the job reaches the one that does
            long = a.submit(FUNCTION, TEMPLATE, MASK, "a long edit", seed=99, steps=LONG_STEPS)
            assert b.job(long.id).cancel()["status"] == "canceled"
            assert a.job(long.id).doc["status"] == "canceled"
            with Receiver(secret) as hooks:
                hook = {"webhook": f"{hooks.url}/done"}
                ids = [
                    (a if seed % 2 else b)
                    .submit(FUNCTION, TEMPLATE, MASK, "a red door", seed=seed, format="raw", **hook)
                    .id
                    for seed in range(JOBS)
                ]
                on_first = ids[1::2]
                # each gateway reads the other's jobs
                assert {b.job(i).doc["id"] for i in on_first} == set(on_first)
                wait_for(
                    "a job of the first gateway running",
                    lambda: any(a.job(i).doc["status"] == "running" for i in on_first),
                    120,
                    0.05,
                )
                queued = [i for i in on_first if a.job(i).doc["status"] == "queued"]
                assert queued, "the kill should find jobs still queued on the first gateway"
                first.process.send_signal(signal.SIGKILL)
                first.process.wait()

                results = {i: b.job(i).wait(timeout=300) for i in ids}
                listed = b.jobs(limit=1000)
                # a result link the dead gateway signed is served by the survivor
                link = next(j["output"] for j in listed if j["id"] == on_first[0])
                image = httpx.get(link, timeout=10)
                assert image.status_code == 200 and image.content
                wait_for(
                    "a completed delivery of every job",
                    lambda: ended(hooks) >= set(ids),
                    60,
                    0.2,
                    lambda: sorted(set(ids) - ended(hooks)),
                )
    finally:
        for proc in (first, second):
            if proc.process is not None and proc.process.poll() is None:
                proc.stop()

    assert all(r.engine.steps == STEPS for r in results.values())
    listed = [j for j in listed if j["id"] != long.id]
    assert sorted(j["id"] for j in listed) == sorted(ids)  # none lost, none duplicated
    assert {j["status"] for j in listed} == {"succeeded"}
    deliveries = defaultdict(set)
    for arrival in hooks.accepted(kind="completed"):
        assert arrival.body["job"]["status"] == "succeeded"
        deliveries[arrival.body["job"]["id"]].add(arrival.headers["webhook-id"])
    # exactly one end per job: one delivery id (a retried delivery keeps its id)
    assert {job_id: len(d) for job_id, d in deliveries.items()} == dict.fromkeys(ids, 1)
