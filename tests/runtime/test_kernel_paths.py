"""What another CPU does to the images, reproduced on this one (docs/maskaware.md,
"Exactness and reproducibility").

The tiny models of the cross-path tests (single-file checkpoints against their folders) in
a child interpreter on other kernels: with MKL's CNR off and every weight re-allocated at
other offsets from a 64-byte boundary (MKL then picks its kernels by alignment, as it did
where single-file and folder images differed in the last bit), and on another CPU's
kernels (MKL's COMPATIBLE branch, ATen unvectorised, oneDNN at SSE4.1). Their images stay
within :data:`~tests.kernelpaths.CROSS_PATH_TOLERANCE` of this process's. In deterministic
mode (the suite's environment, and an executor's ``--deterministic`` set after torch is
loaded) a realigned copy gives the same bits (tests/e2e/test_attach.py starts executors
with the flag).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from retouch.functions.modelsource import ModelSource
from retouch.runtime.models import ModelCache
from tests.kernelpaths import (
    CROSS_PATH_TOLERANCE,
    MODELS,
    OTHER_KERNELS,
    Job,
    images_elsewhere,
    realigned,
    stock_image,
)

OFFSETS = (1,)  # elements past a 64-byte boundary (1, 3 and 8 moved these images alike)


@pytest.fixture(scope="module")
def here(cache: ModelCache) -> dict[str, np.ndarray]:
    """Each model's image in this process, on the suite's kernels."""
    return {m: stock_image(cache.get(ModelSource(m).key, f).pipe, f) for m, f in MODELS}


@pytest.mark.parametrize("kernels", list(OTHER_KERNELS))
def test_the_same_weights_on_other_kernels_stay_within_the_cross_path_tolerance(
    kernels: str, here: dict[str, np.ndarray], models_dir: Path, tmp_path: Path
) -> None:
    offsets = OFFSETS if kernels == "alignment" else ()
    job = Job(str(models_dir), offsets=offsets, threads=torch.get_num_threads())
    there = images_elsewhere(job, OTHER_KERNELS[kernels], tmp_path / "images.npz")
    assert len(there) == len(MODELS) * (1 + len(offsets))
    for key, image in there.items():
        model = key.split("@")[0]
        np.testing.assert_allclose(
            image, here[model], rtol=0, atol=CROSS_PATH_TOLERANCE, err_msg=key
        )


def test_in_deterministic_mode_a_realigned_copy_gives_the_same_bits(
    cache: ModelCache, here: dict[str, np.ndarray]
) -> None:
    """The suite runs with the switches (tests/conftest.py): the same kernels whatever the
    weights' alignment."""
    for model, family in MODELS:
        pipe = cache.get(ModelSource(model).key, family).pipe
        for offset in OFFSETS:
            with realigned(pipe, offset):
                assert np.array_equal(stock_image(pipe, family), here[model]), (model, offset)


def test_deterministic_mode_set_after_torch_loads_gives_the_same_bits(
    here: dict[str, np.ndarray], models_dir: Path, tmp_path: Path
) -> None:
    """As an executor sets it: a child started without the switches imports torch, then
    turns deterministic mode on; its copies, as loaded and realigned, give this process's
    bits (the same machine and thread count: the same kernels)."""
    job = Job(str(models_dir), MODELS[:1], OFFSETS, torch.get_num_threads(), deterministic=True)
    images = images_elsewhere(job, {}, tmp_path / "images.npz")
    assert len(images) == 1 + len(OFFSETS)
    for key, image in images.items():
        assert np.array_equal(image, here[key.split("@")[0]]), key
