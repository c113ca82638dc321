"""The gate every image the gateway decodes passes: header first, then a share of memory.

An encoded image is small and its pixels may be huge (a 130 KB PNG can declare 4096 x 4096
RGBA16: hundreds of MB decoded), so the gateway reads each image's declared size from its
header (no pixel decoded) and refuses it above ``--max-image-pixels`` (``image_too_large``).
Only then is it decoded, and only once it holds a reservation from the
:class:`DecodeBudget`: ``BYTES_PER_PIXEL`` per declared pixel (or per pixel of the size a
decode resizes it to, when larger: a mask resized to its image's), out of
``--decode-memory-bytes`` (by default room for two decodes at the pixel limit:
``platform/api/limits.py``). So however many images arrive at once, the decodes in flight
together stay within the budget; the rest wait their turn in arrival order.

Small images (``INLINE_PIXELS`` or fewer) are decoded on the event loop without a
reservation: 256 x 256 decodes in ~0.4 ms on a 2-core machine, less than the hop to a
worker thread costs when the cores are busy, and the loop decodes them one at a time. Other
work on images (resizing, cropping, pasting an edit back: ``platform/jobs/reframe.py``) follows
the same rule (:meth:`ImageGate.work`).

A request's image work is a run of steps (decode the upload, decode its mask, build the
canvas; later decode both again, paste the edit back and encode it), and what one step
leaves for the next (a decoded upload waiting for its mask: 3 bytes a pixel) would sit
outside the budget while the next step waits for room: six 16-Mpx uploads at once grew a
gateway by 1.3 GiB within a 768 MiB budget, their pastes and held uploads unbudgeted. So
such a run holds one reservation, for its largest image, from its first step to its last
(:meth:`ImageGate.holding`); its steps take none of their own (two runs each holding one
and waiting for a second could wait forever).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from collections import deque
from collections.abc import AsyncIterator, Callable
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


class Hold:
    """A reservation a run of image work holds, returned once the run is over and every
    worker thread it started is done (a thread goes on when its caller is gone)."""

    def __init__(self, budget: DecodeBudget, nbytes: int) -> None:
        self.budget = budget
        self.nbytes = nbytes
        self.running = 0
        self.over = False

    def started(self, work: asyncio.Future) -> None:
        self.running += 1
        work.add_done_callback(self._finished)

    def end(self) -> None:
        self.over = True
        self._release()

    def _finished(self, work: asyncio.Future) -> None:
        self.running -= 1
        if not work.cancelled():
            work.exception()  # retrieved: a caller that left does not get it logged as lost
        self._release()

    def _release(self) -> None:
        if self.over and self.running == 0 and self.nbytes:
            self.budget.release(self.nbytes)
            self.nbytes = 0


_HOLD: contextvars.ContextVar[Hold | None] = contextvars.ContextVar("image_hold", default=None)


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

    @contextlib.asynccontextmanager
    async def holding(self, pixels: int) -> AsyncIterator[None]:
        """One reservation for a run of image work on images of up to ``pixels`` pixels,
        held while the block runs (and any thread it started): the decodes and work inside
        take none of their own. Inside another run's hold, the outer one covers it."""
        if pixels <= INLINE_PIXELS or self._hold() is not None:
            yield
            return
        nbytes = pixels * BYTES_PER_PIXEL
        await self.budget.acquire(nbytes)
        hold = Hold(self.budget, nbytes)
        token = _HOLD.set(hold)
        try:
            yield
        finally:
            _HOLD.reset(token)
            hold.end()

    async def decode(self, declared: Declared, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``, a decode of an image of ``declared`` size: inline when small, else
        on a worker thread once the budget has room for it (or within the run's hold). The
        reservation is held until the thread is done, even when the request that asked for
        it is gone."""
        self.decoded += 1
        if declared.pixels <= INLINE_PIXELS:
            return fn(*args)
        return await self._on_thread(declared.pixels, fn, *args)

    async def work(self, pixels: int, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``, work on images of ``pixels`` pixels that decodes nothing (a
        resize, a paste): inline when small, else on a worker thread, as a decode."""
        if pixels <= INLINE_PIXELS:
            return fn(*args)
        return await self._on_thread(pixels, fn, *args)

    async def _on_thread(self, pixels: int, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a worker thread, within the run's hold or a reservation of its
        own for ``pixels``."""
        loop = asyncio.get_running_loop()
        hold = self._hold()
        if hold is not None:
            work = loop.run_in_executor(None, functools.partial(fn, *args))
            hold.started(work)
            return await asyncio.shield(work)
        nbytes = pixels * BYTES_PER_PIXEL
        await self.budget.acquire(nbytes)
        try:
            work = loop.run_in_executor(None, functools.partial(fn, *args))
        except BaseException:
            self.budget.release(nbytes)
            raise
        work.add_done_callback(functools.partial(self._done, nbytes))
        return await asyncio.shield(work)

    def _hold(self) -> Hold | None:
        """The hold of the run this code is part of, when it is on this gate's budget."""
        hold = _HOLD.get()
        return hold if hold is not None and hold.budget is self.budget else None

    def _done(self, nbytes: int, work: asyncio.Future) -> None:
        self.budget.release(nbytes)
        if not work.cancelled():
            work.exception()  # retrieved: a caller that left does not get it logged as lost
