"""``retouch bench coldstart``: how fast a model's weights load, against the disk itself.

An executor's cold start is dominated, past its imports, by reading its model's weights and
placing them on the device. This measures that phase as the executor runs it (the one
loader, :func:`~retouch.runtime.models.load_pipeline`, imports already warm) beside a raw
sequential read of the same weight files, in the same run, rounds alternating, with the
page cache:

* ``cold``: dropped for those files before each read (``posix_fadvise(DONTNEED)``), so both
  come from the disk;
* ``warm``: the files read once just before, so both come from memory.

``load_vs_raw_read`` is the raw read's time over the load's (1.0: the loader reads at the
disk's speed; the rest of a load is building modules, converting dtypes and copying). A
load counts until every weight has been read (:func:`touch`): on a CPU, safetensors weights
stay memory-mapped and are read as they are first used.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from retouch.functions.demo.models import demo_model, ensure_demo_model, is_demo
from retouch.platform.lab.bench.engine import device_name
from retouch.runtime.models import load_pipeline

CHUNK = 16 << 20  # bytes per read() of the raw read (what a sequential reader would use)
PAGE = 4096
WEIGHTS = (".safetensors", ".bin")


def weight_files(folder: Path) -> list[Path]:
    """The model's weight files, every component's."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in WEIGHTS)


def drop_cached(files: list[Path]) -> None:
    """Evict the files' pages from the page cache (clean pages only: they were not written)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(files: list[Path]) -> float:
    """Seconds to read every byte of ``files`` sequentially, one after another."""
    buffer = bytearray(CHUNK)
    started = time.perf_counter()
    for path in files:
        with path.open("rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return time.perf_counter() - started


def touch(pipe: Any) -> None:
    """Read one byte of every page of every weight: on a CPU the loader leaves safetensors
    weights memory-mapped, read from the disk only as a first edit touches them, so a load
    without this would not have read them."""
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            for tensor in (*module.parameters(), *module.buffers()):
                flat = tensor.detach().reshape(-1).view(torch.uint8)
                if flat.numel():
                    flat[::PAGE].max()


def timed_load(folder: Path, family: str, device: torch.device, dtype: str) -> float:
    """Seconds for the executor's loader to have the pipeline on ``device``, every weight
    read (:func:`touch`)."""
    started = time.perf_counter()
    pipe = load_pipeline(folder, family, device, dtype=dtype)
    touch(pipe)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    del pipe
    gc.collect()
    return seconds


def run_coldstart_bench(
    model: str, models_dir: Path, device: torch.device, dtype: str = "auto", rounds: int = 3
) -> list[dict[str, Any]]:
    if not is_demo(model):
        raise ValueError("bench coldstart runs the built-in retouch: models")
    family = demo_model(model).family
    folder = ensure_demo_model(model, models_dir)
    files = weight_files(folder)
    nbytes = sum(p.stat().st_size for p in files)
    timed_load(folder, family, device, dtype)  # imports and one-time set-up, not measured
    series: dict[str, dict[str, list[float]]] = {
        cache: {"raw": [], "load": []} for cache in ("cold", "warm")
    }
    for i in tqdm(range(rounds), desc=f"coldstart {model}", unit="round"):
        for cache in ("cold", "warm"):
            order = ("raw", "load") if i % 2 == 0 else ("load", "raw")
            for what in order:
                if cache == "cold":
                    drop_cached(files)
                else:
                    raw_read(files)
                took = (
                    raw_read(files) if what == "raw" else timed_load(folder, family, device, dtype)
                )
                series[cache][what].append(took)
    rows = []
    for cache, times in series.items():
        raw_s, load_s = statistics.median(times["raw"]), statistics.median(times["load"])
        rows.append(
            {
                "model": model,
                "device": device_name(device),
                "cache": cache,
                "weight_files": len(files),
                "weight_bytes": nbytes,
                "raw_read_s": round(raw_s, 4),
                "raw_read_gb_s": round(nbytes / raw_s / 1e9, 3),
                "load_s": round(load_s, 4),
                "load_gb_s": round(nbytes / load_s / 1e9, 3),
                "load_vs_raw_read": round(raw_s / load_s, 3),
                "rounds": rounds,
            }
        )
    return rows
