"""Is the process that started a bake still running?

A staging record names its writer by pid *and* process start time (from ``/proc``), so a
recycled pid is not mistaken for the writer. Where ``/proc`` is missing, the pid alone is
used, which can only err towards keeping staged data until ``gc``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessId:
    pid: int
    start: int  # clock ticks after boot, 0 when unknown

    def to_doc(self) -> list[int]:
        return [self.pid, self.start]

    @classmethod
    def from_doc(cls, doc: list[int]) -> ProcessId:
        return cls(int(doc[0]), int(doc[1]))


def _start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat``; None when the process does not exist or is a
    zombie (killed but not yet reaped by its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return 0
    # the command name (field 2) may contain spaces; fields after it follow the last ')'
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def current() -> ProcessId:
    pid = os.getpid()
    return ProcessId(pid, _start_time(pid) or 0)


def alive(proc: ProcessId) -> bool:
    """True when the process is (probably) still running."""
    if Path("/proc/self/stat").exists():
        start = _start_time(proc.pid)
        return start is not None and (proc.start == 0 or start == proc.start)
    try:
        os.kill(proc.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
