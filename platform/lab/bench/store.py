"""``retouch bench store``: the activation store against the machine's own limits.

All three comparisons run side by side in one process, alternating between the store and
its baseline in every repeat; each figure is a median over repeats.

(a) Host tier: row gathers (``read_rows`` of a realistic mask, ~20 % of the tokens, into
    one output buffer per tensor, as the engine fills a step's staging area) against a
    plain ``torch`` copy of the same number of bytes out of the same host-resident
    template, timed tensor by tensor in alternating order, one intra-op thread.
(b) Disk tier: a cold ``acquire`` (LMDB data file dropped from the page cache with
    ``posix_fadvise(DONTNEED)``, store reopened so no page stays mapped) against a plain
    sequential read of a file of the same size into a fresh buffer of the same size.
(c) Queueing: an invocation waits ``queue_ms`` in the queue while its template is only on
    disk (cold); the time ``acquire`` then blocks, with the prefetch started at enqueue
    versus without it. ``prefetch_hidden_fraction = 1 - wait_with / wait_without``.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from retouch.cachestore.disktier import DATA_FILE
from retouch.cachestore.rows import RowSelection
from retouch.cachestore.store import ActivationStore, StoreConfig

log = logging.getLogger(__name__)

TOKENS_SIDE = 64  # 64 x 64 latent tokens (a 1024 px image at /16)
CHANNELS = 320
KEY = "bench-template"
READ_CHUNK = 8 << 20


def _shape() -> tuple[int, int, int]:
    return (2, TOKENS_SIDE * TOKENS_SIDE, CHANNELS)  # both CFG halves, tokens, channels


def ellipse_rows(fraction: float) -> torch.Tensor:
    """Token indices of an axis-aligned ellipse covering ``fraction`` of the latent grid,
    the shape of a typical editing mask (runs of neighbouring tokens, not random rows)."""
    yy, xx = torch.meshgrid(
        torch.arange(TOKENS_SIDE, dtype=torch.float32),
        torch.arange(TOKENS_SIDE, dtype=torch.float32),
        indexing="ij",
    )
    centre = (TOKENS_SIDE - 1) / 2
    lo, hi = 0.0, 2.0 * TOKENS_SIDE
    for _ in range(40):  # bisect the ellipse scale to hit the area fraction
        scale = (lo + hi) / 2
        inside = ((yy - centre) / (0.6 * scale)) ** 2 + ((xx - centre) / (0.45 * scale)) ** 2 <= 1
        lo, hi = (scale, hi) if inside.float().mean() < fraction else (lo, scale)
    return inside.flatten().nonzero().flatten()


def _drop_page_cache(path: Path) -> None:
    """Write back, then evict ``path`` from the page cache (it must not be mapped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _bake_template(config: StoreConfig, size_mb: int) -> int:
    """Bake one template of about ``size_mb`` MB; returns its payload bytes."""
    count = max(1, round(size_mb * 1e6 / (_shape()[0] * _shape()[1] * CHANNELS * 2)))
    gen = torch.Generator().manual_seed(0)
    with ActivationStore(config) as store, store.bake(KEY, {"function": "bench"}) as writer:
        for i in tqdm(range(count), desc="store bench: bake", unit="tensor", leave=False):
            step, block, name = i // 16, f"block.{(i // 2) % 8}", ("k", "v")[i % 2]
            writer.put(step, block, name, torch.randn(_shape(), generator=gen).half())
        return writer.nbytes


def _write_raw_file(path: Path, nbytes: int) -> None:
    chunk = os.urandom(READ_CHUNK)
    with path.open("wb") as f:
        for start in range(0, nbytes, READ_CHUNK):
            f.write(chunk[: min(READ_CHUNK, nbytes - start)])
        f.flush()
        os.fsync(f.fileno())


def _read_raw_file(path: Path, nbytes: int) -> None:
    """Plain sequential read into a fresh buffer (the store's loads also fill fresh memory)."""
    dest = memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy())
    with path.open("rb", buffering=0) as f:
        offset = 0
        while offset < nbytes:
            got = f.readinto(dest[offset : offset + READ_CHUNK])
            if not got:
                break
            offset += got


def _host_phase(config: StoreConfig, repeats: int, fraction: float) -> dict[str, float]:
    """Per tensor, one timed gather and one timed copy of the same byte count, in
    alternating order, so both see the same background load of the machine."""
    with ActivationStore(config) as store, store.acquire(KEY) as handle, _one_thread():
        rows = RowSelection(ellipse_rows(fraction))  # one mask, prepared once per step
        slots = handle.slots()
        srcs = [handle.get(*slot) for slot in slots]
        gathered = [torch.empty(2, len(rows), CHANNELS, dtype=torch.float16) for _ in slots]
        copied = [torch.empty_like(out) for out in gathered]
        half = len(slots) // 2  # the copy reads another tensor than the gather just read
        nbytes = sum(out.nbytes for out in gathered)
        clock = time.perf_counter
        gathers, copies, ratios = [], [], []
        for rep in tqdm(
            range(repeats + 1), desc=f"store bench: host rows {fraction:.0%}", leave=False
        ):
            t_gather = t_copy = 0.0
            for i, slot in enumerate(slots):
                src, dst = srcs[(i + half) % len(slots)].view(-1), copied[i].view(-1)
                for op in ("gather", "copy") if (i + rep) % 2 else ("copy", "gather"):
                    start = clock()
                    if op == "gather":
                        handle.read_rows(*slot, rows, gathered[i])
                        t_gather += clock() - start
                    else:
                        dst.copy_(src[: dst.numel()])
                        t_copy += clock() - start
            if rep:  # the first pass faults the output buffers in
                gathers.append(nbytes / t_gather / 1e9)
                copies.append(nbytes / t_copy / 1e9)
                ratios.append(t_copy / t_gather)
    return {
        "host_gbps": statistics.median(gathers),
        "memcpy_gbps": statistics.median(copies),
        "host_ratio": statistics.median(ratios),
        "rows": len(rows),
    }


@contextmanager
def _one_thread() -> Iterator[None]:
    """One intra-op thread for the host phase: ~1 MB copies gain nothing from a thread team,
    and on a small shared VM OpenMP teams made gather and copy alike 3-5x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cold_acquire(config: StoreConfig) -> float:
    """Seconds for one acquire of the template from a cold disk tier."""
    _drop_page_cache(config.path / DATA_FILE)
    with ActivationStore(config) as store:
        start = time.perf_counter()
        store.acquire(KEY).release()
        return time.perf_counter() - start


def _disk_phase(config: StoreConfig, raw: Path, nbytes: int, repeats: int) -> dict[str, float]:
    store_gbps, raw_gbps, ratios, loads = [], [], [], []
    for i in tqdm(range(repeats), desc="store bench: cold disk", leave=False):

        def cold_raw() -> float:
            _drop_page_cache(raw)
            return _timed(lambda: _read_raw_file(raw, raw.stat().st_size))

        if i % 2 == 0:
            load, raw_s = _cold_acquire(config), cold_raw()
        else:
            raw_s, load = cold_raw(), _cold_acquire(config)
        loads.append(load)
        store_gbps.append(nbytes / load / 1e9)
        raw_gbps.append(raw.stat().st_size / raw_s / 1e9)
        ratios.append(store_gbps[-1] / raw_gbps[-1])
    warm = raw.stat().st_size / _timed(lambda: _read_raw_file(raw, raw.stat().st_size)) / 1e9
    return {
        "disk_gbps": statistics.median(store_gbps),
        "raw_disk_gbps": statistics.median(raw_gbps),
        "disk_ratio": statistics.median(ratios),
        "raw_warm_gbps": warm,  # page-cache speed: shows the cold reads really were cold
        "cold_load_ms": statistics.median(loads) * 1e3,
    }


def _queued_wait(config: StoreConfig, queue_s: float, prefetch: bool) -> float:
    """Seconds ``acquire`` blocks after an invocation queued ``queue_s`` (cold template)."""
    _drop_page_cache(config.path / DATA_FILE)
    with ActivationStore(config) as store:
        if prefetch:
            store.prefetch(KEY)  # at enqueue
        time.sleep(queue_s)
        start = time.perf_counter()
        store.acquire(KEY).release()
        return time.perf_counter() - start


def _queue_phase(config: StoreConfig, queue_ms: float, repeats: int) -> dict[str, float]:
    with_pf, without_pf = [], []
    for i in tqdm(range(repeats), desc=f"store bench: queue {queue_ms:.0f} ms", leave=False):
        for prefetch in (True, False) if i % 2 == 0 else (False, True):
            wait = _queued_wait(config, queue_ms / 1e3, prefetch)
            (with_pf if prefetch else without_pf).append(wait)
    wait_with, wait_without = statistics.median(with_pf), statistics.median(without_pf)
    return {
        "queue_ms": queue_ms,
        "wait_with_prefetch_ms": wait_with * 1e3,
        "wait_without_prefetch_ms": wait_without * 1e3,
        "prefetch_hidden_fraction": max(0.0, 1.0 - wait_with / wait_without),
    }


def run_store_bench(
    workdir: Path,
    size_mb: int = 256,
    repeats: int = 5,
    gather_fraction: float = 0.2,
    queue_ms: float | None = None,
) -> dict[str, Any]:
    """Run (a), (b) and (c) on a template of about ``size_mb`` MB under ``workdir``.

    ``queue_ms`` defaults to the measured cold load time (a queue as long as the load); the
    result also reports the hidden fraction for half and for twice that queue.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    config = StoreConfig(
        path=workdir / "store",
        host_budget_bytes=2 * size_mb * 10**6 + (64 << 20),
        map_size=max(4 * size_mb * 10**6, 1 << 30),
    )
    nbytes = _bake_template(config, size_mb)
    raw = workdir / "raw.bin"
    _write_raw_file(raw, (config.path / DATA_FILE).stat().st_size)
    result: dict[str, Any] = {"template_bytes": nbytes, "repeats": repeats}
    result.update(_host_phase(config, repeats, gather_fraction))
    result["host_ratio_complement"] = _host_phase(config, repeats, 1 - gather_fraction)[
        "host_ratio"
    ]
    result.update(_disk_phase(config, raw, nbytes, repeats))
    queue = result["cold_load_ms"] if queue_ms is None else queue_ms
    result.update(_queue_phase(config, queue, repeats))
    for label, factor in (("half", 0.5), ("double", 2.0)):
        other = _queue_phase(config, queue * factor, repeats)
        result[f"prefetch_hidden_fraction_{label}_queue"] = other["prefetch_hidden_fraction"]
    result["pinned"] = torch.cuda.is_available()
    return result
