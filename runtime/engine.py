"""The engine thread: the only thread of an executor that runs the model.

Invocations run before background work (bakes): a bake never delays an edit that is
already waiting, and a template invoked before its bake finished is served by the stock
path meanwhile. Jobs are plain callables; their results come back as futures.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

log = logging.getLogger(__name__)


class Priority(IntEnum):
    INVOKE = 0
    BACKGROUND = 1


_STOP = 99  # after every queued job


@dataclass(order=True)
class _Job:
    priority: int
    seq: int
    fn: Callable[[], Any] | None = field(compare=False)
    future: Future = field(compare=False)


class Engine:
    def __init__(self, name: str = "engine") -> None:
        self._queue: queue.PriorityQueue[_Job] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        self.waiting = {Priority.INVOKE: 0, Priority.BACKGROUND: 0}

    def submit(self, fn: Callable[[], Any], priority: Priority = Priority.INVOKE) -> Future:
        future: Future = Future()
        self.waiting[priority] += 1
        self._queue.put(_Job(int(priority), next(self._seq), fn, future))
        return future

    def stop(self) -> None:
        self._queue.put(_Job(_STOP, next(self._seq), None, Future()))  # sorts last

    def _loop(self) -> None:
        while (job := self._queue.get()).fn is not None:
            self.waiting[Priority(job.priority)] -= 1
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(job.fn())  # type: ignore[misc]
            except BaseException as exc:
                job.future.set_exception(exc)
