"""Fixtures of the runtime tests that load models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from retouch.runtime.models import ModelCache


@pytest.fixture(scope="module")
def cache(models_dir: Path) -> ModelCache:
    """One module's loaded models on the CPU (a module's tests share its copies)."""
    return ModelCache(models_dir, torch.device("cpu"))
