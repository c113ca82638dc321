"""Host memory for resident templates: one flat buffer per template, recycled by size.

Two measured reasons shape this module:

* First-touch page faults on a fresh multi-GiB allocation run at a few GB/s here, about the
  speed of the disk read they would add to, so buffers of evicted templates are kept in a
  pool and reused by the next load of the same size (templates of one function have the
  same size). Pooled bytes count against the host budget.
* ``torch.empty(..., pin_memory=True)`` rounds every allocation up to a power of two, which
  would let a 2.6 GiB template occupy 4 GiB. Pinned buffers are therefore ordinary
  allocations registered with ``cudaHostRegister`` (exact size), and unregistered before
  they are freed.
"""

from __future__ import annotations

import logging
import mmap
from collections import defaultdict
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20


def _register(tensor: torch.Tensor) -> bool:
    """Page-lock ``tensor`` for asynchronous H2D copies; False when CUDA refuses."""
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)
    if int(err) != 0:
        log.warning(
            "cudaHostRegister of %d bytes failed (%s); using pageable memory", tensor.nbytes, err
        )
        return False
    return True


@dataclass(eq=False)
class HostBuffer:
    """A flat uint8 host allocation, pinned when CUDA is available."""

    tensor: torch.Tensor
    pinned: bool = False
    _freed: bool = False

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    def free(self) -> None:
        """Unregister (if pinned) and drop the reference; views keep plain memory alive."""
        if self._freed:
            return
        self._freed = True
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        self.tensor = torch.empty(0, dtype=torch.uint8)


def _anonymous(nbytes: int) -> torch.Tensor:
    """Page-aligned anonymous memory backed by transparent huge pages where the kernel
    allows (``madvise`` mode): first-touch faults and TLB misses per 2 MiB instead of per
    4 KiB, which speeds up both cold loads and row gathers. The tensor keeps the mapping
    alive; it is unmapped when the last view is gone."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8)


def allocate(nbytes: int, pin: bool) -> HostBuffer:
    """A new host buffer of exactly ``nbytes``."""
    small = nbytes < HUGE_PAGE
    tensor = torch.empty(nbytes, dtype=torch.uint8) if small else _anonymous(nbytes)
    pinned = pin and nbytes > 0 and _register(tensor)
    return HostBuffer(tensor=tensor, pinned=pinned)


@dataclass
class BufferPool:
    """Free host buffers keyed by exact size; not thread-safe (the host tier locks)."""

    _free: dict[int, list[HostBuffer]] = field(default_factory=lambda: defaultdict(list))
    nbytes: int = 0

    def take(self, size: int) -> HostBuffer | None:
        """A pooled buffer of exactly ``size`` bytes, if any."""
        bucket = self._free.get(size)
        if not bucket:
            return None
        buf = bucket.pop()
        self.nbytes -= size
        return buf

    def put(self, buf: HostBuffer) -> None:
        if buf.nbytes == 0:
            return
        self._free[buf.nbytes].append(buf)
        self.nbytes += buf.nbytes

    def release_one(self) -> int:
        """Free the largest pooled buffer; returns the bytes released (0 when empty)."""
        sizes = [size for size, bucket in self._free.items() if bucket]
        if not sizes:
            return 0
        size = max(sizes)
        self._free[size].pop().free()
        self.nbytes -= size
        return size

    def clear(self) -> None:
        while self.release_one():  # frees one buffer per call, 0 once none is left
            continue
