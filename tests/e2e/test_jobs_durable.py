"""Accepted jobs survive the gateway: SIGKILL it with jobs queued and running, start it
again on the same data dir, and every accepted job reaches ``succeeded`` exactly once."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest

from retouch.platform.api.client import Client
from retouch.platform.api.server import ServerProcess
from tests.support import one_template, wait_for

from .conftest import ADMIN, INVOKE, TOKENS

pytestmark = pytest.mark.slow

FUNCTION, TEMPLATE, STEPS, JOBS = "durable-sd", "street", 3, 6
MASK = np.zeros((128, 128), bool)
MASK[24:88, 16:80] = True


def test_jobs_survive_a_gateway_sigkill(tmp_path: Path, examples: Path) -> None:
    data = tmp_path / "data"
    args = ["--max-batch", "1"]  # 2 slots: most jobs are still queued at the kill
    first = ServerProcess(data, env=TOKENS, extra_args=args).start()
    try:
        spec, images = one_template(examples, FUNCTION, STEPS, TEMPLATE)
        with Client(first.url, ADMIN) as admin:
            assert admin.deploy(spec, images)["status"] == "ready"
        with Client(first.url, INVOKE) as client:
            ids = [
                client.submit(FUNCTION, TEMPLATE, MASK, "a red door", seed=s, format="raw").id
                for s in range(JOBS)
            ]
            wait_for(  # one is running at the kill
                "the first job running",
                lambda: client.job(ids[0]).doc["status"] != "queued",
                120,
                0.05,
            )
        assert len(list((data / "jobs").glob("*.job"))) == JOBS  # journaled before the 202
    finally:
        assert first.process is not None
        first.process.send_signal(signal.SIGKILL)
        first.process.wait()

    t0 = time.monotonic()
    with (
        ServerProcess(data, env=TOKENS, extra_args=args) as second,
        Client(second.url, INVOKE) as client,
    ):
        results = [client.job(i).wait(timeout=300) for i in ids]
        listed = client.jobs(limit=1000)
        elapsed = time.monotonic() - t0
    assert all(r.engine.steps == STEPS for r in results)
    assert sorted(j["id"] for j in listed) == sorted(ids)  # none lost, none duplicated
    assert {j["status"] for j in listed} == {"succeeded"}
    assert len(list((data / "jobs").glob("*.job"))) == JOBS
    print(f"{JOBS} jobs resumed and succeeded {elapsed:.1f} s after the restart")
