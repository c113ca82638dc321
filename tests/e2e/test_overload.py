"""Overload: 200 concurrent invocations against one tiny executor with a queue limit of 8.
Every answer is 200 or 429 ``overloaded`` with ``Retry-After``; memory stays bounded; the
server is healthy afterwards.

The burst starts once the templates are baked (into a pool still baking and profiling, the
executor sometimes kept up and nothing was refused: a test of timing, not of the bound),
and asks for 2 steps each: 200 requests arrive within a second or two, when the executor
has finished a handful."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from retouch.functions.imaging import encode_mask
from retouch.functions.wire.codec import pack, unpack
from retouch.platform.api.client import Client
from retouch.platform.api.server import ServerProcess
from retouch.platform.lab.bench.load import wait_baked

pytestmark = pytest.mark.slow

BURST = 200
QUEUE_LIMIT = 8
MiB = 1 << 20


class PeakRss:
    """Samples the resident memory of a process tree until stopped; keeps the peak."""

    def __init__(self, pid: int, tree: bool = True) -> None:
        self.process = psutil.Process(pid)
        self.tree = tree
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                children = self.process.children(recursive=True) if self.tree else []
                procs = [self.process, *children]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                pass  # a child exited between listing and reading
            time.sleep(0.05)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def burst(url: str, body: bytes) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=BURST + 10)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        return await asyncio.gather(
            *(
                client.post(
                    f"{url}/v1/functions/tiny-sd/invoke",
                    content=body,
                    headers={"content-type": "application/msgpack"},
                )
                for _ in range(BURST)
            )
        )


def test_burst_is_bounded_and_answered(tmp_path: Path, examples: Path) -> None:
    mask = np.zeros((128, 128), bool)
    mask[30:90, 20:100] = True
    body = pack(
        {"template": "street", "mask": encode_mask(mask), "prompt": "a lamp", "seed": 1, "steps": 2}
    )
    args = ["--max-queued", str(QUEUE_LIMIT), "--max-batch", "4"]
    with ServerProcess(tmp_path / "data", extra_args=args) as server:
        with Client(server.url) as client:
            client.deploy_file(examples / "tiny-sd.toml")
            wait_baked(client, "tiny-sd")
            executor_pid = client.executors()["executors"][0]["state"]["pid"]
        gateway = psutil.Process(server.process.pid)
        before = gateway.memory_info().rss
        with (
            PeakRss(server.process.pid, tree=False) as gateway_peak,
            PeakRss(executor_pid) as executor_peak,
        ):
            responses = asyncio.run(burst(server.url, body))
        codes = [r.status_code for r in responses]
        ok, refused = codes.count(200), codes.count(429)
        print(
            f"\n{ok} answered 200, {refused} answered 429; peak RSS: gateway "
            f"{gateway_peak.peak / MiB:.0f} MiB (before {before / MiB:.0f} MiB), executor with "
            f"workers {executor_peak.peak / MiB:.0f} MiB"
        )
        assert ok + refused == BURST, sorted(set(codes))
        assert ok >= QUEUE_LIMIT  # at least the queue's worth was accepted and answered
        assert refused > 0
        for r in responses:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                assert unpack(r.content)["error"]["code"] == "overloaded"
        # The gateway holds at most the queue and the executor slots: a few MiB of bodies.
        assert gateway_peak.peak - before < 256 * MiB
        assert httpx.get(f"{server.url}/healthz").status_code == 200
        with Client(server.url) as client:
            assert client.invoke("tiny-sd", "street", mask, "a lamp", seed=2, steps=2).image
