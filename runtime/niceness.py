"""Lower the CPU priority of the calling thread (Linux, where a thread has its own
niceness): background work — an adapter's build, the engine thread on a CPU executor —
yields cores to what must not wait behind it."""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)


def renice_this_thread(increment: int, what: str) -> None:
    """Add ``increment`` to this thread's niceness (at most 19); a sandbox that forbids it
    leaves the thread at the process's priority, with a warning naming ``what``."""
    if increment <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + increment))
    except OSError as exc:
        log.warning("%s not reniced: %s", what, exc)
