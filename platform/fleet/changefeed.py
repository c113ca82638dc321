"""Each executor's change feed, followed: the control plane's view of an executor stays
current even when it gets no invocations.

A follower long-polls the executor's ``/changes`` and re-reads its state on every change:
a bake that finished or a template that entered host memory changes placement, and an
executor that gets no invocations would otherwise never tell (its view would say
"baking" forever and affinity would never send it work). One follower per executor name;
a failed poll is retried (health is the fleet monitor's job).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httpx

from retouch.functions.errors import RetouchError
from retouch.functions.wire.executor import ExecutorChanges
from retouch.platform.fleet.executorlink import PROBE_TIMEOUT_S, ExecutorHandle, ExecutorLink

log = logging.getLogger(__name__)

CHANGES_WAIT_S = 20  # an executor's change-feed long poll answers within this when idle
RETRY_PAUSE_S = 1.0  # after a failed poll


class ChangeFeeds:
    """The followers of the fleet's executors (event-loop state)."""

    def __init__(
        self,
        executors: list[ExecutorHandle],
        link: ExecutorLink,
        refresh: Callable[[ExecutorHandle], Awaitable[None]],
    ) -> None:
        self.executors = executors  # the fleet's list: a follower ends once its handle leaves
        self.link = link
        self.refresh = refresh  # re-reads an executor's state into its view
        self.followers: dict[str, asyncio.Task] = {}

    def follow(self, handle: ExecutorHandle) -> None:
        """(Re)start following ``handle``'s change feed."""
        self.stop(handle.name)
        self.followers[handle.name] = asyncio.create_task(self._follow(handle))

    def stop(self, name: str) -> None:
        follower = self.followers.pop(name, None)
        if follower is not None:
            follower.cancel()

    async def _follow(self, handle: ExecutorHandle) -> None:
        """Until the executor is replaced."""
        after = 0
        while handle in self.executors:  # handles compare by identity (eq=False)
            try:
                body = await self.link.call(
                    handle,
                    "GET",
                    f"/changes?after={after}&timeout={CHANGES_WAIT_S}",
                    timeout=CHANGES_WAIT_S + PROBE_TIMEOUT_S,
                )
                changes = ExecutorChanges.from_wire(body)
            except (RetouchError, httpx.HTTPError, KeyError, ValueError) as exc:
                log.debug("change feed of %s: %r", handle.name, exc)
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            if changes.changes or changes.reset:
                log.debug("%s changed: %s", handle.name, [c.kind.value for c in changes.changes])
                await self.refresh(handle)
            after = changes.version
