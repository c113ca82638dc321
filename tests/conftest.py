"""Shared fixtures: built demo models are cached once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "deploy" / "examples"


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models folder shared by the session (demo models are built into it once)."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(autouse=True, scope="session")
def _quiet_threads() -> None:
    os.environ.setdefault("RETOUCH_LOG_LEVEL", "WARNING")
