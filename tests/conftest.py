"""Session-wide set-up: one shared folder for built demo models and device profiles, so
every ``retouch serve`` a test starts reuses them instead of rebuilding and re-profiling."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(autouse=True, scope="session")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shared = tmp_path_factory.mktemp("shared")
    os.environ["RETOUCH_SHARED_DIR"] = str(shared)  # read by `retouch serve` (ServeConfig)
    # Hub ids resolve from this cache only (never the user's, never the network).
    os.environ["HF_HUB_CACHE"] = str(shared / "hub")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("RETOUCH_LOG_LEVEL", "WARNING")
    return shared


@pytest.fixture(scope="session")
def models_dir(shared_dir: Path) -> Path:
    """Demo models are built into this folder once per session."""
    return shared_dir / "models"
