"""Models load as users have them, through the executor's loader (``ModelCache``): a
hub-layout folder (fp16-variant, sharded UNet, real CLIP BPE tokenizer) by path and by hub
id with the network unreachable, a hub-layout Flux folder with a sharded transformer and a
T5 sentencepiece tokenizer at its real length, a single-file checkpoint in the original
layout giving the same images as its folder, and ``dtype = "bf16"`` on a CPU."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from retouch.functions.demo.images import template_image
from retouch.functions.modelsource import ModelSource
from retouch.runtime.families import family
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.quality import psnr
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.models import ModelCache
from tests.kernelpaths import assert_close_across_paths, weights_differing
from tests.modelfolders import (
    CLIP_LENGTH,
    build_flux_folder,
    build_sd_folder,
    into_hub_cache,
)
from tests.singlefile import ldm_checkpoint

FAMILY = "sd-inpaint"
REPO_ID = "retouch-tests/sd-inpaint-hub"
FLUX_ID = "retouch-tests/flux-inpaint-hub"
SIZE, STEPS, GUIDANCE = 128, 2, 5.0
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Path:
    return build_sd_folder(tmp_path_factory.mktemp("hub") / "sd", models_dir)


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Path:
    return build_flux_folder(tmp_path_factory.mktemp("hub") / "flux", models_dir)


@pytest.fixture
def offline(
    tmp_path: Path, hub_folder: Path, flux_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folders in a hub cache of their own, and no network: any connection fails."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    into_hub_cache(hub_folder, tmp_path / "hub", REPO_ID)
    into_hub_cache(flux_folder, tmp_path / "hub", FLUX_ID)

    def unreachable(*args: object, **kwargs: object) -> None:
        raise OSError("network unreachable (test)")

    monkeypatch.setattr(socket.socket, "connect", unreachable)
    monkeypatch.setattr(socket, "create_connection", unreachable)


def _request(mask: np.ndarray | None = None) -> EditRequest:
    if mask is None:
        mask = np.zeros((SIZE, SIZE), dtype=bool)
        mask[20:70, 30:90] = True
    image = template_image(mask.shape[::-1], 4)
    prompt = "the red door and the blue car"
    return EditRequest(image, mask, prompt, 9, STEPS, GUIDANCE, "a quiet street", 3)


def _stock(cache: ModelCache, source: ModelSource, request: EditRequest | None = None):
    loaded = cache.get(source.key, FAMILY)
    return MaskAwareEditor(loaded.pipe, FAMILY, CPU).stock_edit(request or _request(), "np")


def test_hub_layout_folder_loads_by_path_and_by_hub_id_offline(
    cache: ModelCache, hub_folder: Path, offline: None
) -> None:
    by_path = ModelSource(str(hub_folder), variant="fp16")
    loaded = cache.get(by_path.key, FAMILY)
    assert type(loaded.pipe.tokenizer).__name__ == "CLIPTokenizer"
    assert family(FAMILY).model.text_length(loaded.pipe) == CLIP_LENGTH  # the real length
    ids = loaded.pipe.tokenizer("the red and blue").input_ids
    assert len(ids) == 10 and ids[0] == loaded.pipe.tokenizer.bos_token_id  # BPE merges
    assert loaded.pipe.unet.dtype == torch.float32  # fp16 files, the CPU's dtype
    by_id = ModelSource(REPO_ID, variant="fp16")
    image = _stock(cache, by_path)
    assert np.array_equal(_stock(cache, by_id), image)
    assert cache.get(by_id.key, FAMILY).fingerprint == loaded.fingerprint  # same files


def test_flux_folder_with_t5_sentencepiece_serves_by_hub_id(
    cache: ModelCache, offline: None
) -> None:
    loaded = cache.get(ModelSource(FLUX_ID, variant="fp16").key, "flux-inpaint")
    pipe = loaded.pipe
    assert type(pipe.tokenizer_2).__name__ == "T5Tokenizer"
    assert (pipe.tokenizer.model_max_length, pipe.tokenizer_2.model_max_length) == (77, 512)
    assert family("flux-inpaint").model.text_length(pipe) == 512  # T5's real length
    editor = MaskAwareEditor(pipe, "flux-inpaint", CPU)
    request, store = _request(np.ones((SIZE, SIZE), dtype=bool)), MemoryActivations()
    editor.bake(request.image, "a quiet street", 3, STEPS, GUIDANCE, store)
    assert psnr(editor.edit(request, store, "np"), editor.stock_edit(request, "np")) >= 60.0


def test_single_file_checkpoint_gives_the_images_of_its_folder(
    cache: ModelCache, hub_folder: Path, tmp_path: Path
) -> None:
    folder = ModelSource(str(hub_folder), variant="fp16")
    checkpoint = tmp_path / "sd-inpainting.safetensors"  # as A1111 and ComfyUI users have it
    save_file(ldm_checkpoint(cache.get(folder.key, FAMILY).pipe), str(checkpoint))
    single = ModelSource(str(checkpoint), config=str(hub_folder))
    assert not weights_differing(
        cache.get(single.key, FAMILY).pipe, cache.get(folder.key, FAMILY).pipe
    )
    assert_close_across_paths(_stock(cache, single), _stock(cache, folder))
    assert cache.get(single.key, FAMILY).fingerprint != cache.get(folder.key, FAMILY).fingerprint


BF16_SAME_EDIT_DB = 42.0


def test_bf16_runs_mask_aware_on_a_cpu(cache: ModelCache) -> None:
    plain, bf16 = ModelSource("retouch:tiny-sd"), ModelSource("retouch:tiny-sd", "bf16")
    loaded = cache.get(bf16.key, FAMILY)
    assert loaded.pipe.unet.dtype == torch.bfloat16
    assert loaded.fingerprint != cache.get(plain.key, FAMILY).fingerprint  # bakes differ
    editor = MaskAwareEditor(loaded.pipe, FAMILY, CPU)
    small = 64  # bf16 matmuls are slow on a CPU without bf16 units
    request, store = _request(np.ones((small, small), dtype=bool)), MemoryActivations()
    editor.bake(request.image, "a quiet street", 3, STEPS, GUIDANCE, store)
    edited = editor.edit(request, store, "np")
    # The served edit is stock's within bf16 rounding: at mask 1 both compute every token,
    # through other kernels (packed attention vs diffusers' processor), whose bf16 roundings
    # differ by CPU and thread count (47-54 dB on a 2-core AMD EPYC; bf16 vs fp32: >= 35).
    assert psnr(edited, editor.stock_edit(request, "np")) >= BF16_SAME_EDIT_DB
    assert psnr(edited, _stock(cache, plain, request)) >= 35.0  # bf16 rounding of fp32's
