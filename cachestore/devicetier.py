"""Device tier: the hottest templates resident in GPU memory, so they never cross PCIe again.

Production editing traffic re-uses few templates thousands of times (FlashPS's trace: 970
templates, ~35,000 uses each). The host tier still moves a template's K/V over PCIe on every
step of every edit; this tier keeps whole templates in the compute device's memory under a
byte budget. A block then copies each cached tensor whole into its key buffer with no
gather and no host work (``runtime/maskaware/attention.fill_cached``), and a step whose
templates are all resident can be replayed from a CUDA graph.

* **Promotion**: an edit served from the host tier asks for its template to be promoted.
  A copier thread acquires the template from the store (pinned host memory), copies every
  step's tensors to the device on its own stream and inserts the template once the copy
  has finished; the edit that asked keeps reading the host copy. Per-template tensors
  (step -1: noise, latents) stay on the host, where the host side of an edit reads them.
* **Budget and eviction**: resident bytes ≤ ``budget``; to make room the least recently
  used templates that no edit holds are evicted (their memory goes back to torch's
  allocator, re-used only after the engine's queued kernels). A template that would not
  fit even then is not promoted and evicts nothing (``device_skips``). ``drop`` (a
  re-bake, a delete) also refuses a copy of the old activations still in flight.
* **Encoded rows**: a template whose rows rest as fp8 codes (``storage = "fp8"``) is
  promoted as stored, codes and scales (each an ordinary tensor of the template), and
  decoded on the device as a block copies it: the tier then holds twice the templates of
  bf16 in the same budget, and the decode rides on the copy a block makes anyway.
* **Handles**: ``acquire`` returns a held :class:`DeviceTemplate` (never evicted while
  held); ``release`` it when the edit ends. It is a reader the blocks recognise as
  resident (``holds_on``, ``resident``).

On a CPU the tier works the same with CPU "device" memory (tests use it: edits must be
bit-identical to the host tier's); serving on a CPU leaves it off.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from retouch.cachestore.footprint import TEMPLATE_STEP, device_bytes
from retouch.cachestore.layout import Slot
from retouch.cachestore.manifest import EntrySpec

log = logging.getLogger(__name__)


class TemplateSource(Protocol):
    """A held host-tier handle (``HostTemplate``): what a promotion copies from."""

    @property
    def meta(self) -> dict[str, Any]: ...

    def slots(self) -> list[Slot]: ...

    def get(self, step: int, block: str, name: str) -> torch.Tensor: ...

    def release(self) -> None: ...


@dataclass(eq=False)
class DeviceTemplate:
    """A template resident on ``device``: the reader an edit's blocks copy rows from."""

    key: str
    device: torch.device
    tensors: dict[Slot, torch.Tensor]  # every step's tensors on the device, step -1 on host
    nbytes: int  # device bytes
    tier: DeviceTier | None = None
    refs: int = 0
    meta: dict[str, Any] = field(default_factory=dict)  # the bake's (its row format, say)

    def get(self, step: int, block: str, name: str) -> torch.Tensor:
        try:
            return self.tensors[(step, block, name)]
        except KeyError:
            raise KeyError(f"template {self.key!r} has no tensor {(step, block, name)}") from None

    def encoded(self, step: int, block: str, name: str) -> tuple[torch.Tensor, None]:
        return self.get(step, block, name), None

    def describe(self, step: int, block: str, name: str) -> tuple[torch.Size, torch.dtype]:
        tensor = self.get(step, block, name)
        return tensor.shape, tensor.dtype

    def resident(
        self, step: int, block: str, name: str, device: torch.device
    ) -> torch.Tensor | None:
        tensor = self.tensors.get((step, block, name))
        return tensor if tensor is not None and self.holds_on(device) else None

    def holds_on(self, device: torch.device) -> bool:
        return same_device(self.device, device)

    def release(self) -> None:
        if self.tier is not None:
            self.tier.release(self)


@dataclass
class DeviceTierStats:
    hits: int = 0  # acquire() found the template resident
    promotions: int = 0  # templates copied in
    promoted_bytes: int = 0
    evictions: int = 0
    skips: int = 0  # promotions refused: the template does not fit the budget


@dataclass(eq=False)
class DeviceTier:
    """Templates resident on ``device`` under ``budget`` bytes (thread-safe)."""

    device: torch.device
    budget: int
    stats: DeviceTierStats = field(default_factory=DeviceTierStats)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _resident: OrderedDict[str, DeviceTemplate] = field(default_factory=OrderedDict)
    _pending: dict[str, Future[None]] = field(default_factory=dict)
    _generation: dict[str, int] = field(default_factory=dict)  # bumped by ``drop``
    _copier: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="device-tier")
    )

    def acquire(self, key: str) -> DeviceTemplate | None:
        """The held resident template, most recently used now; None if not resident."""
        with self._lock:
            template = self._resident.get(key)
            if template is None:
                return None
            template.refs += 1
            self._resident.move_to_end(key)
            self.stats.hits += 1
            return template

    def release(self, template: DeviceTemplate) -> None:
        with self._lock:
            template.refs = max(0, template.refs - 1)

    def promote(self, key: str, open_source: Callable[[], TemplateSource | None]) -> None:
        """Copy ``key`` in, in the background (once; nothing if resident or on its way).
        ``open_source`` acquires the host-tier handle on the copier thread."""
        with self._lock:
            if key in self._resident or key in self._pending:
                return
            generation = self._generation.get(key, 0)
            self._pending[key] = self._copier.submit(self._promote, key, generation, open_source)

    def wait(self) -> None:
        """Wait for promotions in flight (tests, benchmarks)."""
        with self._lock:
            pending = list(self._pending.values())
        for future in pending:
            future.result()

    def keys(self) -> frozenset[str]:
        """The templates resident now (what the executor reports to the gateway)."""
        with self._lock:
            return frozenset(self._resident)

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {
                "device_bytes": sum(t.nbytes for t in self._resident.values()),
                "device_budget_bytes": self.budget,
                "device_templates": len(self._resident),
                "device_hits": self.stats.hits,
                "device_promotions": self.stats.promotions,
                "device_promoted_bytes": self.stats.promoted_bytes,
                "device_evictions": self.stats.evictions,
                "device_skips": self.stats.skips,
            }

    def drop(self, key: str) -> None:
        """Forget ``key`` (its bake was replaced or deleted); a held copy lives on until
        its handle is released."""
        with self._lock:
            self._resident.pop(key, None)
            self._pending.pop(key, None)  # a copy of the old activations will not be kept
            self._generation[key] = self._generation.get(key, 0) + 1

    def clear(self) -> None:
        """Forget every template once the copies in flight land (the executor gives its
        device back while it sleeps); held copies live on until released."""
        self.wait()
        for key in self.keys():
            self.drop(key)

    def close(self) -> None:
        self._copier.shutdown(wait=True)
        with self._lock:
            self._resident.clear()

    # -- the copier thread ----------------------------------------------------------------

    def _promote(
        self, key: str, generation: int, open_source: Callable[[], TemplateSource | None]
    ) -> None:
        try:
            source = open_source()
            if source is None:
                return
            try:
                self._copy_in(key, generation, source)
            finally:
                source.release()
        except Exception:
            log.exception("promoting template %s to the device tier failed", key)
        finally:
            with self._lock:
                if self._generation.get(key, 0) == generation:
                    self._pending.pop(key, None)

    def _copy_in(self, key: str, generation: int, source: TemplateSource) -> None:
        slots = source.slots()
        nbytes = device_bytes(EntrySpec.of(s, source.get(*s)) for s in slots)
        if not self._make_room(nbytes):
            with self._lock:
                self.stats.skips += 1
            log.info("template %s (%.1f GB) does not fit the device tier", key, nbytes / 1e9)
            return
        tensors = _copied(source, slots, self.device)
        template = DeviceTemplate(
            key, self.device, tensors, nbytes, tier=self, meta=dict(source.meta)
        )
        with self._lock:
            if self._generation.get(key, 0) != generation:
                return  # dropped (re-baked or deleted) while it was being copied
            self._resident[key] = template
            self.stats.promotions += 1
            self.stats.promoted_bytes += nbytes

    def _make_room(self, nbytes: int) -> bool:
        """Evict unheld templates, least recently used first, until ``nbytes`` fit; evict
        nothing when even that would not make room."""
        if nbytes > self.budget:
            return False
        with self._lock:
            used = sum(t.nbytes for t in self._resident.values())
            unheld = sum(t.nbytes for t in self._resident.values() if t.refs == 0)
            if used - unheld + nbytes > self.budget:
                return False
            for key in list(self._resident):
                if used + nbytes <= self.budget:
                    break
                victim = self._resident[key]
                if victim.refs == 0:
                    del self._resident[key]
                    used -= victim.nbytes
                    self.stats.evictions += 1
        return True


def _copied(source: TemplateSource, slots: list[Slot], device: torch.device) -> dict[Slot, Any]:
    """Every step's tensors on ``device`` (one side stream, waited for), step -1's cloned
    on the host. Each device tensor is marked as used by the device's default stream (the
    engine's): when it is freed (evicted, dropped), torch's allocator re-uses its memory
    only after the kernels queued there by then have run."""
    out: dict[Slot, torch.Tensor] = {}
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    try:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for slot in slots:
                tensor = source.get(*slot)
                if slot[0] == TEMPLATE_STEP:
                    out[slot] = tensor.clone()
                else:
                    out[slot] = tensor.to(device, non_blocking=True, copy=True)
    finally:
        if stream is not None:
            stream.synchronize()  # the host buffers are read until the copies are done
    if stream is not None:
        engine = torch.cuda.default_stream(device)
        for slot, tensor in out.items():
            if slot[0] != TEMPLATE_STEP:
                tensor.record_stream(engine)
    return out


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are one device when 0 is the current one."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (
        b.index if b.index is not None else current
    )
