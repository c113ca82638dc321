"""The ``flux2-klein`` family against the stock Flux2KleinInpaintPipeline.

The other families' checks (``test_flux_kontext.py`` beside it): an exact cache (baked with
the edit's own mask, prompt and seed) reproduces the stock pipeline run with the same
composed noise, also at mask 1.0; plans mixing full and sparse blocks (FLUX.2's double- and
single-stream blocks both ways) and the row loader change nothing; a request inside a batch
gives its solo result; a worker's pipeline without the transformer encodes and decodes the
same; the analytic FLOPs equal what torch counts. FLUX.2 [klein]'s own: the template's
condition tokens follow the edited ones and come from the bake; the soft mask computes every
token it touches; a Klein folder is told apart from Kontext's and a folder missing a file is
refused naming it; a LoRA of its transformer serves what diffusers' ``load_lora_weights``
gives.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from retouch.functions.demo.images import template_image
from retouch.functions.errors import InvalidSpec
from retouch.functions.modelcheck import check_model, model_family
from retouch.functions.modelsource import ModelSource
from retouch.runtime.maskaware.context import Mode
from retouch.runtime.maskaware.editor import MaskAwareEditor
from retouch.runtime.maskaware.templatelayout import recorded_tensors
from tests.runtime.families.cases import CPU, Case
from tests.runtime.families.cases import close as _close

FAMILY = "flux2-klein"
CASE = Case(FAMILY, guidance=1.0)
SIZE, STEPS = CASE.size, CASE.steps
_rect, _request, _exact = CASE.rect, CASE.request, CASE.exact
# 128 px, factor-4 VAE, 2x2 patches: 16 x 16 edited tokens of 8 px, then as many condition
# tokens of the template's
TOKENS = (SIZE // 8) ** 2


folder, pipe, baked = CASE.fixtures("retouch:tiny-flux2-klein")


@pytest.mark.parametrize(
    "mask",
    [_rect(12, 20, 40, 50), _rect(70, 8, 30, 100), np.ones((SIZE, SIZE), bool)],
    ids=["door", "band", "everything"],
)
def test_exact_cache_reproduces_the_stock_pipeline(pipe, mask: np.ndarray) -> None:
    CASE.assert_exact_cache_gives_the_stock_edit(pipe, mask)


def test_the_condition_tokens_follow_the_edited_ones_and_come_from_the_bake(pipe, baked) -> None:
    """The grid holds the edited tokens then the template's condition tokens (T=10), none
    of those masked; a mask edge through a token makes its blend weight soft and the token
    computed; the bake stores K/V/Y rows of both, as the template layout says."""
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request = _request(_rect(28, 28, 24, 24), "a red door", 9, ("a quiet street", 3))
    state = editor.prepare(request, baked)
    (tokens,) = state.tokens.values()
    assert tokens.n_tokens == 2 * TOKENS
    # The bilinear resize reads each 8 px token at its two centre pixels a side (8i + 3,
    # 8i + 4): rows and columns 28..51 cover both for tokens 4 and 5, one for tokens 3 and 6
    assert tokens.count == 16 and int(tokens.masked.max()) < TOKENS
    weights = state.inputs.mask[0, :, 0]
    assert ((weights > 0) & (weights < 1)).sum() == 12 and (weights == 1).sum() == 4
    ids = state.inputs.image_ids
    assert ids.shape == (2 * TOKENS, 4)
    assert (ids[TOKENS:, 0] == 10).all() and (ids[:TOKENS, 0] == 0).all()
    first, last = editor.blocks[0], editor.blocks[-1]  # a double- and a single-stream block
    layout = {
        (step, block, name): shape
        for step, block, name, _, shape in recorded_tensors(editor, SIZE, SIZE, STEPS)
    }
    for block in (first, last):
        for name in ("k", "v", "y"):
            assert baked.get(0, block, name).shape[1] == 2 * TOKENS
            assert layout[0, block, name] == tuple(baked.get(0, block, name).shape)


def test_an_image_reference_is_refused(pipe, baked) -> None:
    """FLUX.2 [klein] could read another reference image; it would change every token's
    activations, so this family reads none rather than ignore it."""
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request = _request(_rect(12, 20, 40, 50), "a red door", 5, ("a quiet street", 3))
    request = dataclasses.replace(request, reference=template_image((SIZE, SIZE), 3))
    with pytest.raises(ValueError, match="image_reference"):
        editor.prepare(request, baked)


def test_mixed_plans_and_the_row_loader_change_nothing(pipe) -> None:
    editor = MaskAwareEditor(pipe, FAMILY, CPU)
    request, store = _exact(editor, _rect(12, 20, 40, 50))
    double, single = editor.blocks[0], editor.blocks[1]
    last = editor.blocks[-1]
    plans = [
        {b: Mode.FULL if b == last else Mode.SPARSE for b in editor.blocks},
        {b: Mode.SPARSE if b == last else Mode.FULL for b in editor.blocks},
        # sparse double-stream, full single-stream, then sparse again
        {b: Mode.FULL if b == single else Mode.SPARSE for b in editor.blocks},
        {b: Mode.FULL if b == double else Mode.SPARSE for b in editor.blocks},
    ]
    CASE.assert_plans_and_the_loader_change_nothing(editor, request, store, plans)


def test_a_request_in_a_batch_gives_its_solo_result(pipe, baked) -> None:
    CASE.assert_batch_gives_solo(MaskAwareEditor(pipe, FAMILY, CPU), baked)


def test_a_worker_pipeline_without_the_transformer_encodes_and_decodes_the_same(
    pipe, folder: Path
) -> None:
    packed = torch.randn(1, TOKENS, 128)
    names = CASE.assert_worker_encodes_and_decodes_alike(pipe, folder, packed)
    assert names == {"mask", "noise", "prompt_embeds", "text_ids", "image_latents"}


def test_analytic_flops_equal_the_counted_step(pipe, baked) -> None:
    mask = _rect(16, 32, 64, 32)  # aligned to the 8 px tokens: ratio 0.125
    requests = [_request(mask, "xyz", 2 + i, ("a quiet street", 3)) for i in range(2)]
    assert 0.05 < CASE.counted_flops_ratio(pipe, requests, baked) < 0.5


def test_a_klein_folder_is_told_apart_and_a_missing_file_is_named(
    folder: Path, tmp_path: Path
) -> None:
    """A folder saved from Flux2KleinInpaintPipeline is a flux2-klein model; deploying it
    as flux-kontext is refused before anything loads, and so is a copy without its text
    encoder's weights or with a VAE file that is no safetensors, naming that file."""
    assert model_family(str(folder)) == FAMILY
    check_model(ModelSource(str(folder)), FAMILY)
    with pytest.raises(InvalidSpec, match="cannot serve flux-kontext"):
        check_model(ModelSource(str(folder)), "flux-kontext")
    copy = shutil.copytree(folder, tmp_path / "klein")
    (copy / "text_encoder" / "model.safetensors").unlink()
    with pytest.raises(InvalidSpec, match=r"text_encoder/model\.safetensors") as refused:
        check_model(ModelSource(str(copy)), FAMILY)
    assert refused.value.status == 422 and refused.value.field == "model"
    foreign = copy / "vae" / "diffusion_pytorch_model.safetensors"
    foreign.write_bytes(b"not a safetensors file")
    (copy / "text_encoder" / "model.safetensors").symlink_to(
        folder / "text_encoder" / "model.safetensors"
    )
    with pytest.raises(InvalidSpec, match=r"vae/diffusion_pytorch_model\.safetensors is") as bad:
        check_model(ModelSource(str(copy)), FAMILY)
    assert bad.value.status == 422 and bad.value.field == "model"


def test_a_base_klein_folder_is_refused(folder: Path, tmp_path: Path) -> None:
    """FLUX.2 [klein] base (``is_distilled`` false, or absent: the pipeline's default)
    guides with a second, unconditional row, which this family does not run: refused at
    deploy, naming the entry."""
    copy = shutil.copytree(folder, tmp_path / "base")
    index = json.loads((copy / "model_index.json").read_text())
    assert index["is_distilled"] is True
    for entry in ({"is_distilled": False}, {}):
        rest = {k: v for k, v in index.items() if k != "is_distilled"}
        (copy / "model_index.json").write_text(json.dumps({**rest, **entry}))
        with pytest.raises(InvalidSpec, match="is_distilled is False") as refused:
            check_model(ModelSource(str(copy)), FAMILY)
        assert refused.value.status == 422 and refused.value.field == "model"


def test_a_lora_on_the_klein_transformer_serves_what_diffusers_loads(
    folder: Path, models_dir: Path, tmp_path: Path
) -> None:
    """A LoRA of the double-stream blocks' attention (``to_q/k/v/out``; PEFT finds none in
    the single-stream blocks' fused projections), attached as an executor attaches
    adapters, serves what diffusers' ``load_lora_weights`` gives."""
    ours, stock, bare = CASE.lora_edit_and_stock(
        "retouch:tiny-flux2-klein", folder, models_dir, tmp_path, std=0.5
    )
    _close(ours, stock)
    assert np.abs(ours - bare).max() > 0.05  # the LoRA reached the transformer
