"""The one pipeline loader raises no warning (diffusers' ``torch_dtype`` deprecation, ...),
whole or as a pre/post worker loads it, for every family."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from retouch.functions.demo.models import ensure_demo_model
from retouch.runtime import families
from retouch.runtime.models import ModelCache

MODELS = {
    "sd-inpaint": "retouch:tiny-sd",
    "flux-inpaint": "retouch:tiny-flux",
    "sd3-inpaint": "retouch:tiny-sd3",
}


@pytest.mark.parametrize("family", list(MODELS))
def test_loading_raises_no_warning(family: str, models_dir: Path) -> None:
    ensure_demo_model(MODELS[family], models_dir)  # building may warn; loading may not
    for without in ((), ("denoiser",), ("denoiser", "text")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache = ModelCache(models_dir, torch.device("cpu"), without=without)
            loaded = cache.get(MODELS[family], family)
        assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
        (denoiser,) = families.family(family).denoisers
        assert (getattr(loaded.pipe, denoiser) is None) == ("denoiser" in without)
