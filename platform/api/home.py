"""Where a gateway keeps what outlives it, and who shares it: its data dir alone, or the
shared state store of several gateways.

A gateway alone (:class:`LocalHome`) keeps its function registry, job journal, webhook
deliveries and generated secrets in files in its data dir. One of several
(:class:`SharedHome`, ``retouch serve --state-store postgresql://…``) keeps them as rows of
the shared store, stamps itself alive there, takes over the jobs and deliveries of
gateways that die, and follows the deploys and deletes the others make. The composition
(``platform/api/composition.py``) picks one; the gateway's routes use its parts and never
ask which home they have.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Protocol

from retouch.platform.api.served import ServedFunctions
from retouch.platform.api.uploads import KEY_BYTES as UPLOAD_KEY_BYTES
from retouch.platform.api.uploads import UploadNames
from retouch.platform.jobs.deliveryjournal import DeliveryJournal
from retouch.platform.jobs.failover import Failover
from retouch.platform.jobs.journal import JobJournal
from retouch.platform.jobs.links import KEY_FILE, load_keys
from retouch.platform.jobs.retention import RetentionLimits
from retouch.platform.jobs.sharedjournal import SharedDeliveryJournal, SharedJobJournal
from retouch.platform.jobs.source import JobSource, JournaledJobs, SharedJobs
from retouch.platform.jobs.store import JobStore
from retouch.platform.jobs.webhooks import WebhookSender, load_secret
from retouch.platform.state.registry import FunctionRegistry, Registry
from retouch.platform.state.sharedregistry import SharedRegistry
from retouch.platform.state.statestore import StateStore

Background = Coroutine[Any, Any, None]


class Home(Protocol):
    """A gateway's durable parts, and what keeping them with others takes."""

    registry: FunctionRegistry
    jobs: JobSource  # the job store's records and peers
    deliveries: DeliveryJournal | SharedDeliveryJournal  # pending webhook deliveries
    uploads: UploadNames  # upload ids, keyed with a secret every gateway of the home shares

    def webhook_secret(self, given: str | None) -> bytes:
        """The server's webhook secret: ``given``, else the one generated for the home."""

    def link_keys(self, key_file: Path | None) -> tuple[bytes, ...]:
        """The keys result links are signed with: ``key_file``'s, else the home's."""

    def background(
        self, jobs: JobStore, webhooks: WebhookSender, served: ServedFunctions
    ) -> list[Background]:
        """The loops the gateway runs while it serves, for this home."""

    async def close(self) -> None:
        """The gateway is stopping (after its pool): let the home go."""


class LocalHome:
    """One gateway: files in its data dir, shared with nobody."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.registry = Registry(data_dir)
        self.jobs = JournaledJobs(JobJournal(data_dir / "jobs"))
        self.deliveries = DeliveryJournal(data_dir / "webhooks")
        # kept beside the journal, so upload ids (and the executors' bakes of uploads)
        # outlive a restart
        self.uploads = UploadNames.load(data_dir)

    def webhook_secret(self, given: str | None) -> bytes:
        return load_secret(self.data_dir, given)

    def link_keys(self, key_file: Path | None) -> tuple[bytes, ...]:
        return load_keys(key_file or self.data_dir / KEY_FILE)

    def background(
        self, jobs: JobStore, webhooks: WebhookSender, served: ServedFunctions
    ) -> list[Background]:
        return []  # nobody else writes its data dir, nobody else's jobs to take over

    async def close(self) -> None:
        """Its files need no goodbye."""


class SharedHome:
    """One of several gateways behind one shared store: any gateway's job can be read,
    and a survivor re-runs what a dead gateway had accepted."""

    def __init__(self, state: StateStore, limits: RetentionLimits, retention_s: float) -> None:
        self.state = state
        self.registry = SharedRegistry(state)
        self.journal = SharedJobJournal(state, limits, retention_s)
        self.jobs = SharedJobs(self.journal)
        self.deliveries = SharedDeliveryJournal(state)
        self.uploads = UploadNames(state.secret("upload-key", UPLOAD_KEY_BYTES))

    def webhook_secret(self, given: str | None) -> bytes:
        """Generated once by whichever gateway started first, for all."""
        return given.encode() if given else self.state.secret("webhook-secret").hex().encode()

    def link_keys(self, key_file: Path | None) -> tuple[bytes, ...]:
        """The store's one key unless a file is given: a link one gateway signs, another
        verifies."""
        return load_keys(key_file) if key_file is not None else (self.state.secret("link-key"),)

    def background(
        self, jobs: JobStore, webhooks: WebhookSender, served: ServedFunctions
    ) -> list[Background]:
        """Failover (heartbeat, takeovers, cancels passed on) on the same journals the job
        store and the webhook sender write, and the other gateways' deploys followed."""
        failover = Failover(self.state, jobs, self.journal, webhooks, self.deliveries)
        return [failover.run(), served.follow()]

    async def close(self) -> None:
        """Its unfinished jobs are another gateway's at once."""
        await asyncio.to_thread(self.state.leave)
        await asyncio.to_thread(self.state.close)
