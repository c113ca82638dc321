"""``strength`` < 1 and ``negative_prompt`` against diffusers' own pipelines.

The served path without a cache (every token computed, as an edit before its bake runs) at
mask 1.0 must equal the family's diffusers pipeline called directly with the same
``strength`` and ``negative_prompt``: diffusers truncates the schedule, VAE-samples nothing
(it is given the same image latents) and draws the initial noise from a generator on the
request's seed, which is exactly the request's noise. A bake at that strength makes the
mask-aware edit reproduce the stock pipeline, as at strength 1.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import (
    FluxInpaintPipeline,
    StableDiffusion3InpaintPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionXLInpaintPipeline,
    ZImageInpaintPipeline,
)

from retouch.functions.demo.images import template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.families import family_spec
from retouch.runtime.maskaware import inpaint
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.noise import SeedNoise, vae_sample
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.models import load_pipeline
from tests.runtime.families.cases import CPU, close

SIZE, STEPS, GUIDANCE, STRENGTH = 64, 4, 4.0, 0.6  # SD keeps 2 steps, the flow families 3
NEGATIVE = "blurry"
MODELS = {
    "sd-inpaint": "retouch:tiny-sd",
    "sd3-inpaint": "retouch:tiny-sd3",
    "flux-inpaint": "retouch:tiny-flux",
}
PIPELINES = {
    "sd-inpaint": StableDiffusionInpaintPipeline,
    "sdxl-inpaint": StableDiffusionXLInpaintPipeline,
    "sd3-inpaint": StableDiffusion3InpaintPipeline,
    "flux-inpaint": FluxInpaintPipeline,
    "z-image": ZImageInpaintPipeline,
}


@pytest.fixture(scope="module", params=list(MODELS))
def editor(request: pytest.FixtureRequest, models_dir: Path) -> MaskAwareEditor:
    family = request.param
    pipe = load_pipeline(ensure_demo_model(MODELS[family], models_dir), family, CPU)
    return MaskAwareEditor(pipe, family, CPU)


def _negative(editor: MaskAwareEditor) -> str:
    return NEGATIVE if family_spec(editor.family).negative_prompt else ""


def _request(editor: MaskAwareEditor, mask: np.ndarray, seed: int, **changes) -> EditRequest:
    request = EditRequest(
        template_image((SIZE, SIZE), 7),
        mask,
        "a red door",
        seed,
        STEPS,
        GUIDANCE,
        "a quiet street",
        3,
        negative_prompt=_negative(editor),
        strength=STRENGTH,
    )
    return dataclasses.replace(request, **changes)


def _served(editor: MaskAwareEditor, request: EditRequest) -> np.ndarray:
    """The served path of a template without a bake: every token, no row read."""
    state = editor.prepare(request, None)
    assert len(state.timesteps) == family_spec(editor.family).steps_run(STEPS, request.strength)
    while not state.done:
        editor.step([state])
    return editor.finish(state, "np")


def _diffusers(editor: MaskAwareEditor, request: EditRequest) -> np.ndarray:
    """The family's pipeline called with ``strength`` and ``negative_prompt``, its noise
    from a generator on the request's seed, and the image as the served path encodes it."""
    pipe, impl = editor.impl.pipe, editor.impl
    shape = impl.noise_shape(SIZE, SIZE)
    if editor.family == "sd-inpaint":  # the whole image, sampled with the request's noise
        own = SeedNoise.draw(request.seed, shape, torch.float32)
        pixels = pipe.image_processor.preprocess(request.image, height=SIZE, width=SIZE)
        latents = pipe.vae.config.scaling_factor * vae_sample(pipe.vae, pixels, own.vae)
        extra = {"masked_image_latents": editor.encode(request).tensors["masked_image_latents"]}
    else:  # the blend families start from the template's latents (its seed's VAE noise)
        template = SeedNoise.draw(request.template_seed, shape, torch.float32)
        latents = inpaint.template_latents(pipe, request.image, template.vae, CPU, impl.dtype)
        extra = {"masked_image_latents": latents, **impl.stock_options()}
    negative = {"negative_prompt": request.negative_prompt} if request.negative_prompt else {}
    return pipe(
        prompt=request.prompt,
        image=latents,
        mask_image=request.mask_image(),
        height=SIZE,
        width=SIZE,
        strength=request.strength,
        num_inference_steps=STEPS,
        guidance_scale=GUIDANCE,
        generator=torch.Generator().manual_seed(request.seed),
        output_type="np",
        **negative,
        **extra,
    ).images[0]


def test_the_stock_path_at_strength_equals_diffusers(editor: MaskAwareEditor) -> None:
    """Mask 1.0, strength 0.6 and (CFG families) a negative prompt: diffusers' output."""
    request = _request(editor, np.ones((SIZE, SIZE), bool), seed=21)
    served = _served(editor, request)
    close(served, _diffusers(editor, request))
    close(served, editor.stock_edit(request, "np"))  # the reference benches compare with
    whole = _served(editor, _request(editor, request.mask, seed=21, strength=1.0))
    assert np.abs(served - whole).max() > 0.05  # the strength reached the schedule


def test_an_exact_bake_at_strength_reproduces_the_stock_pipeline(editor: MaskAwareEditor) -> None:
    """Baked at 0.6 with the edit's own mask, prompt and seed, the mask-aware edit at 0.6
    is the stock pipeline's (no negative prompt: the bake's unconditional branch has none)."""
    mask = np.zeros((SIZE, SIZE), bool)
    mask[8:40, 12:44] = True
    request = _request(editor, mask, seed=3, negative_prompt="", prompt="a quiet street")
    store = MemoryActivations()
    editor.bake(
        request.image, "a quiet street", 3, STEPS, GUIDANCE, store, mask=mask, strength=STRENGTH
    )
    close(editor.edit(request, store, "np"), editor.stock_edit(request, "np"))


def test_the_negative_prompt_reaches_the_unconditional_branch(editor: MaskAwareEditor) -> None:
    request = _request(editor, np.ones((SIZE, SIZE), bool), seed=1)
    if not family_spec(editor.family).negative_prompt:  # Flux: refused, never ignored
        with pytest.raises(ValueError, match="negative prompt"):
            editor.encode(dataclasses.replace(request, negative_prompt="x"))
        return
    plain = editor.encode(dataclasses.replace(request, negative_prompt="")).tensors
    negative = editor.encode(request).tensors
    assert not torch.equal(plain["prompt_embeds"][0], negative["prompt_embeds"][0])
    assert torch.equal(plain["prompt_embeds"][1], negative["prompt_embeds"][1])


@pytest.mark.parametrize("family", list(PIPELINES))
def test_steps_run_count_as_the_pipelines_get_timesteps(family: str) -> None:
    """The gateway's count (no torch there) against the pipeline's own ``get_timesteps``,
    where the two diffusers conventions differ (``10 * 0.7`` among them)."""
    spec = family_spec(family)
    for steps in range(1, 31):
        scheduler = SimpleNamespace(timesteps=torch.arange(steps), order=1)
        host = SimpleNamespace(scheduler=scheduler)
        for strength in [*np.linspace(0.01, 1.0, 100).tolist(), 0.3, 0.6, 0.7]:
            args = (host, steps, strength, CPU)
            _, run = PIPELINES[family].get_timesteps(*args)
            assert spec.steps_run(steps, strength) == run, (steps, strength)
