"""The gateway queue: bounded admission, late binding to free slots, head-of-queue
re-placement, timeouts only when nothing can serve, failure of a deleted function's waiters."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

import pytest

from retouch.functions.errors import GatewayTimeout, NotFound, Overloaded
from retouch.platform.control.cluster import ExecutorView
from retouch.platform.control.placement import LeastRequests, PlacementRequest
from retouch.platform.control.queue import InvocationQueue, QueueLimits


@dataclass
class FakeExecutor:
    name: str
    slots: int = 1
    inflight: int = 0
    functions: set[str] = field(default_factory=lambda: {"f"})
    view: ExecutorView = field(init=False)

    def __post_init__(self) -> None:
        self.view = ExecutorView(self.name, max_batch=self.slots, slots=self.slots)


def sync(test: Callable[..., Coroutine]) -> Callable[..., None]:
    """Run an async test on a fresh event loop (the queue lives on one loop)."""

    @functools.wraps(test)
    def run(*args, **kwargs) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


def make_queue(executors: list[FakeExecutor], **limits) -> InvocationQueue:
    return InvocationQueue(
        QueueLimits(**limits),
        LeastRequests(),
        lambda fn: [e for e in executors if fn in e.functions],
    )


def req(function: str = "f") -> PlacementRequest:
    return PlacementRequest(function, "t", 0.2)


def far() -> float:
    return asyncio.get_running_loop().time() + 3600


@sync
async def test_binds_to_free_slots_and_queues_the_rest() -> None:
    ex = FakeExecutor("a", slots=2)
    queue = make_queue([ex])
    first = await queue.acquire(req(), far())
    second = await queue.acquire(req(), far())
    assert first is second is ex and ex.inflight == 2
    third = asyncio.create_task(queue.acquire(req(), far()))
    await asyncio.sleep(0.01)
    assert not third.done() and len(queue) == 1
    queue.release(ex, 0.5)
    assert await third is ex and len(queue) == 0 and ex.inflight == 2


@sync
async def test_full_queue_refuses_with_retry_hint() -> None:
    ex = FakeExecutor("a", slots=1)
    queue = make_queue([ex], max_queued=2)
    await queue.acquire(req(), far())
    waiting = [asyncio.create_task(queue.acquire(req(), far())) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded) as err:
        queue.admit("f")
    assert err.value.status == 429 and err.value.retry_after_s == queue.retry_after_s() >= 1
    assert queue.stats.rejected == 1
    for task in waiting:
        task.cancel()


@sync
async def test_admitted_invocations_hold_their_place_until_they_wait() -> None:
    """A burst admitted in one tick (its jobs' tasks not yet run) cannot overfill the queue:
    each admission holds a place until its waiter takes it or it is given back."""
    ex = FakeExecutor("a", slots=1)
    queue = make_queue([ex], max_queued=2, max_per_function=2)
    await queue.acquire(req(), far())  # the executor's one slot is taken
    first, second = queue.admit("f"), queue.admit("f")
    with pytest.raises(Overloaded):
        queue.admit("f")  # nothing waits yet, but two places are held
    assert queue.held() == 2 and len(queue) == 0
    waiting = asyncio.create_task(queue.acquire(req(), far(), seat=first))
    await asyncio.sleep(0.01)
    assert queue.held() == 1 and len(queue) == 1  # the seat became a waiter
    with pytest.raises(Overloaded):
        queue.admit("f")
    queue.unseat(second)
    queue.unseat(second)  # giving a place back twice is harmless
    third = queue.admit("f")
    assert queue.held("f") == 1
    queue.unseat(third)
    waiting.cancel()


@sync
async def test_per_function_limit_leaves_other_functions_alone() -> None:
    ex = FakeExecutor("a", slots=1, functions={"f", "g"})
    queue = make_queue([ex], max_queued=10, max_per_function=1)
    await queue.acquire(req(), far())
    waiting = asyncio.create_task(queue.acquire(req(), far()))
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded):
        queue.admit("f")
    queue.admit("g")  # no exception
    waiting.cancel()


@sync
async def test_replaced_invocation_goes_first() -> None:
    ex = FakeExecutor("a", slots=1)
    queue = make_queue([ex])
    await queue.acquire(req(), far())
    normal = asyncio.create_task(queue.acquire(req(), far()))
    await asyncio.sleep(0.01)
    replaced = asyncio.create_task(queue.acquire(req(), far(), front=True))
    await asyncio.sleep(0.01)
    queue.release(ex)
    await asyncio.sleep(0.01)
    assert replaced.done() and not normal.done()
    normal.cancel()


@sync
async def test_waits_for_an_executor_to_appear() -> None:
    executors: list[FakeExecutor] = []
    queue = make_queue(executors, wait_timeout_s=5)
    task = asyncio.create_task(queue.acquire(req(), far()))
    await asyncio.sleep(0.05)
    assert not task.done()
    executors.append(FakeExecutor("restarted"))
    queue.dispatch()  # the pool calls this when an executor becomes ready
    assert (await task).name == "restarted"


@sync
async def test_times_out_only_when_nothing_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("retouch.platform.control.queue.POLL_S", 0.02)
    queue = make_queue([], wait_timeout_s=0.1)
    with pytest.raises(GatewayTimeout):
        await queue.acquire(req(), far())
    busy = FakeExecutor("a", slots=1, inflight=1)  # serves, but has no room
    queue = make_queue([busy], wait_timeout_s=0.1)
    task = asyncio.create_task(queue.acquire(req(), far()))
    await asyncio.sleep(0.3)
    assert not task.done()  # waiting behind work is bounded by the deadline, not this
    task.cancel()
    loop = asyncio.get_running_loop()
    with pytest.raises(GatewayTimeout):
        await queue.acquire(req(), loop.time() + 0.1)


@sync
async def test_deleted_function_fails_its_waiters() -> None:
    ex = FakeExecutor("a", slots=1)
    queue = make_queue([ex])
    await queue.acquire(req(), far())
    task = asyncio.create_task(queue.acquire(req(), far()))
    await asyncio.sleep(0.01)
    queue.fail("f", NotFound("gone", code="function_deleted"))
    with pytest.raises(NotFound):
        await task
    assert len(queue) == 0
