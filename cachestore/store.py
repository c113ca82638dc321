"""The activation store facade the runtime and the CLI use.

::

    store = ActivationStore(StoreConfig(path=Path("/var/lib/retouch/cache")))
    with store.bake(key, {"function": "tryon", "saved_compute": 0.8}) as w:
        w.put(step, "down.0.attn1", "k", k)
    fut = store.prefetch(key)              # while the invocation waits in the queue
    with store.acquire(key) as h:          # host-resident; not evicted while held
        h.read_rows(step, "down.0.attn1", "k", rows, out)   # rows along dim -2

Two tiers: the disk tier (LMDB, ``disktier.py``) is durable and shared by every process of
the host; the host tier (``hosttier.py``) is this process's RAM. The engine only reads
host-resident tensors; ``prefetch`` moves a template disk -> host in the background and
merges with any load of the same template already in flight. A template bigger than the
host tier's budget is never loaded whole: ``acquire`` returns a handle that reads it from
disk step by step, the next step loading while the current one is read (``streaming.py``).

One ``ActivationStore`` per path and process (LMDB forbids opening one environment twice
in a process), opened after any ``fork``.
"""

from __future__ import annotations

import enum
import logging
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from retouch.cachestore.bake import BakeWriter
from retouch.cachestore.defaults import HOST_BUDGET_BYTES
from retouch.cachestore.disktier import DATA_FILE, DiskConfig, DiskTier
from retouch.cachestore.errors import CorruptEntry, ReadOnlyStore, StoreClosed
from retouch.cachestore.handle import TemplateHandle
from retouch.cachestore.hosttier import HostTier, ResidentTemplate
from retouch.cachestore.layout import Slot, template_key
from retouch.cachestore.loads import TemplateLoads
from retouch.cachestore.manifest import Manifest, check_meta
from retouch.cachestore.policy import PolicySpec, make_policy
from retouch.cachestore.rows import Rows
from retouch.cachestore.stats import StoreCounters
from retouch.cachestore.streaming import StreamedTemplate

log = logging.getLogger(__name__)

GiB = 1 << 30


class Tier(enum.Enum):
    """Where a template can be read from right now (the fastest tier holding it)."""

    HOST = "host"
    DISK = "disk"
    NONE = "none"


@dataclass(frozen=True)
class StoreConfig:
    """Configuration of one store.

    ``disk_budget_bytes`` defaults to 90 % of the smaller of ``map_size`` and the space the
    file system can give the store. With ``write_through`` a bake is committed to disk;
    without it a bake stays in host memory and reaches the disk only when it is evicted
    (spilled). ``pin_memory`` defaults to ``torch.cuda.is_available()``.
    """

    path: Path
    host_budget_bytes: int = HOST_BUDGET_BYTES
    disk_budget_bytes: int | None = None
    map_size: int = 1 << 40
    policy: PolicySpec = "lru"
    write_through: bool = True
    readonly: bool = False
    pin_memory: bool | None = None
    prefetch_workers: int = 2
    max_readers: int = 126
    write_batch_bytes: int = 64 << 20


def _default_disk_budget(path: Path, map_size: int) -> int:
    probe = path if path.exists() else path.parent
    existing = (path / DATA_FILE).stat().st_size if (path / DATA_FILE).exists() else 0
    available = shutil.disk_usage(probe).free + existing
    return int(0.9 * min(map_size, available))


class HostTemplate(TemplateHandle):
    """A held reference to a host-resident template; release it (or use ``with``).

    Tensors returned by :meth:`get` are views into the store's memory: valid while the
    handle is held, read-only by convention.
    """

    def __init__(self, res: ResidentTemplate, tier: HostTier, counters: StoreCounters) -> None:
        self._res = res
        self._tier = tier
        self._counters = counters
        self._held = True

    @property
    def key(self) -> str:
        return self._res.key

    @property
    def meta(self) -> dict[str, Any]:
        return self._res.meta

    @property
    def nbytes(self) -> int:
        return self._res.nbytes

    def slots(self) -> list[Slot]:
        """Every (step, block, name) the template holds, in bake order."""
        return list(self._live().tensors)

    def get(self, step: int, block: str, name: str) -> torch.Tensor:
        """The host-resident tensor (pinned where CUDA exists)."""
        try:
            return self._live().tensors[(step, block, name)]
        except KeyError:
            raise KeyError(f"template {self.key!r} has no tensor {(step, block, name)}") from None

    def streams_to(self, device: torch.device) -> bool:
        buffer = self._res.buffer
        return device.type == "cuda" and buffer is not None and buffer.pinned

    def release(self) -> None:
        if self._held:
            self._held = False
            self._tier.release(self._res)

    def _live(self) -> ResidentTemplate:
        if not self._held:
            raise RuntimeError(f"handle of {self.key!r} used after release()")
        return self._res


class ActivationStore:
    """Two-tier store of templates' recorded activations (see module docstring)."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        path = Path(config.path)
        budget = config.disk_budget_bytes
        if budget is None:
            budget = _default_disk_budget(path, config.map_size)
        self._counters = StoreCounters()
        self._closed = False
        self._disk = DiskTier(
            DiskConfig(
                path=path,
                map_size=config.map_size,
                budget_bytes=budget,
                readonly=config.readonly,
                max_readers=config.max_readers,
                batch_bytes=config.write_batch_bytes,
            ),
            make_policy(config.policy),
            self._counters,
        )
        pin = torch.cuda.is_available() if config.pin_memory is None else config.pin_memory
        self._host = HostTier(
            budget=config.host_budget_bytes,
            policy=make_policy(config.policy),
            pin=pin,
            counters=self._counters,
            spill=self._schedule_spill,
        )
        self._prefetcher = ThreadPoolExecutor(
            max_workers=config.prefetch_workers, thread_name_prefix="cachestore-prefetch"
        )
        self._loads = TemplateLoads(
            self._disk, self._host, self._counters, self._prefetcher, self._corrupt
        )

    # ---- writing -------------------------------------------------------------------------

    def bake(self, key: str, meta: dict[str, Any]) -> BakeWriter:
        """A writer for one template; committed atomically when its ``with`` block exits."""
        self._check_open()
        template_key(key)
        write_disk = self.config.write_through
        if write_disk and self.config.readonly:
            raise ReadOnlyStore("cannot bake into a read-only store with write_through")
        return BakeWriter(
            key=key,
            meta=check_meta(meta),
            disk=self._disk if write_disk else None,
            host_limit=self.config.host_budget_bytes,
            batch_bytes=self.config.write_batch_bytes,
            counters=self._counters,
            on_commit=self._install_baked,
        )

    def _install_baked(self, manifest: Manifest, tensors: dict[Slot, torch.Tensor] | None) -> None:
        """Make a fresh bake host-resident (in one pooled buffer), replacing older copies."""
        if tensors is None:
            self._host.remove(manifest.key)
            return
        offsets, total = manifest.host_layout()
        buf = self._host.reserve(total)
        views: dict[Slot, torch.Tensor] = {}
        for entry, offset in zip(manifest.entries, offsets, strict=True):
            view = buf.tensor[offset : offset + entry.nbytes].view(entry.dtype).view(entry.shape)
            view.copy_(tensors[entry.slot])
            views[entry.slot] = view
        res = ResidentTemplate(manifest.key, manifest.meta, views, footprint=total, buffer=buf)
        self._host.insert(res, pinned=False, reserved=True)

    # ---- tiers, prefetch, acquire --------------------------------------------------------

    def tier(self, key: str) -> Tier:
        """The fastest tier holding a valid copy of ``key``."""
        self._check_open()
        if self._host.contains(key):
            return Tier.HOST
        return Tier.DISK if self._disk.contains(key) else Tier.NONE

    def resident(self, key: str) -> bool:
        """Whether ``key`` is in host memory (resident or being spilled)."""
        self._check_open()
        return self._host.contains(key)

    def nbytes(self, key: str) -> int:
        """The bytes of ``key``'s activations in the fastest tier holding it (0: none)."""
        self._check_open()
        for res in self._host.residents():
            if res.key == key:
                return res.nbytes
        manifest = self._disk.manifest(key)
        return manifest.nbytes if manifest is not None and manifest.valid else 0

    def prefetch(self, key: str) -> Future[int]:
        """Start loading ``key`` disk -> host in the background.

        Returns a future of the bytes loaded (0 when already resident) that raises KeyError
        or CorruptEntry like :meth:`acquire`. Concurrent calls for one key share one future.
        """
        self._check_open()
        return self._loads.prefetch(key, streamed=self._too_big(key) is not None)

    def acquire(self, key: str) -> HostTemplate | StreamedTemplate:
        """A held, host-resident template; loads it (or waits for its prefetch) if needed.

        Raises KeyError when the template is absent (or invalid) and CorruptEntry when its
        stored data fails verification (it is then marked invalid: re-bake it).
        """
        self._check_open()
        streamed = self._streamed(key)
        if streamed is not None:
            return streamed
        return self._handle(self._loads.acquire(key))

    def _streamed(self, key: str) -> StreamedTemplate | None:
        """A step-by-step handle when ``key`` is on disk, not host-resident, and bigger
        than the host tier's whole budget (loading it whole would only thrash the tier)."""
        if self._too_big(key) is None:
            return None
        self._counters.add(streamed=1)
        return StreamedTemplate(
            key, self._disk, self._host, self._counters, self._prefetcher, self._corrupt
        )

    def _corrupt(self, exc: CorruptEntry) -> None:
        """A load found a bad checksum: count it and mark the template invalid (re-baked)."""
        self._counters.add(corrupt=1)
        self._disk.mark_invalid(exc.key, str(exc))

    def _too_big(self, key: str) -> Manifest | None:
        """``key``'s manifest when it must be streamed by step (see ``_streamed``)."""
        if self._host.contains(key):
            return None
        try:
            manifest = self._disk.manifest(key)
        except CorruptEntry:  # the whole-load path reports it and marks it invalid
            return None
        if manifest is None or not manifest.valid or manifest.nbytes <= self._host.budget:
            return None
        return manifest

    def read_rows(
        self, key: str, step: int, block: str, name: str, rows: Rows, out: torch.Tensor
    ) -> torch.Tensor:
        """``acquire`` + ``read_rows`` + ``release`` in one call."""
        with self.acquire(key) as handle:
            return handle.read_rows(step, block, name, rows, out)

    def evict(self, key: str) -> bool:
        """Push ``key`` out of the host tier now (spilling it if the disk lacks it)."""
        self._check_open()
        return self._host.evict(key)

    def _handle(self, res: ResidentTemplate) -> HostTemplate:
        return HostTemplate(res, self._host, self._counters)

    # ---- spilling ------------------------------------------------------------------------

    def _schedule_spill(self, res: ResidentTemplate) -> bool:
        """Host-tier eviction hook: write ``res`` to disk unless the disk already has it."""
        if self._closed or self.config.readonly or self._disk.contains(res.key):
            return False
        try:
            fut = self._disk.write_async(
                res.key, res.meta, dict(res.tensors), should_write=lambda: self._host.tracks(res)
            )
        except StoreClosed:
            log.warning("store closing: %r evicted from the host tier without a spill", res.key)
            return False
        fut.add_done_callback(lambda done: self._spill_finished(res, done))
        return True

    def _spill_finished(self, res: ResidentTemplate, fut: Future[bool]) -> None:
        exc = fut.exception()
        if exc is not None:
            self._counters.add(spill_failures=1)
            log.warning("spilling %r to disk failed, the template is dropped: %s", res.key, exc)
        elif fut.result():
            self._counters.add(spills=1, spill_bytes=res.nbytes)
        self._host.spill_done(res)

    # ---- management (CLI: ls, stats, verify, gc) -----------------------------------------

    def delete(self, key: str) -> bool:
        """Remove ``key`` from both tiers; True when it existed anywhere."""
        self._check_writable()
        on_disk = bool(self._disk.delete([key]))
        in_host = self._host.remove(key)
        return on_disk or in_host

    def delete_where(self, **meta_equals: Any) -> list[str]:
        """Delete every template whose meta matches all given items, e.g.
        ``delete_where(function="tryon")``; returns the deleted keys."""
        self._check_writable()
        if not meta_equals:
            raise ValueError("delete_where needs at least one meta item to match")

        def matches(meta: dict[str, Any]) -> bool:
            return all(meta.get(k, object()) == v for k, v in meta_equals.items())

        keys = {m.key for m in self._disk.catalog()[0] if matches(m.meta)}
        keys |= {res.key for res in self._host.residents() if matches(res.meta)}
        self._disk.delete(sorted(keys))
        for key in keys:
            self._host.remove(key)
        return sorted(keys)

    def ls(self) -> list[dict[str, Any]]:
        """One row per template known to either tier."""
        self._check_open()
        manifests, broken = self._disk.catalog()
        rows: dict[str, dict[str, Any]] = {}
        for m in manifests:
            key = m.key
            in_host = self._host.contains(key)
            tier = Tier.HOST if in_host else (Tier.DISK if m.valid else Tier.NONE)
            rows[key] = {
                "key": key,
                "tier": tier.value,
                "in_host": in_host,
                "on_disk": m.valid,
                "bytes": m.nbytes,
                "tensors": len(m.entries),
                "meta": m.meta,
                "valid": m.valid,
                "reason": m.reason,
                "created": m.created,
            }
        for key in broken:
            rows[key] = {
                "key": key,
                "tier": Tier.NONE.value,
                "in_host": False,
                "on_disk": False,
                "bytes": 0,
                "tensors": 0,
                "meta": {},
                "valid": False,
                "reason": "undecodable manifest",
                "created": 0.0,
            }
        for res in self._host.residents():
            if res.key not in rows:
                rows[res.key] = {
                    "key": res.key,
                    "tier": Tier.HOST.value,
                    "in_host": True,
                    "on_disk": False,
                    "bytes": res.nbytes,
                    "tensors": len(res.tensors),
                    "meta": res.meta,
                    "valid": True,
                    "reason": "",
                    "created": 0.0,
                }
        return [rows[key] for key in sorted(rows)]

    def stats(self) -> dict[str, Any]:
        """Counters since open plus current occupancy of both tiers."""
        self._check_open()
        disk = self._disk.usage()
        valid_disk = {m.key for m in self._disk.scan().manifests.values() if m.valid}
        host_keys = {res.key for res in self._host.residents()}
        return {
            **self._counters.snapshot(),
            **self._host.usage(),
            **disk,
            "templates": len(valid_disk | host_keys),
            "prefetches_in_flight": self._loads.in_flight(),
        }

    def live_stats(self) -> dict[str, Any]:
        """Counters and host-tier occupancy only: no disk scan, cheap enough for a health
        or state endpoint polled while bakes and loads run."""
        self._check_open()
        return {
            **self._counters.snapshot(),
            **self._host.usage(),
            "prefetches_in_flight": self._loads.in_flight(),
        }

    def verify(self) -> dict[str, Any]:
        """Check every checksum on disk; corrupt templates are marked invalid."""
        self._check_open()
        return self._disk.verify()

    def gc(self) -> int:
        """Remove invalid templates, partial bakes and orphaned values; bytes freed."""
        self._check_writable()
        return self._disk.gc()

    # ---- lifecycle -----------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for background writes (spills) queued so far to be committed to disk."""
        self._check_open()
        self._disk.flush()

    def close(self) -> None:
        """Finish prefetches and background spills, then close the environment."""
        if self._closed:
            return
        self._prefetcher.shutdown(wait=True)
        self._disk.close()
        self._closed = True
        self._host.clear()

    def __enter__(self) -> ActivationStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("activation store is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.config.readonly:
            raise ReadOnlyStore(f"store {self.config.path} was opened read-only")
