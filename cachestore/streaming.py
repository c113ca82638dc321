"""Templates larger than the host tier, read from the disk tier one step at a time.

An edit reads a template step by step, in order, and never needs more than the step it is
computing. A template bigger than the host tier's whole budget (a Flux-dev template at 28
steps is ~120 GB) is therefore never loaded whole: :class:`StreamedTemplate` keeps the
per-template tensors and a small window of steps in host buffers reserved from the tier
(so they count against its budget and evict colder templates, like any load), loads the
next step in the background while the current one is read (double buffering), and gives
a step's buffer back once the edit has moved two steps past it. Each step crosses from
disk once per edit; nothing is loaded whole per acquire.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import torch

from retouch.cachestore.disktier import DiskTier, LoadedTemplate
from retouch.cachestore.errors import CorruptEntry
from retouch.cachestore.handle import TemplateHandle
from retouch.cachestore.hosttier import HostTier
from retouch.cachestore.layout import Slot
from retouch.cachestore.stats import StoreCounters

log = logging.getLogger(__name__)

TEMPLATE_STEP = -1  # per-template tensors (noise, latents): loaded once, kept


class StreamedTemplate(TemplateHandle):
    """A held template read step by step (the interface of ``HostTemplate``). It holds at
    most three steps: the one before (copies may still read it), now and next. One edit
    reads it, in step order; a tensor from ``get`` is valid until the edit has moved two
    steps past it."""

    def __init__(
        self,
        key: str,
        disk: DiskTier,
        host: HostTier,
        counters: StoreCounters,
        loader: Executor,
        on_corrupt: Callable[[CorruptEntry], None],
    ) -> None:
        self._disk, self._host, self._counters, self._loader = disk, host, counters, loader
        self._on_corrupt = on_corrupt
        self._lock = threading.Lock()
        self._window: dict[int, Future[LoadedTemplate]] = {}
        # One read transaction for the handle's life: every step comes from the generation
        # the handle started with, even if the template is re-baked meanwhile.
        self._snapshot = disk.snapshot()
        self._snapshot_lock = threading.Lock()
        self._held = True
        try:
            manifest = disk.manifest(key, self._snapshot)
            if manifest is None or not manifest.valid:
                raise KeyError(key)
        except BaseException:
            self._snapshot.abort()
            raise
        self._manifest = manifest
        entries = manifest.entries
        self._steps = sorted({e.slot[0] for e in entries if e.slot[0] != TEMPLATE_STEP})
        try:
            self._fixed = self._load(TEMPLATE_STEP)
        except BaseException:
            self._snapshot.abort()
            raise
        if self._steps:  # the first step now: a corrupt start shows at acquire, as whole loads
            try:
                self._step(self._steps[0])
            except BaseException:
                self.release()
                raise

    @property
    def key(self) -> str:
        return self._manifest.key

    @property
    def meta(self) -> dict[str, Any]:
        return self._manifest.meta

    @property
    def nbytes(self) -> int:
        return self._manifest.nbytes

    def slots(self) -> list[Slot]:
        return [e.slot for e in self._manifest.entries]

    def get(self, step: int, block: str, name: str) -> torch.Tensor:
        """The tensor of ``(step, block, name)`` in host memory (the step is loaded, or
        waited for, if it is not in the window)."""
        if not self._held:
            raise RuntimeError(f"handle of {self.key!r} used after release()")
        loaded = self._fixed if step == TEMPLATE_STEP else self._step(step)
        try:
            return loaded.tensors[(step, block, name)]
        except KeyError:
            raise KeyError(f"template {self.key!r} has no tensor {(step, block, name)}") from None

    def release(self) -> None:
        """Give every buffer back to the host tier (after loads in flight finish)."""
        with self._lock:
            if not self._held:
                return
            self._held = False
            window, self._window = self._window, {}
        _settle_device()
        for future in window.values():
            self._free_future(future)
        fixed = getattr(self, "_fixed", None)
        if fixed is not None:
            self._host.unreserve(fixed.buffer)
        with self._snapshot_lock:
            self._snapshot.abort()

    # -- the window -----------------------------------------------------------------------

    def _step(self, step: int) -> LoadedTemplate:
        with self._lock:
            future = self._window.get(step)
            if future is None:
                future = self._window[step] = self._loader.submit(self._load, step)
            following = self._neighbour(step, later=True)
            if following is not None and following not in self._window:
                self._window[following] = self._loader.submit(self._load, following)
            keep = {step, following, self._neighbour(step, later=False)}
            stale = [s for s in self._window if s not in keep]
            dropped = [self._window.pop(s) for s in stale]
        if dropped:
            _settle_device()
            for old in dropped:
                self._free_future(old)
        return future.result()

    def _neighbour(self, step: int, *, later: bool) -> int | None:
        """The template's next (or previous) step after ``step`` (steps need not be
        consecutive)."""
        found = [s for s in self._steps if (s > step if later else s < step)]
        if not found:
            return None
        return found[0] if later else found[-1]

    def _load(self, step: int) -> LoadedTemplate:
        """One step's tensors from disk, checksums verified (a corrupt value marks the
        template invalid through ``on_corrupt``, then raises ``CorruptEntry``)."""
        try:
            with self._snapshot_lock:
                if not self._held and step != TEMPLATE_STEP:
                    raise KeyError(f"{self.key!r} released")
                loaded = self._disk.load(
                    self.key,
                    self._host.reserve,
                    self._host.unreserve,
                    only=lambda slot: slot[0] == step,
                    txn=self._snapshot,
                )
        except CorruptEntry as exc:
            self._on_corrupt(exc)
            raise
        if step != TEMPLATE_STEP:
            self._counters.add(streamed_steps=1)
        return loaded

    def _free_future(self, future: Future[LoadedTemplate]) -> None:
        try:
            loaded = future.result()
        except Exception:  # a failed load reserved nothing (it unreserved on failure)
            return
        self._host.unreserve(loaded.buffer)


def _settle_device() -> None:
    """A step's buffer may be the source of a copy still queued on the GPU: wait for it
    before the buffer is re-used (once per step, streamed templates only)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
