"""An executor's sleep: the device given back without stopping the process.

A scaled-down executor that sleeps keeps what a cold start spends its time on — the
process and its imports, the activation store, its models' profiles and loaded modules —
and gives back only the device (vLLM's sleep mode, level 1). On CUDA, falling asleep moves
every loaded model's modules to pinned host memory, drops the CUDA graphs (their pools
reference the weights' device addresses, which a wake changes) and the device tier's
templates, and empties the allocator's cache; waking copies the modules back and captures
the graphs again before the executor serves. On a CPU the process keeps its weights where
they are: a sleep costs nothing and frees nothing, and a wake is a state change.

Explicit state: ``awake`` → ``falling_asleep`` → ``asleep`` → ``waking`` → ``awake``; one
transition at a time (a second one is refused with 409 ``sleep_in_progress``). The lock
guards the state and counters only; the slow moves run outside it. An executor with
invocations or bakes in hand refuses to sleep (409 ``executor_busy``: the gateway drains it
first); one not awake refuses invocations and deploys (503 ``executor_asleep``; the
gateway places nothing there and re-places what another gateway sent).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from enum import StrEnum
from pathlib import Path
from typing import Protocol

import torch

from retouch.functions.errors import Conflict, Unavailable
from retouch.functions.wire.executor import SleepInfo, SleepMode
from retouch.runtime.mixedlora import drop_stacks
from retouch.runtime.models import ModelCache

log = logging.getLogger(__name__)


class Turn(StrEnum):
    """Where the executor is between awake and asleep (the wire shows awake or asleep)."""

    AWAKE = "awake"
    FALLING_ASLEEP = "falling_asleep"
    ASLEEP = "asleep"
    WAKING = "waking"

    @property
    def words(self) -> str:
        return self.value.replace("_", " ")


class DeviceHolders(Protocol):
    """What besides the models holds device memory: graphs and the device tier."""

    def release_device(self) -> None:
        """Drop what is on the device (graphs, resident templates)."""
        ...

    def retake_device(self) -> None:
        """Rebuild it before serving again (graphs captured again)."""
        ...


def to_host(module: torch.nn.Module) -> None:
    """Move ``module``'s weights into pinned host memory (one copy each, straight from the
    device), so that a wake copies them back asynchronously at the bus's speed."""
    for tensor in (*module.parameters(), *module.buffers()):
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor.data)
        tensor.data = host


def resident_bytes() -> int:
    """This process's resident memory (what a sleeper holds of its host; 0 off Linux)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


class ExecutorSleep:
    """One executor's sleep state and its moves; ``busy`` counts work in hand."""

    def __init__(self, models: ModelCache, holders: DeviceHolders, busy: Callable[[], int]) -> None:
        self.models = models
        self.holders = holders
        self.busy = busy
        self._lock = threading.Lock()  # guards the fields below; never held across a move
        self._turn = Turn.AWAKE
        self._sleeps = self._wakes = 0
        self._last_sleep_ms = self._last_wake_ms = 0.0
        self._freed = self._host = 0
        self._kept = 0  # slow work (deploys) under way that keeps the executor awake

    @property
    def turn(self) -> Turn:
        return self._turn

    def info(self) -> SleepInfo:
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> SleepInfo:
        """The state as ``/state`` reports it (the caller holds the lock)."""
        asleep = self._turn is not Turn.AWAKE
        return SleepInfo(
            mode=SleepMode.ASLEEP if asleep else SleepMode.AWAKE,
            sleeps=self._sleeps,
            wakes=self._wakes,
            last_sleep_ms=self._last_sleep_ms,
            last_wake_ms=self._last_wake_ms,
            freed_bytes=self._freed,
            host_bytes=self._host,
        )

    @contextlib.contextmanager
    def awake(self) -> Iterator[None]:
        """Hold the executor awake while work is handed to it (cheap: a submit), so that a
        sleep's busy check sees that work; raises 503 ``executor_asleep`` otherwise."""
        with self._lock:
            self._refuse_unless_awake()
            yield

    @contextlib.contextmanager
    def kept_awake(self) -> Iterator[None]:
        """Slow work that needs the device (a deploy: loads, profiles, graph captures):
        refused unless awake, and counted while it runs so that a sleep refuses meanwhile
        (the lock is held only to count)."""
        with self._lock:
            self._refuse_unless_awake()
            self._kept += 1
        try:
            yield
        finally:
            with self._lock:
                self._kept -= 1

    def _refuse_unless_awake(self) -> None:
        if self._turn is not Turn.AWAKE:
            raise Unavailable(
                f"the executor is {self._turn.words}: it serves after a wake",
                code="executor_asleep",
            )

    def sleep(self) -> SleepInfo:
        """Give the device back (see the module's docstring); a no-op when asleep."""
        with self._lock:
            if self._turn is Turn.ASLEEP:
                return self._snapshot()
            self._check_idle_turn("sleep")
            work = self.busy() + self._kept
            if work:
                raise Conflict(
                    f"the executor has {work} invocations or bakes in hand: drain it first",
                    code="executor_busy",
                )
            self._turn = Turn.FALLING_ASLEEP
        started = time.perf_counter()
        try:
            freed = self._give_back()
        except BaseException:
            log.exception("falling asleep failed: taking the device back")
            try:
                self._take_back()
            finally:  # awake again whatever happened: never stuck between the two
                with self._lock:
                    self._turn = Turn.AWAKE
            raise
        took = (time.perf_counter() - started) * 1e3
        with self._lock:
            self._turn = Turn.ASLEEP
            self._sleeps += 1
            self._last_sleep_ms, self._freed, self._host = took, freed, resident_bytes()
            log.info("asleep in %.0f ms (%d bytes of device memory given back)", took, freed)
            return self._snapshot()

    def wake(self) -> SleepInfo:
        """Take the device back and serve again; a no-op when awake. A wake that fails
        leaves the executor asleep (the gateway stops it and starts another)."""
        with self._lock:
            if self._turn is Turn.AWAKE:
                return self._snapshot()
            self._check_idle_turn("wake")
            self._turn = Turn.WAKING
        started = time.perf_counter()
        try:
            self._take_back()
        except BaseException:
            with self._lock:
                self._turn = Turn.ASLEEP
            raise
        took = (time.perf_counter() - started) * 1e3
        with self._lock:
            self._turn = Turn.AWAKE
            self._wakes += 1
            self._last_wake_ms = took
            log.info("awake in %.0f ms", took)
            return self._snapshot()

    def _check_idle_turn(self, what: str) -> None:
        if self._turn in (Turn.FALLING_ASLEEP, Turn.WAKING):
            raise Conflict(
                f"cannot {what}: the executor is {self._turn.words}",
                code="sleep_in_progress",
            )

    # ---- the moves (outside the lock) ---------------------------------------------------
    def _give_back(self) -> int:
        device = self.models.device
        if device.type != "cuda":
            return 0  # a CPU's weights are the process's memory: nothing to give back
        before = torch.cuda.memory_reserved(device)
        self.holders.release_device()
        for module in self._modules():
            drop_stacks(module)  # mixed-adapter stacks: device tensors outside the parameters
            to_host(module)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return max(0, before - torch.cuda.memory_reserved(device))

    def _take_back(self) -> None:
        device = self.models.device
        if device.type != "cuda":
            return
        for module in self._modules():
            module.to(device, non_blocking=True)
        torch.cuda.synchronize(device)
        self.holders.retake_device()

    def _modules(self) -> Iterator[torch.nn.Module]:
        """Every loaded model's modules (their functions' pipelines share them)."""
        for loaded in self.models.resident():
            for module in loaded.pipe.components.values():
                if isinstance(module, torch.nn.Module):
                    yield module
