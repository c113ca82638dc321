"""An executor's start, phase by phase: what its cold start costs and where it goes.

A serverless pool pays an executor's start on the request path whenever it scales up, so
its parts are measured where they happen and reported with the executor's state
(``/state``'s ``startup_ms`` and ``model_startup_ms``; the gateway's ``/v1/executors`` and
``retouch_executor_startup_seconds``):

* ``process``: from the process's creation to its entry point (the interpreter and the
  imports; near 0 for an executor forked from the warm fork server, ``runtime/zygote.py``);
* ``store``: the activation store opened; ``workers``: its pre/post worker processes
  started; ``listening``: from the process's creation until it listens;
* per model: ``weights`` (its files read into their final dtype on the device), ``profile``
  (its cost model read from the profile cache, or profiled), ``graphs`` (CUDA graph
  warm-up, where graphs are on);
* ``first_edit``: from the process's creation to its first answer.

Deploys record from their threads while ``/state`` reads: one lock, held for a dict
update only.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


def process_age_s() -> float | None:
    """Seconds since this process was created (Linux: ``/proc/self/stat``'s start time
    against the boot clock, 10 ms resolution); None where that cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of the line
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartupReport:
    """Phase durations in milliseconds: the executor's own, and each model's."""

    def __init__(self) -> None:
        age = process_age_s()
        # the process's creation on this process's monotonic clock (now, if unknown)
        self._born = time.monotonic() - (age or 0.0)
        self._lock = threading.Lock()
        self._executor: dict[str, float] = {}
        self._models: dict[str, dict[str, float]] = {}
        if age is not None:
            self._executor["process"] = round(age * 1e3, 1)

    def record(self, phase: str, seconds: float, model: str = "") -> None:
        """``phase`` took ``seconds`` (added to an earlier record of it: a model loaded
        again after a failed load counts both)."""
        with self._lock:
            table = self._models.setdefault(model, {}) if model else self._executor
            table[phase] = round(table.get(phase, 0.0) + seconds * 1e3, 1)

    @contextmanager
    def timed(self, phase: str, model: str = "") -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.record(phase, time.perf_counter() - started, model)

    def since_birth(self, phase: str) -> None:
        """``phase`` ends now, counted from the process's creation; recorded once."""
        with self._lock:
            if phase not in self._executor:
                self._executor[phase] = round((time.monotonic() - self._born) * 1e3, 1)

    def executor_ms(self) -> dict[str, float]:
        with self._lock:
            return dict(self._executor)

    def models_ms(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {model: dict(phases) for model, phases in self._models.items()}
