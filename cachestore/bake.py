"""Writing one template: ``with store.bake(key, meta) as w: w.put(step, block, name, t)``.

Tensors are snapshotted to host memory at ``put`` (the caller may reuse its buffers) and
streamed to the disk tier in batches on the writer thread while the bake goes on, so the
generation is never held up by a single large write. Nothing is visible until the block
exits normally: the commit writes the manifest last, in one transaction. An exception in
the block (or in a write) aborts and removes whatever was staged.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from retouch.cachestore.codec import dtype_code
from retouch.cachestore.disktier import DiskTier
from retouch.cachestore.layout import Slot, check_slot
from retouch.cachestore.manifest import EntrySpec, Manifest, check_meta
from retouch.cachestore.stats import StoreCounters

log = logging.getLogger(__name__)

# (manifest, host copies or None when the template was too large to keep)
CommitFn = Callable[[Manifest, dict[Slot, torch.Tensor] | None], None]


def snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy the caller cannot change afterwards (one copy, any device)."""
    tensor = tensor.detach()
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    out.copy_(tensor)
    return out


@dataclass
class BakeWriter:
    """Collects one template's tensors; commits on normal exit of the ``with`` block."""

    key: str
    meta: dict[str, Any]
    disk: DiskTier | None  # None: host-only bake (written to disk only when spilled)
    host_limit: int  # keep host copies while the template stays below this many bytes
    batch_bytes: int
    counters: StoreCounters
    on_commit: CommitFn
    _gen: int = 0
    _entries: list[EntrySpec] = field(default_factory=list)
    _slots: set[Slot] = field(default_factory=set)
    _host: dict[Slot, torch.Tensor] | None = field(default_factory=dict)
    _pending: list[tuple[Slot, torch.Tensor]] = field(default_factory=list)
    _pending_bytes: int = 0
    _inflight: deque[Future[None]] = field(default_factory=deque)
    _nbytes: int = 0
    _state: str = "new"

    def __enter__(self) -> BakeWriter:
        if self._state != "new":
            raise RuntimeError("a BakeWriter can be entered once")
        if self.disk is not None:
            self._gen = self.disk.begin_stage(self.key)
        self._state = "open"
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self._abort()
            return
        try:
            self._commit()
        except BaseException:
            self._abort()
            raise

    def put(self, step: int, block: str, name: str, tensor: torch.Tensor) -> None:
        """Record one tensor of the template (step -1 for per-template tensors)."""
        if self._state != "open":
            raise RuntimeError(f"bake of {self.key!r} is not open (state {self._state})")
        check_slot(step, block, name)
        dtype_code(tensor.dtype)
        slot = (step, block, name)
        if slot in self._slots:
            raise ValueError(f"bake of {self.key!r}: {slot} was put twice")
        copy = snapshot(tensor)
        self._slots.add(slot)
        self._entries.append(EntrySpec.of(slot, copy))
        self._nbytes += copy.nbytes
        self._keep_host(slot, copy)
        if self.disk is not None:
            self._pending.append((slot, copy))
            self._pending_bytes += copy.nbytes
            if self._pending_bytes >= self.batch_bytes:
                self._flush()

    def annotate(self, items: dict[str, Any]) -> None:
        """Add ``items`` to the template's meta, committed with it: what a writer learns
        only while it records (e.g. the compute dtype of rows it stores encoded)."""
        if self._state != "open":
            raise RuntimeError(f"bake of {self.key!r} is not open (state {self._state})")
        self.meta = check_meta({**self.meta, **items})

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def _keep_host(self, slot: Slot, copy: torch.Tensor) -> None:
        if self._host is None:
            return
        if self.disk is not None and self._nbytes > self.host_limit:
            self._host = None  # larger than the host tier: it will be loaded from disk
            return
        self._host[slot] = copy

    def _flush(self) -> None:
        """Hand the pending batch to the writer; at most two batches wait in memory."""
        if self._pending:
            self._inflight.append(self.disk.stage_async(self._gen, self._pending))
            self._pending, self._pending_bytes = [], 0
        while len(self._inflight) > 1:
            self._inflight.popleft().result()

    def _commit(self) -> None:
        if self.disk is not None:
            self._flush()
            while self._inflight:
                self._inflight.popleft().result()
        manifest = Manifest(
            key=self.key, gen=self._gen, meta=self.meta, entries=tuple(self._entries)
        )
        if self.disk is not None:
            self.disk.commit(manifest)
        self._state = "committed"
        self.counters.add(bakes=1, bake_bytes=self._nbytes)
        self.on_commit(manifest, self._host)

    def _abort(self) -> None:
        """Drop everything staged; never raises over the error that caused the abort."""
        if self._state in ("aborted", "committed"):
            return
        self._state = "aborted"
        self.counters.add(bake_aborts=1)
        self._pending, self._host = [], None
        while self._inflight:
            fut = self._inflight.popleft()
            if fut.exception() is not None:
                log.debug("staged batch of %r failed: %s", self.key, fut.exception())
        if self.disk is not None and self._gen:
            try:
                self.disk.abort(self._gen)
            except Exception:
                log.exception("could not remove the staged values of %r; gc will", self.key)
