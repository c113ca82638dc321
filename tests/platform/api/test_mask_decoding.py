"""The gateway's image gate: a large mask is decoded off the event loop (other invocations
go on meanwhile), and decodes in flight stay within the decode budget, granted in arrival
order, a canceled request's reservation held until its thread is done; a request's run of
image work holds one reservation from its first step to its last."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import numpy as np
import pytest

from retouch.functions.errors import BadRequest
from retouch.functions.imaging import encode_mask
from retouch.platform.api import frontdoor
from retouch.platform.api.imagegate import BYTES_PER_PIXEL, Declared, DecodeBudget, ImageGate


def door(gate: ImageGate) -> frontdoor.FrontDoor:
    """The front door's mask decoding alone (it needs none of the rest)."""
    fd = frontdoor.FrontDoor.__new__(frontdoor.FrontDoor)
    fd.images = gate
    return fd


def test_a_small_mask_is_decoded_while_a_large_one_is_still_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = frontdoor._decode_mask
    release = threading.Event()
    large = (1024, 1024)

    def slow_for_large(data: bytes, size: tuple[int, int]):
        if size == large:  # stands for a decode that takes long: held until released
            assert release.wait(10), "the large decode was never released"
        return real(data, size)

    monkeypatch.setattr(frontdoor, "_decode_mask", slow_for_large)
    front = door(ImageGate(4096 * 4096, DecodeBudget(1 << 30)))

    async def scenario() -> None:
        big = asyncio.create_task(front.decode_mask(encode_mask(np.ones(large, bool)), large))
        await asyncio.sleep(0.05)  # the large decode has started (on its thread)
        small = np.zeros((64, 64), bool)
        small[:32] = True
        # Were the large decode on the loop, this would never run before it is released.
        mask = await asyncio.wait_for(front.decode_mask(encode_mask(small), (64, 64)), 5)
        assert not big.done() and mask.mean() == pytest.approx(0.5)
        release.set()
        mask = await asyncio.wait_for(big, 10)
        assert mask.shape == (1024, 1024) and mask.all()

    asyncio.run(scenario())


def test_a_small_mask_resized_to_a_large_image_is_resized_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 64 x 64 mask for a 2048 x 1536 image: resized to the image's size (as diffusers'
    mask processor does) on a worker thread, holding a reservation for the larger size."""
    gate = ImageGate(4096 * 4096, DecodeBudget(1 << 30))
    small = np.zeros((64, 64), bool)
    small[16:48, 16:48] = True
    threads: list[int] = []
    real = frontdoor._decode_mask

    def spy(data: bytes, size: tuple[int, int]) -> np.ndarray:
        threads.append(threading.get_ident())
        return real(data, size)

    monkeypatch.setattr(frontdoor, "_decode_mask", spy)
    mask = asyncio.run(door(gate).decode_mask(encode_mask(small), (2048, 1536)))
    assert mask.shape == (1536, 2048) and mask.mean() == pytest.approx(0.25, abs=0.01)
    assert threads == [t for t in threads if t != threading.get_ident()] != []
    assert gate.budget.peak == 2048 * 1536 * BYTES_PER_PIXEL


def test_decodes_in_flight_stay_within_the_budget_in_arrival_order() -> None:
    side = 512
    cost = side * side * BYTES_PER_PIXEL
    gate = ImageGate(4096 * 4096, DecodeBudget(2 * cost))  # room for two at once
    running: list[int] = []
    most = 0
    order: list[int] = []
    lock = threading.Lock()

    def decode(i: int) -> int:
        nonlocal most
        with lock:
            running.append(i)
            most = max(most, len(running))
            order.append(i)
        threading.Event().wait(0.05)
        with lock:
            running.remove(i)
        return i

    async def scenario() -> list[int]:
        return await asyncio.gather(
            *(gate.decode(Declared(side, side), decode, i) for i in range(8))
        )

    assert asyncio.run(scenario()) == list(range(8))
    assert most == 2 and gate.budget.peak == 2 * cost and gate.budget.in_use == 0
    assert order[:2] == [0, 1] and sorted(order) == list(range(8)) and gate.budget.waited == 6
    assert gate.decoded == 8


async def _decode_alone(gate: ImageGate, side: int, blocking: Callable[[], object]) -> None:
    await gate.decode(Declared(side, side), blocking)


async def _work_in_a_run(gate: ImageGate, side: int, blocking: Callable[[], object]) -> None:
    async with gate.holding(side * side):
        await gate.work(side * side, blocking)


@pytest.mark.parametrize("first_work", [_decode_alone, _work_in_a_run], ids=["decode", "run"])
def test_a_canceled_request_keeps_its_reservation_until_its_thread_ends(first_work) -> None:
    """A decode's own reservation, or a run's hold, outlives its caller while the thread
    it started runs on."""
    side = 512
    gate = ImageGate(4096 * 4096, DecodeBudget(side * side * BYTES_PER_PIXEL))
    release = threading.Event()

    async def scenario() -> None:
        first = asyncio.create_task(first_work(gate, side, lambda: release.wait(10)))
        await asyncio.sleep(0.05)
        first.cancel()  # the client left; its thread runs on
        second = asyncio.create_task(gate.decode(Declared(side, side), lambda: "second"))
        await asyncio.sleep(0.05)
        assert not second.done() and gate.budget.in_use == gate.budget.capacity
        release.set()
        assert await asyncio.wait_for(second, 5) == "second"
        assert gate.budget.in_use == 0

    asyncio.run(scenario())


def test_a_run_of_image_work_holds_one_reservation_from_its_first_step_to_its_last() -> None:
    """Three runs (a decode, then work on what it left) with room for one: each runs whole
    before the next starts, so what a step leaves for the next is within the budget too,
    and the steps inside take no reservation of their own (none waits for a second)."""
    side = 512
    cost = side * side * BYTES_PER_PIXEL
    gate = ImageGate(4096 * 4096, DecodeBudget(cost))
    inside: list[int] = []
    most = 0

    def step(i: int) -> int:
        threading.Event().wait(0.02)
        return i

    async def run(i: int) -> int:
        nonlocal most
        async with gate.holding(side * side):
            inside.append(i)
            most = max(most, len(inside))
            decoded = await gate.decode(Declared(side, side), step, i)
            await asyncio.sleep(0.02)  # between steps: another run must not start
            done = await gate.work(side * side, step, decoded)
            inside.remove(i)
        return done

    async def scenario() -> list[int]:
        return await asyncio.wait_for(asyncio.gather(*(run(i) for i in range(3))), 10)

    assert asyncio.run(scenario()) == [0, 1, 2]
    assert most == 1 and gate.budget.peak == cost and gate.budget.in_use == 0
    assert gate.budget.waited == 2 and gate.decoded == 3


def test_large_work_outside_a_run_takes_a_reservation_as_a_decode_does() -> None:
    side = 1024
    gate = ImageGate(4096 * 4096, DecodeBudget(1 << 30))
    assert asyncio.run(gate.work(side * side, lambda: "pasted")) == "pasted"
    assert gate.budget.peak == side * side * BYTES_PER_PIXEL and gate.budget.in_use == 0


def test_one_decode_above_the_whole_budget_runs_alone() -> None:
    budget = DecodeBudget(1000)

    async def scenario() -> None:
        await budget.acquire(10**9)
        assert budget.in_use == 1000
        budget.release(10**9)
        assert budget.in_use == 0

    asyncio.run(scenario())


def test_headers_above_the_pixel_limit_are_refused_before_decoding() -> None:
    gate = ImageGate(256 * 256, DecodeBudget(1 << 20))
    with pytest.raises(BadRequest) as refused:
        gate.declare(encode_mask(np.ones((300, 300), bool)), "mask")
    assert refused.value.code == "image_too_large" and refused.value.field == "mask"
    assert gate.declare(encode_mask(np.ones((256, 256), bool)), "mask") == Declared(256, 256)
    with pytest.raises(ValueError, match="max_image_pixels"):
        ImageGate(4096 * 4096 + 1, DecodeBudget(1))
