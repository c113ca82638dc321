"""A gateway's life among several: alive in the shared store, heir to those that die.

Every :data:`~retouch.platform.statestore.HEARTBEAT_S` the gateway stamps its row in the
shared store, takes the unfinished jobs and pending webhook deliveries of gateways whose
stamp is older than the store's ``ttl_s`` (a gateway SIGKILLed, partitioned or stopped),
runs those jobs again (edits are deterministic), and passes on the cancels other gateways
were asked for of the jobs it runs. One loop, one owner: the gateway starts and stops it.
"""

from __future__ import annotations

import asyncio
import logging

from retouch.platform.jobs import JobStore
from retouch.platform.sharedjournal import SharedDeliveryJournal, SharedJobJournal
from retouch.platform.statestore import HEARTBEAT_S, StateStore
from retouch.platform.webhooks import WebhookSender

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

    async def run(self) -> None:
        """Until cancelled; an error (the store unreachable) is logged and tried again."""
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("shared state store: heartbeat or takeover failed; retrying")
            await asyncio.sleep(self.interval_s)

    async def tick(self) -> None:
        await asyncio.to_thread(self.store.heartbeat)
        await self.jobs.adopt(await asyncio.to_thread(self.journal.claim))
        if self.webhooks.adopt(await asyncio.to_thread(self.deliveries.claim)):
            log.info("took over pending webhook deliveries of a gateway that stopped")
        await self.jobs.cancel_requested(await asyncio.to_thread(self.journal.cancels))
