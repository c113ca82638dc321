"""The engine's step records, kept beside the device profile they calibrate.

An engine fits how its steps really take against the plan (``engine.step_overhead``), and
the gateway predicts every completion with that fit. A fresh engine has no steps, so its
first minute was predicted from the bare profile: up to 5x long on small-flux, where the
profile was taken while another executor was starting. The records a closing executor
leaves here (the latest planned/measured pairs of each model) seed the fit of the next
executor that loads the same profile: a restart, a scale-up, the next benchmark round.
Its own steps displace them one by one.

The file is tied to the profile's bytes: a new profile (another version, a re-profile)
makes old records meaningless, and they are ignored. Writers replace the file atomically;
when several executors share a data dir the last to close wins, which is what is wanted
(all of them measured the same model on the same kind of device).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

STEPS_VERSION = 1
KEPT = 96  # pairs kept per model: the engine fits its line on as many (LINE_STEPS)

Pair = tuple[float, float]  # (planned ms, measured ms) of one step


def steps_path(profile: Path) -> Path:
    """``<profile>.steps.json`` beside ``<profile>.json``."""
    return profile.with_suffix(".steps.json")


def profile_digest(profile: Path) -> str | None:
    """What ties records to the profile they were measured against (None: no profile)."""
    try:
        return hashlib.sha256(profile.read_bytes()).hexdigest()[:16]
    except OSError:
        return None


def load_step_records(profile: Path) -> list[Pair]:
    """The pairs a previous executor left for ``profile``; [] when there are none, they
    belong to another profile, or the file cannot be read (never an error: the engine
    then starts from the profile alone, as it always could)."""
    path = steps_path(profile)
    if not path.exists():
        return []
    try:
        doc = json.loads(path.read_text())
        if doc.get("version") != STEPS_VERSION or doc.get("profile") != profile_digest(profile):
            return []
        pairs = [(float(p), float(m)) for p, m in doc["pairs"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable step records %s: %s", path, exc)
        return []
    return [(p, m) for p, m in pairs if p > 0 and m > 0][-KEPT:]


def save_step_records(profile: Path, pairs: Sequence[Pair]) -> None:
    """Keep the latest :data:`KEPT` pairs for ``profile`` (nothing without a profile)."""
    digest = profile_digest(profile)
    if digest is None or not pairs:
        return
    path = steps_path(profile)
    doc = {"version": STEPS_VERSION, "profile": digest, "pairs": [list(p) for p in pairs[-KEPT:]]}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only data dir costs the next executor its warm start
        log.warning("could not keep step records in %s: %s", path, exc)
