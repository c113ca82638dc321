"""Mask-aware edits against the stock pipeline when the cache is exact, and batching.

An edit whose template was baked with the edit's own mask, prompt and seed has a cache that
is exactly what the stock pipeline computes, so the mask-aware output must equal the stock
output; with mask ratio 1.0 nothing is read from the cache at all.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxInpaintPipeline, StableDiffusionInpaintPipeline
from PIL import Image

from retouch.functions.demo.images import mask_of_ratio, template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.runtime.maskaware.context import Mode
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.store import MemoryActivations

SIZE = 128
STEPS = 2
EXACT = 1e-5  # fp32, max abs difference of [0, 1] images
FAMILIES = {"sd-inpaint": "retouch:tiny-sd", "flux-inpaint": "retouch:tiny-flux"}
LOADERS = {"sd-inpaint": StableDiffusionInpaintPipeline, "flux-inpaint": FluxInpaintPipeline}


@pytest.fixture(scope="module", params=list(FAMILIES))
def pipe(request: pytest.FixtureRequest, models_dir: Path):
    family = request.param
    loaded = LOADERS[family].from_pretrained(ensure_demo_model(FAMILIES[family], models_dir))
    loaded.set_progress_bar_config(disable=True)
    loaded.family = family
    return loaded


def _editor(pipe, **kwargs) -> MaskAwareEditor:
    return MaskAwareEditor(pipe, pipe.family, torch.device("cpu"), **kwargs)


def _rect(ratio: float) -> np.ndarray:
    side = round(SIZE * np.sqrt(ratio))
    mask = np.zeros((SIZE, SIZE), dtype=bool)
    mask[12 : 12 + side, 20 : 20 + side] = True
    return mask


def _irregular() -> np.ndarray:
    yy, xx = np.mgrid[:SIZE, :SIZE]
    ellipse = (xx - 60) ** 2 / 900 + (yy - 50) ** 2 / 400 < 1
    stripes = (xx > 90) & (yy > 70) & ((xx + yy) % 7 < 3)  # thin, partly below latent size
    return ellipse | stripes | mask_of_ratio((SIZE, SIZE), 0.08, "blob", seed=5)


def _request(
    image: Image.Image, mask: np.ndarray, prompt: str, seed: int, template: tuple[str, int]
) -> EditRequest:
    return EditRequest(image, mask, prompt, seed, STEPS, 4.0, *template)


MASKS = {"rect-0.1": lambda: _rect(0.1), "rect-0.3": lambda: _rect(0.3), "irregular": _irregular}


@pytest.mark.parametrize("mask_name", list(MASKS))
def test_exact_cache_reproduces_the_stock_pipeline(pipe, mask_name: str) -> None:
    editor = _editor(pipe)
    image, mask = template_image((SIZE, SIZE), 7), MASKS[mask_name]()
    store = MemoryActivations()
    editor.bake(image, "a red door", 11, STEPS, 4.0, store, mask=mask)
    request = _request(image, mask, "a red door", 11, ("a red door", 11))
    edited, stock = editor.edit(request, store, "np"), editor.stock_edit(request, "np")
    assert np.abs(edited - stock).max() <= EXACT


def test_full_mask_equals_stock_whatever_was_baked(pipe) -> None:
    editor = _editor(pipe)
    image = template_image((SIZE, SIZE), 8)
    store = MemoryActivations()
    editor.bake(image, "an empty field", 3, STEPS, 4.0, store)
    request = _request(image, np.ones((SIZE, SIZE), bool), "a blue car", 21, ("an empty field", 3))
    edited, stock = editor.edit(request, store, "np"), editor.stock_edit(request, "np")
    assert np.abs(edited - stock).max() <= EXACT


def test_mixed_plan_with_full_blocks_is_exact(pipe) -> None:
    """A full block after a sparse one starts from the cached Y of the block before it."""

    def alternate(states, blocks):
        return {b: Mode.FULL if i % 2 else Mode.SPARSE for i, b in enumerate(blocks)}

    image, mask = template_image((SIZE, SIZE), 9), _rect(0.2)
    for packed in (True, False):
        editor = _editor(pipe, packed=packed, plan=alternate)
        store = MemoryActivations()
        editor.bake(image, "a tree", 4, STEPS, 4.0, store, mask=mask)
        request = _request(image, mask, "a tree", 4, ("a tree", 4))
        assert (
            np.abs(editor.edit(request, store, "np") - editor.stock_edit(request, "np")).max()
            <= EXACT
        )


def test_warmup_over_every_step_equals_stock_whatever_was_baked(pipe) -> None:
    """``full_steps`` covering the edit computes every token in every step and reads no row."""
    editor = _editor(pipe)
    image, mask = template_image((SIZE, SIZE), 15), _rect(0.2)
    store = MemoryActivations()
    editor.bake(image, "a garden", 3, STEPS, 4.0, store)
    request = EditRequest(image, mask, "a bench", 9, STEPS, 4.0, "a garden", 3, STEPS)
    edited, stock = editor.edit(request, store, "np"), editor.stock_edit(request, "np")
    assert np.abs(edited - stock).max() <= EXACT


def test_a_warming_request_in_a_batch_matches_its_solo_run(pipe) -> None:
    """One request in its warm-up step and one mask-aware share a step; then both sparse."""
    editor = _editor(pipe)
    image, store = template_image((SIZE, SIZE), 16), MemoryActivations()
    editor.bake(image, "a harbour", 5, STEPS + 1, 4.0, store)
    warm = EditRequest(image, _rect(0.1), "a boat", 1, STEPS + 1, 4.0, "a harbour", 5, 1)
    cold = EditRequest(image, _rect(0.3), "a gull", 2, STEPS + 1, 4.0, "a harbour", 5)
    solo = [editor.edit(r, store, "np") for r in (warm, cold)]
    states = [editor.prepare(r, store) for r in (warm, cold)]
    assert states[0].warming and not states[1].warming
    while not states[0].done:
        editor.step(states)
    for state, alone in zip(states, solo, strict=True):
        assert np.abs(editor.finish(state, "np") - alone).max() <= 1e-4


@pytest.fixture(scope="module")
def three(pipe) -> tuple[list[EditRequest], list[MemoryActivations]]:
    """Different templates, masks, prompts, seeds and guidance; one has more steps."""
    editor = _editor(pipe)
    requests, stores = [], []
    for i, (ratio, steps) in enumerate([(0.05, STEPS), (0.2, STEPS + 1), (0.5, STEPS)]):
        image = template_image((SIZE, SIZE), 30 + i)
        store = MemoryActivations()
        editor.bake(image, f"template {i}", 40 + i, steps, 4.0 + i, store)
        mask = mask_of_ratio((SIZE, SIZE), ratio, ("rect", "ellipse", "blob")[i], seed=i)
        requests.append(
            EditRequest(image, mask, f"edit {i}", 50 + i, steps, 4.0 + i, f"template {i}", 40 + i)
        )
        stores.append(store)
    return requests, stores


def test_requests_in_one_batch_match_their_solo_runs(pipe, three) -> None:
    editor = _editor(pipe)
    requests, stores = three
    solo = [editor.edit(r, s, "np") for r, s in zip(requests, stores, strict=True)]
    states = [editor.prepare(r, s) for r, s in zip(requests, stores, strict=True)]
    editor.step(states[:1])  # stagger: the requests sit at different timesteps
    editor.step(states[:2])
    while any(not s.done for s in states):
        editor.step([s for s in states if not s.done])
    for state, alone in zip(states, solo, strict=True):
        assert np.abs(editor.finish(state, "np") - alone).max() <= 1e-4


def test_packed_and_padded_layouts_agree(pipe, three) -> None:
    requests, stores = three
    outputs = {}
    for packed in (True, False):
        editor = _editor(pipe, packed=packed)
        states = [editor.prepare(r, s) for r, s in zip(requests, stores, strict=True)]
        while any(not s.done for s in states):
            editor.step([s for s in states if not s.done])
        outputs[packed] = [editor.finish(s, "np") for s in states]
    for a, b in zip(outputs[True], outputs[False], strict=True):
        assert np.abs(a - b).max() <= EXACT


def _plain_call(pipe, image: Image.Image, mask: np.ndarray) -> np.ndarray:
    """The stock pipeline called directly, as a user would."""
    kwargs = {"max_sequence_length": 16} if pipe.family == "flux-inpaint" else {}
    return pipe(
        prompt="a cat",
        image=image,
        mask_image=Image.fromarray(mask.astype(np.uint8) * 255),
        height=SIZE,
        width=SIZE,
        strength=1.0,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
        **kwargs,
    ).images[0]


def test_wrappers_leave_the_weights_and_the_stock_pipeline_alone(models_dir: Path) -> None:
    for family, model in FAMILIES.items():
        fresh = LOADERS[family].from_pretrained(ensure_demo_model(model, models_dir))
        fresh.set_progress_bar_config(disable=True)
        fresh.family = family
        image, mask = template_image((SIZE, SIZE), 12), _rect(0.2)
        untouched = _plain_call(fresh, image, mask)
        denoiser = fresh.unet if family == "sd-inpaint" else fresh.transformer
        weights = {k: v.clone() for k, v in denoiser.state_dict().items()}
        editor = _editor(fresh)
        store = MemoryActivations()
        editor.bake(image, "a dog", 6, STEPS, 4.0, store)
        editor.edit(_request(image, mask, "a cat", 5, ("a dog", 6)), store)
        assert np.abs(_plain_call(fresh, image, mask) - untouched).max() == 0
        assert all(torch.equal(v, weights[k]) for k, v in denoiser.state_dict().items())


def test_step_refuses_finished_requests(pipe) -> None:
    editor = _editor(pipe)
    image = template_image((SIZE, SIZE), 13)
    store = MemoryActivations()
    editor.bake(image, "x", 1, 1, 4.0, store)
    state = editor.prepare(EditRequest(image, _rect(0.1), "y", 2, 1, 4.0, "x", 1), store)
    editor.step([state])
    assert state.done
    with pytest.raises(ValueError, match="finished"):
        editor.step([state])
    assert editor.finish(state).size == (SIZE, SIZE)


def test_an_empty_mask_rides_along_in_a_batch(pipe) -> None:
    """A request with nothing masked computes no image token (Flux: the template exactly)."""
    editor = _editor(pipe)
    image = template_image((SIZE, SIZE), 14)
    store = MemoryActivations()
    editor.bake(image, "a", 1, 2, 4.0, store)
    empty = EditRequest(image, np.zeros((SIZE, SIZE), bool), "b", 2, 2, 4.0, "a", 1)
    other = EditRequest(image, _rect(0.2), "b", 3, 2, 4.0, "a", 1)
    states = [editor.prepare(r, store) for r in (empty, other)]
    assert states[0].tokens and all(t.count == 0 for t in states[0].tokens.values())
    while not states[0].done:
        editor.step(states)
    out = editor.finish(states[0], "np")
    assert out.shape == (SIZE, SIZE, 3) and np.isfinite(out).all()
    if pipe.family == "flux-inpaint":
        assert np.abs(out - editor.stock_edit(empty, "np")).max() <= EXACT
