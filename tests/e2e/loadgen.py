"""A load of invoking threads: what the scaling tests share."""

from __future__ import annotations

import threading
from collections.abc import Callable

from retouch.platform.api.client import Client
from tests.support import WAIT_S


class Load:
    """``clients`` threads invoking in a loop until stopped; every answer is kept."""

    def __init__(
        self,
        url: str,
        invoke: Callable[[Client, int], object],
        clients: int,
        pause_s: float = 0.0,
    ) -> None:
        self.pause_s = pause_s  # each client's think time between invocations
        self.results: list[object] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(url, invoke, i), daemon=True)
            for i in range(clients)
        ]

    def _run(self, url: str, invoke: Callable[[Client, int], object], index: int) -> None:
        with Client(url) as client:
            n = 0
            while not self._stop.is_set():
                try:
                    self.results.append(invoke(client, index * 10_000 + n))
                except BaseException as exc:  # every failure is the finding
                    self.errors.append(exc)
                n += 1
                if self.pause_s:
                    self._stop.wait(self.pause_s)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=WAIT_S)
