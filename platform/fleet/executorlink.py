"""One executor as the gateway sees it, and the HTTP link that reaches every executor.

An :class:`ExecutorHandle` is event-loop state (no lock): the process, the control plane's
view of it, its slots and what it holds. :class:`ExecutorLink` is the one way the gateway
talks to executors: msgpack over HTTP with the per-run internal token, a long timeout for
invocations and a short one for probes and state reads.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import InitVar, dataclass, field
from typing import Any

import httpx

from retouch.functions.errors import RetouchError
from retouch.functions.wire.codec import pack, unpack
from retouch.functions.wire.executor import ExecutorPhase, ExecutorState
from retouch.functions.wire.invoke import ExecutorInvoke
from retouch.platform.control.calibration import Overheads
from retouch.platform.control.cluster import ExecutorView
from retouch.platform.fleet.providers import Executor
from retouch.platform.fleet.tls import tls_context

PROBE_TIMEOUT_S = 2.0


@dataclass(eq=False)
class ExecutorHandle:
    """One executor as the pool sees it (event-loop state, no lock needed)."""

    process: Executor
    # what its provider started it on, and restarts it on: a device, or an attached URL
    slot: str = ""
    view: ExecutorView = field(init=False)  # the control plane's picture of it
    inflight: int = 0
    slots: int = 1
    functions: set[str] = field(default_factory=set)
    probe_failures: int = 0
    state: ExecutorState | None = None
    restarts: int = 0
    # The model pool it was started for (autoscaled): it is pushed, and placement sends it,
    # only that model's functions. None: it serves every function (a static pool).
    model: str | None = None
    refreshing: bool = False  # a state read is under way (reads are coalesced)
    refresh_again: bool = False  # something changed during that read: read once more
    started_at: float = field(default_factory=time.monotonic)
    # it refused an invocation as full (its room shared with other gateways): nothing is
    # bound to it before this monotonic time
    refused_until: float = 0.0
    overheads: InitVar[Overheads | None] = None  # the pool's, learnt from every executor

    def __post_init__(self, overheads: Overheads | None) -> None:
        self.view = ExecutorView(self.process.name, overheads=overheads)
        self.slot = self.slot or self.process.device

    @property
    def name(self) -> str:
        return self.process.name

    @property
    def phase(self) -> ExecutorPhase:
        return self.view.phase

    @phase.setter
    def phase(self, phase: ExecutorPhase) -> None:
        self.view.phase = phase

    @property
    def healthy(self) -> bool:
        return self.phase is ExecutorPhase.READY

    def serves(self, model: str | None) -> bool:
        """Whether functions of ``model`` may be deployed to and placed on it."""
        return self.model is None or self.model == model

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.model,
            "device": self.process.device,
            "node": self.process.node,
            "url": self.process.url,
            "phase": self.phase.value,
            "healthy": self.healthy,
            "inflight": self.inflight,
            "slots": self.slots,
            "restarts": self.restarts,
            "functions": sorted(self.functions),
            "predicted_work_s": round(self.view.work_s(), 3),
            "calibration": self.view.calibration.describe(
                self.view.overheads, len(self.view.placed)
            ),
            "templates": {f"{fn}/{t}": tier.value for (fn, t), tier in self.view.residency.items()},
        }


class ExecutorLink:
    """The HTTP clients to the executors: one for invocations (bounded by their deadline),
    one with a short timeout for probes, state reads and cancels."""

    def __init__(self, token: str, invoke_timeout_s: float) -> None:
        headers = {"authorization": f"Bearer {token}", "content-type": "application/msgpack"}
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(invoke_timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            verify=tls_context(),
        )
        self._probe = httpx.AsyncClient(
            headers=headers, timeout=PROBE_TIMEOUT_S, verify=tls_context()
        )

    async def call(
        self,
        handle: ExecutorHandle,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float | None = None,
        probe: bool = False,
    ) -> Any:
        """One request; an error answer is raised as the :class:`RetouchError` it carries."""
        content = pack(body) if body is not None else None
        extra = {"timeout": timeout} if timeout is not None else {}
        client = self._probe if probe else self._http
        resp = await client.request(method, handle.process.url + path, content=content, **extra)
        payload = unpack(resp.content) if resp.content else {}
        if resp.status_code >= 400:
            raise RetouchError.from_wire(resp.status_code, payload)
        return payload

    @asynccontextmanager
    async def stream(
        self, handle: ExecutorHandle, inv: ExecutorInvoke
    ) -> AsyncIterator[httpx.Response]:
        """``POST /invoke/stream``; an error answer is raised before any frame is read."""
        url = handle.process.url + "/invoke/stream"
        async with self._http.stream("POST", url, content=pack(inv.to_wire())) as resp:
            if resp.status_code >= 400:
                body = await resp.aread()
                raise RetouchError.from_wire(resp.status_code, unpack(body) if body else {})
            yield resp

    async def close(self) -> None:
        await self._http.aclose()
        await self._probe.aclose()
