"""The analytic FLOP count against what the two paths actually run, and its sanity."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxInpaintPipeline, StableDiffusionInpaintPipeline
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from retouch.functions.demo.images import template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.runtime.families.stepflops import pipeline_step_flops, step_flops
from retouch.runtime.maskaware.context import Mode
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.store import MemoryActivations

SIZE = 128
MODELS = {
    "sd-inpaint": ("retouch:tiny-sd", StableDiffusionInpaintPipeline),
    "flux-inpaint": ("retouch:tiny-flux", FluxInpaintPipeline),
}
# torch's counter knows the CUDA attention kernels; teach it the CPU one.
CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: (
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)
    )
}


def _all_full(states, blocks):
    return dict.fromkeys(blocks, Mode.FULL)


def _counted_step(editor: MaskAwareEditor, requests: list[EditRequest], store) -> int:
    states = [editor.prepare(r, store) for r in requests]  # text/VAE encoders stay uncounted
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        editor.step(states)
    return counter.get_total_flops()


@pytest.mark.parametrize("family", list(MODELS))
def test_analytic_count_matches_the_counted_step(family: str, models_dir: Path) -> None:
    model, loader = MODELS[family]
    pipe = loader.from_pretrained(ensure_demo_model(model, models_dir))
    pipe.set_progress_bar_config(disable=True)
    image = template_image((SIZE, SIZE), 2)
    mask = np.zeros((SIZE, SIZE), dtype=bool)
    mask[16:80, 32:64] = True  # aligned to every token grid: ratio 0.125 on each
    store = MemoryActivations()
    MaskAwareEditor(pipe, family, "cpu").bake(image, "abc", 1, 1, 4.0, store)
    requests = [EditRequest(image, mask, "xyz", 2 + i, 1, 4.0, "abc", 1) for i in range(2)]
    analytic = pipeline_step_flops(pipe, family, SIZE, SIZE, float(mask.mean()), batch=2)

    sparse = _counted_step(MaskAwareEditor(pipe, family, "cpu"), requests, store)
    full = _counted_step(MaskAwareEditor(pipe, family, "cpu", plan=_all_full), requests, store)
    assert sparse == pytest.approx(analytic.maskaware.total, rel=1e-9)
    assert full == pytest.approx(analytic.full.total, rel=1e-9)


@pytest.mark.parametrize(
    ("family", "config", "latent"),
    [
        (
            "sd-inpaint",
            {
                "block_out_channels": (320, 640),
                "layers_per_block": 1,
                "in_channels": 9,
                "out_channels": 4,
                "cross_attention_dim": 64,
            },
            (64, 64),
        ),
        (
            "flux-inpaint",
            {
                "num_attention_heads": 6,
                "attention_head_dim": 64,
                "in_channels": 64,
                "num_layers": 2,
                "num_single_layers": 4,
                "joint_attention_dim": 64,
                "pooled_projection_dim": 64,
                "guidance_embeds": True,
            },
            (128, 128),
        ),
    ],
)
def test_flops_scale_sensibly(family: str, config: dict, latent: tuple[int, int]) -> None:
    def flops(ratio: float, batch: int = 1) -> tuple[float, float]:
        return step_flops(family, config, ratio, batch, latent_size=latent, text_len=16)

    ratios = [0.0, 0.05, 0.2, 0.5, 1.0]
    sparse = [flops(r)[1] for r in ratios]
    assert sparse == sorted(sparse) and len(set(sparse)) == len(sparse)
    full, at_one = flops(1.0)
    assert at_one == pytest.approx(full)
    assert {flops(r)[0] for r in ratios} == {full}
    assert flops(0.2, batch=4)[1] == pytest.approx(4 * flops(0.2)[1])
    assert 0 < sparse[0] / full < 0.5  # convs (UNet) and text tokens (DiT) always run
    with pytest.raises(ValueError, match="mask ratio"):
        flops(1.5)
