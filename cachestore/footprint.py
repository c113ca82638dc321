"""A template's bytes in each tier, from the shapes of its entries alone: what the store's
budgets count for it, and what a capacity plan predicts before anything is baked.

* **disk**: payload bytes (the manifest's ``nbytes``; the disk budget counts these);
* **host**: the one host buffer a load from disk allocates, every entry aligned to
  ``HOST_ALIGN`` (``Manifest.host_layout``; the host budget counts the buffer);
* **device**: what the device tier copies: every step's rows, not the per-template tensors
  (step ``TEMPLATE_STEP``), which stay with the request's pre-processing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from retouch.cachestore.manifest import EntrySpec, aligned

TEMPLATE_STEP = -1  # per-template tensors (noise, latents): not copied to the device tier


@dataclass(frozen=True)
class TemplateBytes:
    disk: int
    host: int
    device: int


def device_bytes(entries: Iterable[EntrySpec]) -> int:
    """Bytes of the entries the device tier holds (every step's rows)."""
    return sum(e.nbytes for e in entries if e.step != TEMPLATE_STEP)


def template_bytes(entries: Iterable[EntrySpec]) -> TemplateBytes:
    """A template's disk, host and device bytes, from its entries' dtypes and shapes."""
    entries = list(entries)
    return TemplateBytes(
        disk=sum(e.nbytes for e in entries),
        host=sum(aligned(e.nbytes) for e in entries),
        device=device_bytes(entries),
    )
