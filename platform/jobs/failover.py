"""A gateway's life among several: alive in the shared store, heir to those that die.

Every :data:`~retouch.platform.state.statestore.HEARTBEAT_S` the gateway stamps its row in the
shared store, takes the unfinished jobs and pending webhook deliveries of gateways whose
stamp is older than the store's ``ttl_s`` (a gateway SIGKILLed, partitioned or stopped),
runs those jobs again (edits are deterministic), and passes on the cancels other gateways
were asked for of the jobs it runs. One loop, one owner: the gateway starts and stops it.

The other side of a takeover is fencing oneself. A gateway whose jobs were taken while it
was thought dead (its loop stalled past the TTL) sees that their rows name another gateway
and stops them; one that could not stamp its row for the whole TTL (the store unreachable)
assumes the same of all its jobs, stops them, and comes back under a new id, so its old
rows are claimed as a dead gateway's. After such a gap it claims nothing for one TTL: the
others' stamps may be as old as its own, and they are not dead for that.
"""

from __future__ import annotations

import asyncio
import logging
import time

from retouch.platform.jobs.sharedjournal import SharedDeliveryJournal, SharedJobJournal
from retouch.platform.jobs.store import JobStore
from retouch.platform.jobs.webhooks import WebhookSender
from retouch.platform.state.statestore import HEARTBEAT_S, StateStore

log = logging.getLogger(__name__)


class Failover:
    def __init__(
        self,
        store: StateStore,
        jobs: JobStore,
        journal: SharedJobJournal,
        webhooks: WebhookSender,
        deliveries: SharedDeliveryJournal,
        interval_s: float = HEARTBEAT_S,
    ) -> None:
        self.store, self.jobs, self.journal = store, jobs, journal
        self.webhooks, self.deliveries = webhooks, deliveries
        self.interval_s = interval_s
        now = time.monotonic()
        self._stamped = now  # the last heartbeat that reached the store
        self._steady_since = now  # stamped every tick since (claims wait one TTL after a gap)

    async def run(self) -> None:
        """Until cancelled; an error (the store unreachable) is logged and tried again."""
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("shared state store: heartbeat or takeover failed; retrying")
            await asyncio.sleep(self.interval_s)

    async def tick(self) -> None:
        if not await self._heartbeat():
            return
        await self.jobs.drop(await asyncio.to_thread(self.journal.taken, self.jobs.live_ids()))
        if time.monotonic() - self._steady_since >= self.store.ttl_s:
            await self.jobs.adopt(await asyncio.to_thread(self.journal.claim))
            if self.webhooks.adopt(await asyncio.to_thread(self.deliveries.claim)):
                log.info("took over pending webhook deliveries of a gateway that stopped")
        await self.jobs.cancel_requested(await asyncio.to_thread(self.journal.cancels))

    async def _heartbeat(self) -> bool:
        """Stamp this gateway; False when the store did not answer. Silent for the whole
        TTL, this gateway may be taken over: it stops its jobs and takes a new id."""
        try:
            await asyncio.to_thread(self.store.heartbeat)
        except OSError as exc:
            now = time.monotonic()
            if now - self._stamped > self.store.ttl_s and self.jobs.live_ids():
                log.error("state store unreachable for %.0f s (%s)", now - self._stamped, exc)
                await self.jobs.drop(self.jobs.live_ids())
                self.store.renew()
            log.warning("state store heartbeat failed: %s", exc)
            return False
        now = time.monotonic()
        if now - self._stamped > self.store.ttl_s:  # back after a gap
            self._steady_since = now
            if self.jobs.live_ids():  # stalled past the TTL without a store error
                log.warning(
                    "heartbeat %.0f s late; checking this gateway's jobs", now - self._stamped
                )
        self._stamped = now
        return True
