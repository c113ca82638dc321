"""The gate every image the gateway decodes passes: header first, then a share of memory.

An encoded image is small and its pixels may be huge (a 130 KB PNG can declare 4096 x 4096
RGBA16: hundreds of MB decoded), so the gateway reads each image's declared size from its
header (no pixel decoded) and refuses it above ``--max-image-pixels`` (``image_too_large``).
Only then is it decoded, and only once it holds a reservation from the
:class:`DecodeBudget`: ``BYTES_PER_PIXEL`` per declared pixel (or per pixel of the size a
decode resizes it to, when larger: a mask resized to its image's), out of
``--decode-memory-bytes`` (by default room for two decodes at the pixel limit:
``platform/limits.py``). So however many images arrive at once, the decodes in flight
together stay within the budget; the rest wait their turn in arrival order.

Small images (``INLINE_PIXELS`` or fewer) are decoded on the event loop without a
reservation: 256 x 256 decodes in ~0.4 ms on a 2-core machine, less than the hop to a
worker thread costs when the cores are busy, and the loop decodes them one at a time. Other
work on images (resizing, cropping, pasting an edit back: ``platform/reframe.py``) follows
the same rule (:meth:`ImageGate.work`).
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from retouch.functions.imaging import MAX_PIXELS, declared_size

T = TypeVar("T")

# The most one decode took per declared pixel, measured as peak RSS growth of decodes of
# 2048 x 2048 PNGs: 23 B/px for a 16-bit greyscale mask (read through float64), 10-14 B/px
# for RGB and RGBA images and masks.
BYTES_PER_PIXEL = 24
INLINE_PIXELS = 256 * 256


@dataclass(frozen=True)
class Declared:
    """What an image's header declares."""

    width: int
    height: int

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height

    @property
    def pixels(self) -> int:
        return self.width * self.height


class DecodeBudget:
    """A semaphore counted in bytes: reservations granted in arrival order while they fit.
    A reservation above the whole budget is cut to it (that decode runs alone)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"decode budget must be positive, got {capacity}")
        self.capacity = capacity
        self.in_use = 0
        self.peak = 0  # the most reserved at once since start
        self.waited = 0  # reservations that queued, since start
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def cost(self, nbytes: int) -> int:
        return min(nbytes, self.capacity)

    async def acquire(self, nbytes: int) -> None:
        """Wait until ``cost(nbytes)`` fits (after everyone who waited before)."""
        nbytes = self.cost(nbytes)
        if not self._waiters and self.in_use + nbytes <= self.capacity:
            self._take(nbytes)
            return
        self.waited += 1
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (nbytes, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # granted as it was canceled
                self.release(nbytes)
            else:
                self._waiters.remove(entry)
                self._grant()
            raise

    def release(self, nbytes: int) -> None:
        self.in_use -= self.cost(nbytes)
        self._grant()

    def _take(self, nbytes: int) -> None:
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)

    def _grant(self) -> None:
        while self._waiters and self.in_use + self._waiters[0][0] <= self.capacity:
            nbytes, waiter = self._waiters.popleft()
            self._take(nbytes)
            waiter.set_result(None)


class ImageGate:
    """Header checks and budgeted decodes for every image a request carries."""

    def __init__(self, max_pixels: int, budget: DecodeBudget) -> None:
        if not 1 <= max_pixels <= MAX_PIXELS:  # the decoders refuse more whatever is set
            raise ValueError(f"max_image_pixels must be in [1, {MAX_PIXELS}], got {max_pixels}")
        self.max_pixels = max_pixels
        self.budget = budget
        self.decoded = 0  # decodes run (inline or on a thread), since start

    def declare(self, data: bytes, field: str) -> Declared:
        """The header's size, refused (400 naming ``field``) when it is not an image or
        above ``max_pixels``; no pixel is decoded."""
        return Declared(*declared_size(data, field, self.max_pixels))

    async def decode(self, declared: Declared, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``, a decode of an image of ``declared`` size: inline when small, else
        on a worker thread once the budget has room for it. The reservation is held until
        the thread is done, even when the request that asked for it is gone."""
        self.decoded += 1
        if declared.pixels <= INLINE_PIXELS:
            return fn(*args)
        nbytes = declared.pixels * BYTES_PER_PIXEL
        await self.budget.acquire(nbytes)
        try:
            work = asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))
        except BaseException:
            self.budget.release(nbytes)
            raise
        work.add_done_callback(functools.partial(self._done, nbytes))
        return await asyncio.shield(work)

    async def work(self, pixels: int, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``, work on images of ``pixels`` pixels that decodes nothing (a
        resize, a paste): inline when small, else on a worker thread."""
        if pixels <= INLINE_PIXELS:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

    def _done(self, nbytes: int, work: asyncio.Future) -> None:
        self.budget.release(nbytes)
        if not work.cancelled():
            work.exception()  # retrieved: a caller that left does not get it logged as lost
