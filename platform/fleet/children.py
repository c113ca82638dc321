"""The servers a command starts stop with it: on SIGTERM, on SIGINT, and when it is killed.

``retouch demo`` and ``retouch bench ...`` start ``retouch serve`` processes
(:class:`~retouch.platform.api.server.ServerProcess`), which start executors. Python's default
SIGTERM ends a process at once, running none of its ``with`` blocks, so those servers went
on serving, re-parented to init, until someone killed them. Here:

* :func:`stop_on_signals` (the CLI calls it before any command): SIGTERM and SIGINT first
  ask every server this process started and has not stopped (:func:`track`) to stop
  (SIGTERM: the gateway stops its executors), then unwind the command as Ctrl-C does, so
  each ``with`` waits for its server and removes its temporary files. Asking first
  matters: the command may be waiting on threads or tasks that talk to its server, and
  those end when the server does, not before.
* a command killed by SIGKILL runs nothing: each server it started watches it instead
  (``retouch serve --exit-with-parent PID``, :mod:`retouch.runtime.parentwatch`) and stops
  gracefully once it is gone, as executors watch their gateway.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from retouch.platform.fleet.forkedprocess import ForkedProcess

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_running: set[subprocess.Popen | ForkedProcess] = set()  # started here and not yet stopped


def track(process: subprocess.Popen | ForkedProcess) -> None:
    """``process`` is a server this process started: stop it if this process is stopped."""
    _running.add(process)


def forget(process: subprocess.Popen | ForkedProcess) -> None:
    """``process`` was stopped (or ended) by its owner."""
    _running.discard(process)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within: SIGTERM and SIGINT stop the tracked servers, then unwind (``SystemExit(143)``,
    ``KeyboardInterrupt``: the CLI's exit 130). The handlers before are put back after
    (the tests run commands in their own process). Off the main thread, which alone
    may set handlers: nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, _stop_and_unwind) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _stop_and_unwind(signum: int, frame: FrameType | None) -> None:
    for process in list(_running):
        process.send_signal(signal.SIGTERM)  # nothing when it has ended already
    if _running:
        log.warning("%s: stopping the %d server(s) started here", signal.strsignal(signum),
                    len(_running))  # fmt: skip
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)
