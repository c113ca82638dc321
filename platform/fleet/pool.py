"""The executor pool: the gateway's executors and the one way to reach them, in parts with
one job each, wired here and started and stopped in order:

* :class:`~retouch.platform.fleet.fleet.Fleet` — the executors' lives: spawn, deploy, drain,
  restart, health, change feed;
* :class:`~retouch.platform.fleet.dispatch.Dispatcher` — admission, the gateway queue, and each
  invocation's send, retry and what its outcome teaches;
* :class:`~retouch.platform.fleet.report.PoolReport` — what the pool reports;
* :class:`~retouch.platform.fleet.scaler.PoolScaler` (``--autoscale``) — talks to the fleet
  through the narrow :class:`~retouch.platform.fleet.scaler.ScaledFleet`.
"""

from __future__ import annotations

from retouch.platform.control.placement import Placement
from retouch.platform.control.queue import QueueLimits
from retouch.platform.fleet.dispatch import Dispatcher, RetryPolicy
from retouch.platform.fleet.executorlink import ExecutorLink
from retouch.platform.fleet.fleet import DRAIN_TIMEOUT_S, Fleet
from retouch.platform.fleet.providers import Provider
from retouch.platform.fleet.report import PoolReport
from retouch.platform.fleet.scaler import PoolScaler
from retouch.platform.fleet.sleepers import SleepPolicy
from retouch.platform.state.registry import StoredFunction


class ExecutorPool:
    """Owns the fleet, the dispatcher, the report and the autoscaler (event-loop state)."""

    def __init__(
        self,
        provider: Provider,
        placement: Placement,
        limits: QueueLimits | None = None,
        retry: RetryPolicy | None = None,
        *,
        autoscale: bool = False,
        autoscale_dry_run: bool = False,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
        sleep: SleepPolicy | None = None,
    ) -> None:
        retry = retry or RetryPolicy()
        self.link = ExecutorLink(provider.token, retry.invoke_timeout_s)
        self.fleet = Fleet(
            provider,
            self.link,
            on_capacity=lambda: self.dispatcher.queue.dispatch(),
            queued=lambda: self.dispatcher.queue.queued(),
            drain_timeout_s=drain_timeout_s,
            sleep=sleep if autoscale and not autoscale_dry_run else None,
        )
        self.dispatcher = Dispatcher(self.fleet, self.link, placement, limits, retry)
        self.scaler = PoolScaler(self.fleet, dry_run=autoscale_dry_run) if autoscale else None
        self.report = PoolReport(self.fleet, self.dispatcher, self.scaler)

    async def start(self) -> None:
        await self.fleet.start(static=self.scaler is None)
        if self.scaler is not None:  # the scaler starts what the functions' tables ask for
            self.scaler.start()

    async def close(self) -> None:
        if self.scaler is not None:
            await self.scaler.close()
        await self.fleet.close()
        await self.link.close()

    @property
    def ready(self) -> bool:
        """Able to serve: a healthy executor, or an autoscaled pool (it starts one)."""
        return self.scaler is not None or any(e.healthy for e in self.fleet.executors)

    async def load(self, stored: StoredFunction, generation: int) -> None:
        """Deploy (or replace) a function on every executor of its model; raise if none
        could load it."""
        self.dispatcher.deployed(stored.spec)
        await self.fleet.deploys.load(stored, generation)

    async def unload(self, name: str, generation: int) -> None:
        """Remove a function everywhere; invocations still waiting for it fail."""
        self.dispatcher.deleted(name)
        await self.fleet.deploys.unload(name, generation)
