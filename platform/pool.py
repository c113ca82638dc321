"""The executor pool: the gateway's view of its executors and the one way to reach them.

It starts executors through a provider, pushes every deployed function to them, forwards
invocations to the executor placement picks (retrying another on a transport failure, since
nothing ran), and restarts an executor whose process died, re-pushing its functions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx

from retouch.functions import wire
from retouch.functions.errors import RetouchError, Unavailable
from retouch.platform.placement import Placement, PlacementRequest
from retouch.platform.providers import ExecutorProcess, LocalProvider
from retouch.platform.registry import StoredFunction

log = logging.getLogger(__name__)

MONITOR_INTERVAL_S = 1.0
INVOKE_TIMEOUT_S = 3600.0


@dataclass
class ExecutorHandle:
    process: ExecutorProcess
    inflight: int = 0
    functions: set[str] = field(default_factory=set)
    healthy: bool = True

    @property
    def name(self) -> str:
        return self.process.name

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device": self.process.device,
            "url": self.process.url,
            "healthy": self.healthy,
            "inflight": self.inflight,
            "functions": sorted(self.functions),
        }


class ExecutorPool:
    def __init__(self, provider: LocalProvider, placement: Placement) -> None:
        self.provider = provider
        self.placement = placement
        self.executors: list[ExecutorHandle] = []
        self.functions: dict[str, StoredFunction] = {}
        self._http = httpx.AsyncClient(
            headers={
                "authorization": f"Bearer {provider.token}",
                "content-type": "application/msgpack",
            },
            timeout=httpx.Timeout(INVOKE_TIMEOUT_S, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self._monitor: asyncio.Task | None = None

    async def start(self) -> None:
        devices = self.provider.devices()
        threads = self.provider.threads_per_executor(len(devices))
        names = [f"exec-{i}" for i in range(len(devices))]
        procs = await asyncio.gather(
            *(self.provider.start(n, d, threads) for n, d in zip(names, devices, strict=True))
        )
        self.executors = [ExecutorHandle(p) for p in procs]
        self._monitor = asyncio.create_task(self._watch())

    async def close(self) -> None:
        if self._monitor:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        await asyncio.gather(*(self.provider.stop(e.process) for e in self.executors))
        await self._http.aclose()

    @property
    def ready(self) -> bool:
        return any(e.healthy for e in self.executors)

    async def load(self, stored: StoredFunction) -> None:
        """Push a function to every executor; raise if none could load it."""
        self.functions[stored.spec.name] = stored
        results = await asyncio.gather(
            *(self._push(e, stored) for e in self.executors), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and len(errors) == len(self.executors):
            raise errors[0] if isinstance(errors[0], RetouchError) else Unavailable(str(errors[0]))

    async def unload(self, name: str) -> None:
        self.functions.pop(name, None)
        for e in self.executors:
            e.functions.discard(name)
        await asyncio.gather(
            *(self._call(e, "DELETE", f"/functions/{name}") for e in self.executors if e.healthy),
            return_exceptions=True,
        )

    async def invoke(self, inv: wire.ExecutorInvoke, mask_ratio: float) -> wire.InvokeResult:
        request = PlacementRequest(inv.function, inv.template, mask_ratio)
        tried: set[str] = set()
        while True:
            candidates = [
                e
                for e in self.executors
                if e.healthy and inv.function in e.functions and e.name not in tried
            ]
            if not candidates:
                raise Unavailable(
                    "no executor can serve this function right now", code="no_executor"
                )
            handle = self.placement.choose(candidates, request)
            tried.add(handle.name)
            handle.inflight += 1
            try:
                body = await self._call(handle, "POST", "/invoke", inv.to_wire())
                return wire.InvokeResult.from_wire(body)
            except httpx.TransportError as exc:
                log.warning("executor %s unreachable (%s); trying another", handle.name, exc)
                handle.healthy = False  # the monitor probes it and restarts it if needed
            finally:
                handle.inflight -= 1

    def describe(self) -> list[dict[str, Any]]:
        return [e.describe() for e in self.executors]

    async def states(self) -> list[dict[str, Any]]:
        """Each healthy executor's own state (models, templates, cache counters)."""
        results = await asyncio.gather(
            *(self._call(e, "GET", "/state") for e in self.executors if e.healthy),
            return_exceptions=True,
        )
        return [r for r in results if isinstance(r, dict)]

    async def _push(self, handle: ExecutorHandle, stored: StoredFunction) -> None:
        body = {"spec": stored.spec.to_dict(), "templates": stored.templates}
        await self._call(handle, "PUT", f"/functions/{stored.spec.name}", body)
        handle.functions.add(stored.spec.name)

    async def _call(self, handle: ExecutorHandle, method: str, path: str, body: Any = None) -> Any:
        content = wire.pack(body) if body is not None else None
        resp = await self._http.request(method, handle.process.url + path, content=content)
        payload = wire.unpack(resp.content) if resp.content else {}
        if resp.status_code >= 400:
            raise RetouchError.from_wire(resp.status_code, payload)
        return payload

    async def _watch(self) -> None:
        """Restart executors whose process died or stopped answering, then re-push functions."""
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            for i, handle in enumerate(self.executors):
                if handle.process.alive and (handle.healthy or await self._answers(handle)):
                    handle.healthy = True
                    continue
                await self._restart(i, handle)

    async def _answers(self, handle: ExecutorHandle) -> bool:
        try:
            await self._call(handle, "GET", "/healthz")
            return True
        except (RetouchError, httpx.HTTPError):
            return False

    async def _restart(self, index: int, old: ExecutorHandle) -> None:
        log.warning("restarting executor %s", old.name)
        old.healthy = False
        await self.provider.stop(old.process)
        try:
            threads = self.provider.threads_per_executor(len(self.executors))
            proc = await self.provider.start(old.name, old.process.device, threads)
        except RetouchError as exc:
            log.error("could not restart %s: %s", old.name, exc)
            return
        handle = ExecutorHandle(proc)
        self.executors[index] = handle
        for stored in list(self.functions.values()):
            try:
                await self._push(handle, stored)
            except (RetouchError, httpx.HTTPError) as exc:
                log.error("re-pushing %s to %s failed: %s", stored.spec.name, handle.name, exc)
