"""The invocations an executor holds: counted against its room, and found by the gateway's
id for a cancel (one canceled before it arrived is refused when it does: the gateway may
bind and cancel in the same moment)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from retouch.functions.errors import Canceled, ExecutorFull
from retouch.runtime.work import Work

CANCELED_IDS = 4096  # cancels that arrived before their invocation, remembered (bounded)


@dataclass
class ExecutorStats:
    queued: int = 0
    completed: int = 0
    failed: int = 0


class Invocations:
    """Live invocations by id, early cancels, and the counts ``/state`` reports. The
    counts change on the event loop thread only; the tables are read by cancels too."""

    def __init__(self, executor: str) -> None:
        self.executor = executor  # named in ``executor_full``
        self.stats = ExecutorStats()
        self._lock = threading.Lock()
        self._live: dict[str, Work] = {}
        self._canceled: OrderedDict[str, None] = OrderedDict()

    def check_room(self, limit: int) -> None:
        """Refuse an invocation beyond ``limit`` (the executor's room): each gateway keeps
        within it for its own invocations, and this keeps several gateways together
        within it."""
        queued = self.stats.queued
        if queued >= limit:
            raise ExecutorFull(
                f"executor {self.executor} holds {queued} invocations, its room",
                detail={"queued": queued, "room": limit},
            )

    def refuse_if_canceled(self, invocation_id: str) -> None:
        """Raise :class:`Canceled` for an invocation whose cancel came first."""
        if not invocation_id:
            return
        with self._lock:
            if invocation_id in self._canceled:
                del self._canceled[invocation_id]
                raise Canceled(f"invocation {invocation_id} was canceled", field="id")

    def add(self, invocation_id: str, work: Work) -> None:
        """Count a submitted invocation (and find it by id, if it has one)."""
        if invocation_id:
            with self._lock:
                self._live[invocation_id] = work
        self.stats.queued += 1

    def finish(self, invocation_id: str, ok: bool | None) -> None:
        """Count an answered invocation (``ok`` None: its waiter went away before the
        answer, counted neither way) and forget its id."""
        if ok is True:
            self.stats.completed += 1
        elif ok is False:
            self.stats.failed += 1
        self.stats.queued -= 1
        if invocation_id:
            with self._lock:
                self._live.pop(invocation_id, None)

    def find(self, invocation_id: str) -> Work | None:
        """The live invocation ``invocation_id``; None (and its id remembered, so that it
        is refused when it comes) when it is not here."""
        with self._lock:
            work = self._live.get(invocation_id)
            if work is None:
                self._canceled[invocation_id] = None
                while len(self._canceled) > CANCELED_IDS:
                    self._canceled.popitem(last=False)
            return work
