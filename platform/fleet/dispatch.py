"""Dispatch: admission, the gateway queue, and each invocation's trip to an executor.

Every invocation waits in the gateway queue until an executor of the fleet has room (late
binding, see ``control/queue.py``), is sent on that executor's streaming endpoint (so the
engine's step progress reaches the caller as it happens), and its outcome teaches the
control plane's view of the executor (calibration, residency, prediction error).

Nothing accepted is lost: edits are deterministic, so an invocation whose executor died or
became unreachable mid-run is queued again (at the head) and re-run on another executor,
or on the same one once restarted, within a bounded number of attempts and its deadline.
An invocation with an id can be canceled, in the queue or on its executor.

An executor shared with other gateways may refuse an invocation as full (429
``executor_full``): that is not an attempt, the invocation was never placed. It goes back
to the head of the queue and the executor pauses (:meth:`Fleet.refused`); the client never
sees the refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import httpx

from retouch.functions.errors import (
    Canceled,
    ExecutorFull,
    GatewayTimeout,
    NotFound,
    RetouchError,
    Unavailable,
)
from retouch.functions.spec import FunctionSpec
from retouch.functions.wire.executor import FrameReader, StepProgress
from retouch.functions.wire.invoke import CacheTier, ExecutorInvoke, InvokePath, InvokeResult
from retouch.platform.control.cluster import Placed, PlacementRequest
from retouch.platform.control.placement import Placement, make_placement
from retouch.platform.control.queue import InvocationQueue, QueueLimits, Seat
from retouch.platform.fleet.executorlink import ExecutorHandle, ExecutorLink
from retouch.platform.fleet.fleet import Fleet

log = logging.getLogger(__name__)

RECALIBRATE_ERROR = 0.15  # a prediction this far off re-reads the executor's step fit
# Executor answers that mean "this executor lost the invocation; it never finished here".
LOST_CODES = frozenset({"engine_dead", "engine_unavailable"})
FULL_CODE = ExecutorFull.code  # "the executor has no room for it; it never started here"
# refusals before the invocation started: it goes back to the queue, not an attempt (an
# executor asleep was put to sleep by another gateway sharing it)
NOT_PLACED_CODES = frozenset({FULL_CODE, "executor_asleep"})

OnStart = Callable[[str, int], None]  # (executor name, attempt): an executor took the invocation
OnProgress = Callable[[StepProgress], None]


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3  # executors an invocation may be sent to
    invoke_timeout_s: float = 600.0  # an invocation's whole life in the gateway


@dataclass
class DispatchStats:
    """Recent admission times and prediction errors, for ``/metrics`` and the benches."""

    admission_s: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    prediction_error: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    # from a request's arrival at the gateway (its headers) to its 429 on arrival, as the
    # front door times it: a refusal after decoding includes reading the body, i.e. the
    # client's upload
    refusal_s: deque[float] = field(default_factory=lambda: deque(maxlen=4096))


class ExecutorLost(Exception):
    """The executor died, stopped or became unreachable while it held an invocation."""


class NotPlaced(Exception):
    """The executor refused the invocation as full before starting it (429 executor_full)."""


class Dispatcher:
    """Admission, queueing, sending, retrying and learning (event-loop state, no lock)."""

    def __init__(
        self,
        fleet: Fleet,
        link: ExecutorLink,
        placement: Placement,
        limits: QueueLimits | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.fleet = fleet
        self.link = link
        self.retry = retry or RetryPolicy()
        self.placements: dict[str, Placement] = {}  # per function, where its spec names one
        self.queue = InvocationQueue(
            limits or QueueLimits(), placement, fleet.candidates, policy_of=self.policy
        )
        self.lost = 0  # invocations re-placed after their executor was lost
        self.stats = DispatchStats()
        # Invocations with an id while they run: the executor holding each (None while
        # queued), and the ids whose cancel was asked for.
        self._active: dict[str, ExecutorHandle | None] = {}
        self._cancels: set[str] = set()

    @property
    def placement(self) -> Placement:
        return self.queue.placement

    def policy(self, function: str) -> Placement:
        """The placement policy of ``function``: its own, or the server's."""
        return self.placements.get(function, self.queue.placement)

    def deployed(self, spec: FunctionSpec) -> None:
        """A function was deployed (or replaced): its own placement policy, if it names one."""
        if spec.placement:
            self.placements[spec.name] = make_placement(spec.placement)
        else:
            self.placements.pop(spec.name, None)

    def deleted(self, name: str) -> None:
        """A function was deleted: invocations still waiting for it fail."""
        self.placements.pop(name, None)
        self.queue.fail(
            name, NotFound(f"function {name!r} was deleted", field="name", code="function_deleted")
        )

    # ---- admission ----------------------------------------------------------------------
    def check(self, function: str) -> None:
        """429 ``overloaded`` when the queue is full (nothing held: the check on arrival)."""
        self.queue.check(function)

    def admit(self, function: str) -> Seat:
        """429 ``overloaded`` when the queue is full, else a place in it held for this
        invocation until :meth:`invoke` queues it or :meth:`unseat` gives it back."""
        return self.queue.admit(function)

    def unseat(self, seat: Seat) -> None:
        self.queue.unseat(seat)

    def admit_slo(self, request: PlacementRequest, *, early: bool = False) -> None:
        """429 ``slo_unattainable`` when ``request`` is predicted to miss its SLO. Every
        decoded invocation passes here (refused or not): its demand is counted first."""
        if not early:
            self.fleet.arrive(request)
        started = time.perf_counter()
        try:
            self.queue.admit_slo(request, early=early)
        finally:
            self.stats.admission_s.append(time.perf_counter() - started)

    def queue_positions(self) -> dict[str, int]:
        """Waiting invocations (by id) and how many wait ahead of each."""
        return self.queue.positions()

    async def cancel(self, invocation_id: str) -> bool:
        """Cancel a running invocation: out of the queue when it waits there, else out of
        its executor's batch at the next step. False when it is not running here."""
        if invocation_id not in self._active:
            return False
        self._cancels.add(invocation_id)
        if self.queue.cancel(invocation_id):
            return True
        handle = self._active.get(invocation_id)
        if handle is not None:
            with contextlib.suppress(RetouchError, httpx.HTTPError):
                path = f"/invocations/{invocation_id}/cancel"
                await self.link.call(handle, "POST", path, probe=True)
        return True

    # ---- invocations --------------------------------------------------------------------
    async def invoke(
        self,
        inv: ExecutorInvoke,
        request: PlacementRequest,
        on_start: OnStart | None = None,
        on_progress: OnProgress | None = None,
        seat: Seat | None = None,
    ) -> InvokeResult:
        """Run one invocation: wait for a slot, send it, and re-place it when its executor
        is lost (up to ``max_attempts`` executors, within ``invoke_timeout_s``).
        ``on_start`` hears each time an executor takes it, ``on_progress`` each step;
        ``seat``: the place its admission held, which its waiter takes (the front door
        gives back one never taken when the job ends)."""
        if inv.id:
            self._active[inv.id] = None
        try:
            return await self._invoke(inv, request, on_start, on_progress, seat)
        finally:
            if inv.id:
                self._active.pop(inv.id, None)
                self._cancels.discard(inv.id)

    def _check_canceled(self, inv: ExecutorInvoke) -> None:
        if inv.id and inv.id in self._cancels:
            raise Canceled(f"invocation {inv.id} was canceled")

    async def _invoke(
        self,
        inv: ExecutorInvoke,
        request: PlacementRequest,
        on_start: OnStart | None,
        on_progress: OnProgress | None,
        seat: Seat | None,
    ) -> InvokeResult:
        deadline = time.monotonic() + self.retry.invoke_timeout_s
        service_s = self.queue.service_s(request)
        lost_on: list[str] = []
        refused = False  # the last executor it was bound to refused it as full
        queued_s = 0.0
        while True:
            self._check_canceled(inv)
            enqueued = time.monotonic()
            token = self.fleet.cluster.token()
            handle = await self.queue.acquire(
                request,
                deadline,
                front=bool(lost_on),
                tag=inv.id or None,
                token=token,
                service_s=service_s,
                seat=seat,
                refused=refused,
            )
            bound = time.monotonic()
            placed = handle.view.placed.get(token)
            queued_s += bound - enqueued
            try:
                self._check_canceled(inv)  # canceled between binding and this line
                if inv.id:
                    self._active[inv.id] = handle
                attempt = len(lost_on) + 1
                started = None if on_start is None else partial(on_start, handle.name, attempt)
                result = await self._send(handle, inv, deadline, on_progress, token, started)
            except NotPlaced:
                self.queue.release(handle, token=token)
                if inv.id:
                    self._active[inv.id] = None  # back in the queue
                self.fleet.refused(handle)
                refused = True
                continue
            except ExecutorLost as exc:
                self.queue.release(handle, token=token)
                if inv.id:
                    self._active[inv.id] = None  # back in the queue
                lost_on.append(handle.name)
                refused = False
                self.lost += 1
                if len(lost_on) >= self.retry.max_attempts:
                    raise Unavailable(
                        f"the invocation was lost with its executor {len(lost_on)} times "
                        f"({', '.join(lost_on)}); last: {exc}",
                        code="executor_lost",
                    ) from None
                log.warning("%s lost an invocation (%s); re-placing it", handle.name, exc)
                continue
            except BaseException:
                self.queue.release(handle, token=token)
                raise
            result.timings.placed_ms = (time.monotonic() - bound) * 1e3
            self._learn(handle, token, result, placed)
            self.queue.release(handle, time.monotonic() - bound, token=token)
            result.attempts = len(lost_on) + 1
            result.timings.gateway_queue_ms = queued_s * 1e3
            return result

    def _learn(
        self,
        handle: ExecutorHandle,
        token: int,
        result: InvokeResult,
        placed: Placed | None,
    ) -> None:
        """Completion: the view learns (calibration, residency), the prediction is scored,
        and the executor's state is re-read when the store changed (a bake, a new host
        resident)."""
        error = handle.view.finish(token, time.monotonic(), result)
        if placed is not None:
            result.timings.predicted_ms = placed.predicted.finish_s * 1e3
            if placed.predicted.finish_s > 0 and result.timings.placed_ms > 0:
                self.queue.observe_outcome(result.timings.placed_ms / result.timings.predicted_ms)
        if error is not None:
            self.stats.prediction_error.append(error)
        if result.path is InvokePath.TEMPLATE:
            return  # no model run: neither the store nor the step fit changed
        stale = error is not None and error > RECALIBRATE_ERROR  # the executor's fit moved
        if (
            stale
            or result.path is InvokePath.STOCK
            or result.cache.tier not in (CacheTier.HOST, CacheTier.DEVICE)
        ):
            self.fleet.refresh_soon(handle)

    async def _send(
        self,
        handle: ExecutorHandle,
        inv: ExecutorInvoke,
        deadline: float,
        on_progress: OnProgress | None = None,
        token: int = -1,
        on_accepted: Callable[[], None] | None = None,
    ) -> InvokeResult:
        timeout = max(0.1, deadline - time.monotonic())
        try:
            async with asyncio.timeout(timeout):
                return await self._stream(handle, inv, on_progress, token, on_accepted)
        except (httpx.TimeoutException, TimeoutError):
            raise GatewayTimeout(
                f"{handle.name} did not answer before the invocation's deadline", code="timeout"
            ) from None
        except httpx.TransportError as exc:
            self.fleet.suspect(handle, f"transport error: {exc!r}")
            raise ExecutorLost(f"{type(exc).__name__} talking to {handle.name}") from exc
        except RetouchError as exc:
            if exc.code in LOST_CODES:
                self.fleet.suspect(handle, exc.message)
                raise ExecutorLost(exc.message) from exc
            if exc.code in NOT_PLACED_CODES:
                log.debug("%s is full: %s", handle.name, exc.message)
                raise NotPlaced(exc.message) from exc
            raise

    async def _stream(
        self,
        handle: ExecutorHandle,
        inv: ExecutorInvoke,
        on_progress: OnProgress | None,
        token: int = -1,
        on_accepted: Callable[[], None] | None = None,
    ) -> InvokeResult:
        """Step frames, then the result or the error; ``on_accepted`` hears that the
        executor took the invocation (an answer that is no refusal)."""
        reader = FrameReader()
        answer: InvokeResult | RetouchError | None = None
        async with self.link.stream(handle, inv) as resp:
            if on_accepted is not None:
                on_accepted()
            # The answer is the stream's last frame: the stream is read to its end so that
            # its connection goes back to the pool (left unread, it is closed and the next
            # invocation pays a new TCP connection, ~0.2 ms of the gateway's overhead).
            async for chunk in resp.aiter_bytes():
                for frame in reader.feed(chunk):
                    if isinstance(frame, StepProgress):
                        handle.view.progress(token, frame.step, frame.total)
                        if frame.step >= frame.total - 1 and len(self.queue):
                            # Batch room opens within a step: a late-bound invocation
                            # is bound now (the prefetch horizon), so its encode
                            # overlaps the last step instead of following the decode.
                            self.queue.dispatch()
                        if on_progress is not None:
                            on_progress(frame)
                    else:
                        answer = frame
        if isinstance(answer, InvokeResult):
            return answer
        if answer is not None:
            raise answer
        raise ExecutorLost(f"{handle.name} ended the invocation stream without an answer")
