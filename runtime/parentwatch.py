"""A child process that ends with the process that started it, even one killed by SIGKILL.

A parent that dies by SIGKILL runs no clean-up: its children are re-parented (to init,
or a subreaper) and would go on serving on their ports or computing for nobody. So the
child watches, on a daemon thread, in one of two ways:

* :func:`watch_parent`, for a process started with exec (a gateway, an executor): its
  parent's pid is compared with the starter's, which the starter passes
  (``--exit-with-parent PID``), so a parent that dies while the child still imports is
  seen gone at once, where a pid read at start would already be init's.
* :func:`watch_pipe`, for a process forked from a fork server (an executor's profiling
  child on a CPU): its parent is the fork server, not the process that asked for it. The
  starter keeps the write end of a pipe and never writes; the child's read ends (EOF)
  when the starter is gone.

Not ``PR_SET_PDEATHSIG``: it fires when the *thread* that forked the child ends (a
short-lived thread starting a server would kill it), is Linux-only and needs ``prctl``
through ctypes. Plain standard library: no torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

log = logging.getLogger(__name__)

INTERVAL_S = 0.5  # how often the parent's pid is read


def watch_parent(parent: int, on_gone: Callable[[], None]) -> threading.Thread:
    """Call ``on_gone`` once this process's parent is no longer ``parent`` (0: the
    parent it has now)."""
    expected = parent or os.getppid()

    def watch() -> None:
        while os.getppid() == expected:
            time.sleep(INTERVAL_S)
        log.warning("the process that started this one (pid %d) is gone", expected)
        on_gone()

    return _start(watch)


def watch_pipe(lifeline: Connection, on_gone: Callable[[], None]) -> threading.Thread:
    """Call ``on_gone`` once the other end of ``lifeline`` (the starter's, never written
    to) is closed: the starter ended or let go."""

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):  # EOF: the other end is closed
            lifeline.recv_bytes()
        log.warning("the process that started this one is gone")
        on_gone()

    return _start(watch)


def _start(watch: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread
