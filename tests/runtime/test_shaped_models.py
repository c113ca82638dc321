"""Production-shaped built-in models are made in memory, part by part: each process makes
only what it holds, the parts two processes share come out alike, and nothing is written
to the models folder (a Flux-dev-shaped folder would be 24 GB)."""

from __future__ import annotations

import pytest
import torch

from retouch.functions import models as catalogue
from retouch.functions.models import BuiltinModel
from retouch.runtime.models import ModelCache

MINI = "retouch:mini-flux-dev-shaped"


@pytest.fixture
def mini(monkeypatch: pytest.MonkeyPatch) -> str:
    """Flux-dev's classes and block types at 5 % of its widths and depths (the catalogue's
    own entries are full size: minutes a step on a CPU)."""
    entry = BuiltinModel("mini-flux-dev-shaped", "flux-inpaint", 1024, shape="flux-dev", scale=0.05)
    monkeypatch.setitem(catalogue.BUILTIN_MODELS, entry.name, entry)
    return MINI


def test_a_shaped_model_is_made_in_memory(mini: str, tmp_path) -> None:
    loaded = ModelCache(tmp_path, torch.device("cpu")).get(mini, "flux-inpaint")
    pipe = loaded.pipe
    assert type(pipe).__name__ == "FluxInpaintPipeline"
    assert pipe.transformer.config.num_layers == 1 and pipe.transformer.dtype == torch.float32
    assert not any(tmp_path.iterdir())  # nothing built into the models folder
    again = ModelCache(tmp_path, torch.device("cpu")).get(mini, "flux-inpaint")
    assert again.fingerprint == loaded.fingerprint  # its bakes stay valid across restarts


def test_each_process_makes_only_its_parts_and_shared_parts_alike(mini: str, tmp_path) -> None:
    executor = ModelCache(tmp_path, torch.device("cpu"), without=("text_encoders",)).get(
        mini, "flux-inpaint"
    )
    worker = ModelCache(tmp_path, torch.device("cpu"), without=("denoiser",)).get(
        mini, "flux-inpaint"
    )
    assert executor.pipe.text_encoder is None and executor.pipe.transformer is not None
    assert worker.pipe.transformer is None and worker.pipe.text_encoder is not None
    for a, b in zip(executor.pipe.vae.parameters(), worker.pipe.vae.parameters(), strict=True):
        assert torch.equal(a, b)  # the same seeded init, not a computation
    assert executor.fingerprint == worker.fingerprint


def test_the_catalogue_names_the_production_shapes() -> None:
    shaped = {m.name: m.shape for m in catalogue.BUILTIN_MODELS.values() if m.shape}
    assert shaped == {
        "flux-dev-shaped": "flux-dev",
        "sd3-medium-shaped": "sd3-medium",
        "sd2-inpaint-shaped": "sd2-inpaint",
    }
