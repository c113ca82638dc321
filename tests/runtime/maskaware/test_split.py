"""The editor's encode / assemble / step / final_latents / decode split, in one process.

A request whose template has no cache (``reader=None``) computes every token, so it rides
in a batch with mask-aware requests and still gives the stock pipeline's result.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxInpaintPipeline, StableDiffusionInpaintPipeline

from retouch.functions.demo.images import mask_of_ratio, template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor, OutputSize
from retouch.runtime.maskaware.store import MemoryActivations

SIZE = 128
STEPS = 3
EXACT = 1e-5  # the mask-aware exactness tests' tolerance (fp32, [0, 1] images)
BATCHED = 1e-4  # a request in a batch against its solo run
MODELS = {
    "sd-inpaint": ("retouch:tiny-sd", StableDiffusionInpaintPipeline),
    "flux-inpaint": ("retouch:tiny-flux", FluxInpaintPipeline),
}


def _load(family: str, models_dir: Path, **without: None):
    model, loader = MODELS[family]
    pipe = loader.from_pretrained(ensure_demo_model(model, models_dir), **without)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module", params=list(MODELS))
def editor(request: pytest.FixtureRequest, models_dir: Path) -> MaskAwareEditor:
    torch.set_num_threads(1)
    return MaskAwareEditor(_load(request.param, models_dir), request.param, "cpu")


def _baked(editor: MaskAwareEditor, index: int) -> tuple[EditRequest, MemoryActivations]:
    image = template_image((SIZE, SIZE), 60 + index)
    store = MemoryActivations()
    editor.bake(image, f"template {index}", 70 + index, STEPS, 4.0, store)
    mask = mask_of_ratio((SIZE, SIZE), 0.15 + 0.1 * index, "ellipse", seed=index)
    request = EditRequest(
        image, mask, f"edit {index}", 80 + index, STEPS, 4.0, f"template {index}", 70 + index
    )
    return request, store


def _unbaked(steps: int = STEPS) -> EditRequest:
    image = template_image((SIZE, SIZE), 90)
    mask = mask_of_ratio((SIZE, SIZE), 0.25, "blob", seed=9)
    return EditRequest(image, mask, "a boat", 91, steps, 4.0, "a lake", 92)


def _run(editor: MaskAwareEditor, states: list) -> None:
    while any(not s.done for s in states):
        editor.step([s for s in states if not s.done])


def test_a_readerless_request_in_a_mask_aware_batch(editor: MaskAwareEditor) -> None:
    """Mixed batch = each one's solo run; the reader-less one = the stock pipeline."""
    baked = [_baked(editor, i) for i in range(2)]
    plain = _unbaked(STEPS + 1)  # also at other timesteps than the others
    pairs = [*baked, (plain, None)]
    solo = []
    for request, reader in pairs:
        state = editor.assemble(request, editor.encode(request), reader)
        _run(editor, [state])
        solo.append(editor.finish(state, "np"))
    states = [editor.assemble(r, editor.encode(r), reader) for r, reader in pairs]
    editor.step(states[2:])  # stagger: the reader-less request is one step ahead
    _run(editor, states)
    for state, alone in zip(states, solo, strict=True):
        assert np.abs(editor.finish(state, "np") - alone).max() <= BATCHED
    assert np.abs(solo[2] - editor.stock_edit(plain, "np")).max() <= EXACT


def test_readerless_token_sets_cover_every_token(editor: MaskAwareEditor) -> None:
    state = editor.prepare(_unbaked(), None)
    assert state.reader is None
    assert all(t.count == t.n_tokens and t.unmasked.numel() == 0 for t in state.tokens.values())


def test_prepare_and_finish_are_encode_assemble_and_decode(editor: MaskAwareEditor) -> None:
    request, store = _baked(editor, 2)
    split = editor.assemble(request, editor.encode(request), store)
    whole = editor.prepare(request, store)
    _run(editor, [split, whole])
    latents = editor.final_latents(split)
    assert latents.device.type == "cpu"
    assert torch.allclose(latents, editor.final_latents(whole), atol=BATCHED)
    by_size = editor.decode(latents, OutputSize(SIZE, SIZE), "np")
    assert np.abs(by_size - editor.finish(whole, "np")).max() <= BATCHED
    assert np.abs(editor.edit(request, store, "np") - by_size).max() <= BATCHED


def test_encoded_is_host_only_and_cache_independent(editor: MaskAwareEditor) -> None:
    request = _unbaked()
    encoded = editor.encode(request)
    assert (encoded.family, encoded.height, encoded.width) == (editor.family, SIZE, SIZE)
    assert all(t.device.type == "cpu" for t in encoded.tensors.values())
    again = editor.encode(request)
    assert all(torch.equal(encoded.tensors[k], again.tensors[k]) for k in encoded.tensors)


def test_a_worker_editor_without_denoiser_encodes_and_decodes_the_same(
    editor: MaskAwareEditor, models_dir: Path
) -> None:
    """What a pre/post worker loads: the pipeline without its UNet/transformer."""
    denoiser = "unet" if editor.family == "sd-inpaint" else "transformer"
    kwargs = {"safety_checker": None} if editor.family == "sd-inpaint" else {}
    bare = MaskAwareEditor(
        _load(editor.family, models_dir, **{denoiser: None}, **kwargs), editor.family, "cpu"
    )
    assert not bare.has_denoiser and bare.blocks == []
    request = _unbaked()
    ours, theirs = bare.encode(request), editor.encode(request)
    assert ours.tensors.keys() == theirs.tensors.keys()
    for key, tensor in theirs.tensors.items():
        assert torch.allclose(ours.tensors[key], tensor, atol=1e-6), key
    state = editor.assemble(request, ours, None)
    _run(editor, [state])
    latents = editor.final_latents(state)
    assert np.array_equal(
        np.asarray(bare.decode(latents, request)), np.asarray(editor.decode(latents, request))
    )
    with pytest.raises(RuntimeError, match="without its denoiser"):
        bare.assemble(request, ours, None)


def test_assemble_refuses_a_template_seed_that_was_not_baked(editor: MaskAwareEditor) -> None:
    request, store = _baked(editor, 3)
    wrong = EditRequest(
        request.image,
        request.mask,
        request.prompt,
        request.seed,
        STEPS,
        4.0,
        request.template_prompt,
        request.template_seed + 1,
    )
    with pytest.raises(ValueError, match="template_seed"):
        editor.assemble(wrong, editor.encode(wrong), store)


def test_assemble_refuses_an_encoding_of_another_size(editor: MaskAwareEditor) -> None:
    small = template_image((SIZE // 2, SIZE // 2), 5)
    other = EditRequest(small, np.ones((SIZE // 2, SIZE // 2), bool), "x", 1, STEPS, 4.0, "y", 2)
    with pytest.raises(ValueError, match="encoded for"):
        editor.assemble(_unbaked(), editor.encode(other), None)
