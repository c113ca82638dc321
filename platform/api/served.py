"""The functions a gateway serves: each stored function tracked, loaded onto the pool, and
kept current with the registry.

Control operations on one function name (the gateway's PUT and DELETE, and the changes
other gateways made, followed from the registry) are serialised by a per-name lock and
numbered by the registry's revision (a generation the executors honour), so after any
interleaving the gateway, the durable registry and the executors agree on the last
acknowledged operation.
"""

from __future__ import annotations

import asyncio
import io
import logging

from PIL import Image

from retouch.functions.errors import RetouchError
from retouch.functions.wire.executor import DeployStatus
from retouch.platform.api.metrics import GatewayMetrics
from retouch.platform.fleet.deployed import DeployedFunction
from retouch.platform.fleet.pool import ExecutorPool
from retouch.platform.state.registry import Changes, FunctionRegistry, StoredFunction
from retouch.platform.state.statestore import HEARTBEAT_S

log = logging.getLogger(__name__)


class ServedFunctions:
    """The deployed functions by name (the front door reads the same mapping), and their
    loading onto the pool (event-loop state)."""

    def __init__(
        self,
        registry: FunctionRegistry,
        pool: ExecutorPool,
        metrics: GatewayMetrics,
        functions: dict[str, DeployedFunction],
    ) -> None:
        self.registry = registry
        self.pool = pool
        self.metrics = metrics
        self.functions = functions
        self._name_locks: dict[str, asyncio.Lock] = {}
        self._seen_revision = 0  # the registry's changes are followed from here

    async def load(self) -> None:
        """Track every stored function (at the gateway's start)."""
        stored_now = (await asyncio.to_thread(self.registry.load_all)).values()
        for stored in stored_now:
            self.track(stored)
        # a shared registry's writes commit in revision order: none below this one is unseen
        self._seen_revision = max((s.revision for s in stored_now), default=0)

    async def follow(self) -> None:
        """Deploys and deletes other gateways made, applied here (every heartbeat)."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                changes = await asyncio.to_thread(self.registry.changes, self._seen_revision)
                await self._apply(changes)
            except Exception:
                log.exception("following the shared registry failed; retrying")
                continue
            self._seen_revision = changes.revision

    async def _apply(self, changes: Changes) -> None:
        for stored in changes.stored:
            async with self.lock(stored.spec.name):
                known = self.functions.get(stored.spec.name)
                if known is None or known.stored.revision < stored.revision:
                    self.track(stored)
        for name, revision in changes.deleted:
            async with self.lock(name):
                known = self.functions.get(name)
                if known is not None and known.stored.revision < revision:
                    self.untrack(name)
                    await self.pool.unload(name, revision)  # idempotent, ordered by revision

    def lock(self, name: str) -> asyncio.Lock:
        """The lock that serialises control operations on one function name."""
        return self._name_locks.setdefault(name, asyncio.Lock())

    def track(self, stored: StoredFunction) -> DeployedFunction:
        """Serve ``stored`` (replacing the function of its name), loaded in the background."""
        fn = DeployedFunction(
            stored,
            stored.revision,
            sizes={tid: Image.open(io.BytesIO(png)).size for tid, png in stored.templates.items()},
        )
        previous = self.functions.get(stored.spec.name)
        if previous and previous.task:
            previous.task.cancel()
        self.functions[stored.spec.name] = fn
        fn.task = asyncio.create_task(self._load(fn))
        self.metrics.functions.set(len(self.functions))
        return fn

    def untrack(self, name: str) -> None:
        fn = self.functions.pop(name)
        if fn.task:
            fn.task.cancel()
        self.metrics.functions.set(len(self.functions))

    def cancel_loads(self) -> None:
        """Stop every load in flight (the gateway is stopping)."""
        for fn in self.functions.values():
            if fn.task:
                fn.task.cancel()

    async def _load(self, fn: DeployedFunction) -> None:
        try:
            await self.pool.load(fn.stored, fn.generation)
            fn.status = DeployStatus.READY
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            fn.status, fn.error = DeployStatus.FAILED, str(getattr(exc, "message", exc))
            if isinstance(exc, RetouchError):
                fn.error_field, fn.error_code = exc.field, exc.code
            log.error("deploying %s failed: %s", fn.spec.name, fn.error)
