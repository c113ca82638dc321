"""The gateway decodes a large mask off its event loop: other invocations go on meanwhile."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from retouch.functions.imaging import encode_mask
from retouch.platform import frontdoor


def test_a_small_mask_is_decoded_while_a_large_one_is_still_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = frontdoor._decode_mask
    release = threading.Event()
    large = (1024, 1024)

    def slow_for_large(data: bytes, size: tuple[int, int], halo: int = 0):
        if size == large:  # stands for a decode that takes long: held until released
            assert release.wait(10), "the large decode was never released"
        return real(data, size, halo)

    monkeypatch.setattr(frontdoor, "_decode_mask", slow_for_large)

    async def scenario() -> None:
        big = asyncio.create_task(
            frontdoor.decode_mask_off_loop(encode_mask(np.ones(large, bool)), large)
        )
        await asyncio.sleep(0)  # the large decode has started (on its thread)
        small = np.zeros((64, 64), bool)
        small[:32] = True
        # Were the large decode on the loop, this would never run before it is released.
        mask, footprint = await asyncio.wait_for(
            frontdoor.decode_mask_off_loop(encode_mask(small), (64, 64)), 5
        )
        assert not big.done() and footprint.ratio == pytest.approx(0.5)
        release.set()
        mask, footprint = await asyncio.wait_for(big, 10)
        assert mask.shape == (1024, 1024) and footprint.ratio == pytest.approx(1.0)

    asyncio.run(scenario())
