"""The executor's change feed (what the gateway's cluster view follows) and the GPU list
the local provider starts executors on."""

from __future__ import annotations

import asyncio
import threading

import pytest

from retouch.functions.wire.executor import ChangeKind, ExecutorChanges
from retouch.platform.fleet.providers import gpu_devices
from retouch.runtime.executor.changes import ChangeFeed


def test_events_after_a_version_in_order():
    feed = ChangeFeed()
    feed.publish(ChangeKind.BAKED, "f", "t0")
    feed.publish(ChangeKind.HOST_TIER, "f", "t1")
    got = feed.since(0)
    assert got.version == 2 and not got.reset
    assert [(c.version, c.kind, c.template) for c in got.changes] == [
        (1, ChangeKind.BAKED, "t0"),
        (2, ChangeKind.HOST_TIER, "t1"),
    ]
    assert feed.since(1).changes[0].template == "t1"
    assert feed.since(2).changes == ()


def test_a_reader_that_fell_behind_or_outlived_a_restart_is_told_to_reset():
    feed = ChangeFeed(history=2)
    for i in range(4):
        feed.publish(ChangeKind.BAKED, "f", f"t{i}")
    assert feed.since(0).reset  # events 1 and 2 are gone
    assert not feed.since(2).reset
    assert ChangeFeed().since(7).reset  # a new executor process counts from 0 again


def test_wire_round_trip():
    feed = ChangeFeed()
    feed.publish(ChangeKind.BAKE_FAILED, "f", "t")
    got = feed.since(0)
    assert ExecutorChanges.from_wire(got.to_wire()) == got


def test_a_waiter_wakes_on_a_change_published_on_another_thread():
    feed = ChangeFeed()

    async def main() -> ExecutorChanges:
        waiting = asyncio.create_task(feed.wait(0, timeout_s=30))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        threading.Thread(target=feed.publish, args=(ChangeKind.BAKED, "f", "t")).start()
        return await asyncio.wait_for(waiting, 5)

    got = asyncio.run(main())
    assert [c.kind for c in got.changes] == [ChangeKind.BAKED]


def test_a_wait_with_nothing_new_ends_at_its_timeout_empty():
    got = asyncio.run(ChangeFeed().wait(0, timeout_s=0.05))
    assert got.changes == () and got.version == 0 and not got.reset


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        ("", []),
        ("-1", []),
        ("3,1", ["cuda:0", "cuda:1"]),  # torch renumbers the visible GPUs from 0
        ("0,-1,2", ["cuda:0"]),  # torch stops at the first invalid entry
    ],
)
def test_cuda_visible_devices_decides_the_gpus(monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert gpu_devices() == expected


def test_close_answers_open_polls_at_once_so_shutdown_need_not_wait():
    feed = ChangeFeed()

    async def main() -> tuple[ExecutorChanges, ExecutorChanges]:
        waiting = asyncio.create_task(feed.wait(0, timeout_s=30))
        await asyncio.sleep(0.05)
        feed.close()
        # at once: well before the polls' own 30 s, however loaded the machine
        first = await asyncio.wait_for(waiting, 5)
        later = await asyncio.wait_for(feed.wait(0, timeout_s=30), 5)
        return first, later

    first, later = asyncio.run(main())
    assert first.changes == () and later.changes == ()
