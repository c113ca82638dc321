"""Cache keys of baked templates.

A template's recorded activations are valid only for exactly the inputs that produced them,
so the key hashes everything that changes them (DESIGN.md, "Functions and templates"):
model weights and config, family, resolution, steps, scheduler and its config, guidance,
template image, prompt and seed, and the cache format version. Functions that share a model
and a template therefore share its bake. A function's LoRA adapters change the weights: its
model's fingerprint is then :func:`weights_fingerprint`, the model's and each adapter
file's with its scale, so each (template, adapter set) bakes once.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from retouch.functions.adapters import AdapterSpec

CACHE_FORMAT_VERSION = 1
SAMPLE_BYTES = 1 << 20


@lru_cache(maxsize=64)
def model_fingerprint(folder: Path) -> str:
    """Hash of a diffusers folder (or of one single-file checkpoint): every config file in
    full, every weight file by size, header and a sample of its bytes.

    Hashing multi-GB weights in full would add minutes to every executor start; the
    safetensors header (names, dtypes, shapes, offsets) plus sampled bytes changes whenever
    the weights do in practice.
    """
    digest = hashlib.sha256()
    files = [folder] if folder.is_file() else sorted(p for p in folder.rglob("*") if p.is_file())
    for path in files:
        rel = path.relative_to(folder).as_posix() if path != folder else path.name
        size = path.stat().st_size
        digest.update(f"{rel}\0{size}\0".encode())
        with path.open("rb") as f:
            if path.suffix in (".json", ".txt", ".model") or size <= 2 * SAMPLE_BYTES:
                digest.update(f.read())
                continue
            digest.update(f.read(SAMPLE_BYTES))  # safetensors header and first tensors
            f.seek(size // 2)
            digest.update(f.read(SAMPLE_BYTES))
            f.seek(max(0, size - SAMPLE_BYTES), os.SEEK_SET)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def weights_fingerprint(model_fp: str, adapters: tuple[AdapterSpec, ...]) -> str:
    """The fingerprint of a model run with ``adapters`` at their scales: the model's alone
    without adapters (its bakes keep their keys); with them, the files' contents (as
    :func:`model_fingerprint` samples them) and scales, whatever their order or names."""
    if not adapters:
        return model_fp
    parts = sorted((model_fingerprint(Path(a.path)), round(a.scale, 6)) for a in adapters)
    digest = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]
    return f"{model_fp}+lora-{digest}"


def template_key(
    model_fp: str,
    settings: dict[str, Any],
    scheduler_config: dict[str, Any],
    image_bytes: bytes,
    prompt: str,
    seed: int,
) -> str:
    """The cache key of one template under one set of generation settings.

    ``settings`` holds family, width, height, steps, guidance and scheduler name.
    """
    doc = {
        "version": CACHE_FORMAT_VERSION,
        "model": model_fp,
        "settings": settings,
        "scheduler_config": {
            k: v for k, v in sorted(scheduler_config.items()) if not k.startswith("_")
        },
        "image": hashlib.sha256(image_bytes).hexdigest(),
        "prompt": prompt,
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:32]
