"""The gateway's memory limits, resolved once from its settings and the machine, and said in
the start-up log.

Three limits bound what requests can make a gateway hold: the decode budget (images being
decoded: ``platform/api/imagegate.py``), the request-body budget (bodies read and held until
answered: ``platform/api/bodybudget.py``) and the retention caps (jobs kept:
``platform/jobs/retention.py``). Two of them default to figures derived from the machine, which
an operator cannot see from the settings, so the gateway logs every figure as it starts.

The decode budget's default is what a gateway needs rather than a share of the machine:
room for ``DECODES_AT_LIMIT`` decodes at the pixel limit at once (768 MiB at 4096 x 4096),
the others waiting their turn, and never more than an eighth of the memory. As an eighth of
a 24 GB machine (3 GiB), it let six concurrent 16-Mpx uploads grow a gateway by 1.16 GB.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from retouch.platform.api.imagegate import BYTES_PER_PIXEL
from retouch.platform.jobs.retention import RetentionLimits

DECODES_AT_LIMIT = 2  # decodes at the pixel limit the default decode budget holds at once
MEMORY_SHARE = 8  # the request-body budget's default: this fraction of the memory
CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")
DECODE_LINE = re.compile(r"decode budget \S+ \S+ \((\d+) bytes\)")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 1 << 20

log = logging.getLogger(__name__)


def machine_memory() -> int:
    """Physical memory in bytes, or the cgroup's limit when it is lower (a container)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError, ValueError):
        total = min(total, int(CGROUP_LIMIT.read_text().strip()))  # "max": no limit
    return total


def return_large_frees() -> None:
    """Have glibc's malloc map every allocation of ``MMAP_THRESHOLD`` or more on its own,
    so that a decoded image, once freed, leaves the process at once. By default the
    threshold rises to the size of each large block freed (up to 32 MiB), and the blocks
    then come from arenas that keep what is freed: six 16-Mpx uploads at once grew a
    gateway by 683-738 MiB within its 768 MiB decode budget, 491-507 MiB with the threshold
    fixed (``retouch bench memory --only-default-limits``). Elsewhere than glibc: nothing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):
        return
    if not done:
        log.warning("mallopt refused an mmap threshold of %d bytes", MMAP_THRESHOLD)


def default_decode_budget(max_pixels: int, machine_bytes: int) -> int:
    """Room for ``DECODES_AT_LIMIT`` decodes of ``max_pixels``, within a share of memory."""
    return min(DECODES_AT_LIMIT * max_pixels * BYTES_PER_PIXEL, machine_bytes // MEMORY_SHARE)


def size(nbytes: int) -> str:
    """``nbytes`` as a person reads it, in KiB, MiB or GiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


@dataclass(frozen=True)
class GatewayLimits:
    """The figures a gateway runs with, in bytes, and where each came from."""

    machine_bytes: int
    max_pixels: int
    decode_bytes: int
    body_bytes: int
    decode_given: bool = False
    body_given: bool = False
    retention: RetentionLimits = field(default_factory=RetentionLimits)

    @classmethod
    def resolve(
        cls,
        max_pixels: int,
        decode_bytes: int = 0,
        body_bytes: int = 0,
        retention: RetentionLimits | None = None,
        machine_bytes: int | None = None,
    ) -> GatewayLimits:
        """The limits for these settings (0: the default) on this machine (or one of
        ``machine_bytes``)."""
        machine = machine_memory() if machine_bytes is None else machine_bytes
        return cls(
            machine,
            max_pixels,
            decode_bytes or default_decode_budget(max_pixels, machine),
            body_bytes or machine // MEMORY_SHARE,
            decode_given=bool(decode_bytes),
            body_given=bool(body_bytes),
            retention=retention or RetentionLimits(),
        )

    def log_lines(self) -> list[str]:
        """One line a limit, with its figure and where it came from."""
        memory = f"the machine's {size(self.machine_bytes)}"
        if self.decode_given:
            decode_why = "--decode-memory-bytes"
        else:
            decode_why = (
                f"{DECODES_AT_LIMIT} decodes at the pixel limit ({self.max_pixels} px, "
                f"{BYTES_PER_PIXEL} B/px) at once, at most an eighth of {memory}; "
                "--decode-memory-bytes sets it"
            )
        body_why = (
            "--body-memory-bytes"
            if self.body_given
            else f"an eighth of {memory}; --body-memory-bytes sets it"
        )
        caps = self.retention
        return [
            f"decode budget {size(self.decode_bytes)} ({self.decode_bytes} bytes): {decode_why}",
            f"request-body budget {size(self.body_bytes)} ({self.body_bytes} bytes): {body_why}",
            f"job retention caps: {caps.max_live_jobs} live jobs "
            f"({caps.max_live_jobs_per_tenant} per tenant), "
            f"{size(caps.max_retained_bytes)} retained "
            f"({size(caps.max_retained_bytes_per_tenant)} per tenant)",
        ]


def logged_decode_budget(log_text: str) -> int | None:
    """The decode budget a gateway's log says it runs with (None: not said)."""
    found = DECODE_LINE.search(log_text)
    return int(found.group(1)) if found else None
