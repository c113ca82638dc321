"""Where a template's rows rest must not change an edit: host rows gathered synchronously,
host rows streamed by the row loader, pinned slabs gathered on the GPU and rows resident in
GPU memory all give the same pixels. Run on the production shapes' classes (reduced scale),
so the bench's models go through the same code as users' models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retouch.functions.demo.images import template_image
from retouch.functions.demo.production import SHAPES, build_shape
from retouch.functions.families import family_spec
from retouch.platform.lab.bench.engine import aligned_mask
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.loader import LoadMode, RowLoader
from retouch.runtime.maskaware.store import MemoryActivations
from tests.support import CPU_SKIPPED_SHAPES

SIZE, STEPS = 128, 2
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ON_CPU = [s for s in sorted(SHAPES) if s not in CPU_SKIPPED_SHAPES]


def _setup(name: str, device: str) -> tuple[MaskAwareEditor, EditRequest, MemoryActivations]:
    shape, pipe = build_shape(
        name, device, scale=0.05, dtype=torch.float32 if device == "cpu" else None
    )
    editor = MaskAwareEditor(pipe, shape.family, device)
    template = template_image((SIZE, SIZE), seed=1)
    store = MemoryActivations()
    editor.bake(template, "a quiet street", 1, STEPS, 4.0, store)
    mask = aligned_mask(SIZE, 0.25, editor.model_family.token_cell(pipe))
    halo = family_spec(shape.family).halo
    request = EditRequest(
        template, mask, "a red bicycle", 7, STEPS, 4.0, "a quiet street", 1, 0, halo
    )
    return editor, request, store


def _edit(editor: MaskAwareEditor, request: EditRequest, store, mode: str | None) -> np.ndarray:
    loader = None if mode is None else RowLoader.for_editor(editor, mode)
    editor.set_row_loader(loader)
    try:
        return editor.edit(request, store, output_type="np")
    finally:
        editor.set_row_loader(None)
        if loader is not None:
            loader.close()


def test_production_shapes_keep_their_real_block_structure() -> None:
    """At any scale the builders keep the classes and block kinds of the real models."""
    _, flux = build_shape("flux-dev", "meta")
    assert len(flux.transformer.transformer_blocks) == 19
    assert len(flux.transformer.single_transformer_blocks) == 38
    assert flux.transformer.config.joint_attention_dim == 4096
    assert flux.transformer.dtype == torch.bfloat16
    _, fill = build_shape("flux-fill-dev", "meta")
    assert fill.transformer.config.in_channels == 384  # 64 latents + 64 masked image + 256 mask
    assert len(fill.transformer.single_transformer_blocks) == 38
    _, z_image = build_shape("z-image", "meta")
    assert (len(z_image.transformer.layers), z_image.transformer.config.dim) == (30, 3840)
    assert 6.15e9 < sum(p.numel() for p in z_image.transformer.parameters()) < 6.16e9  # 6.15 B
    _, sd3 = build_shape("sd3-medium", "meta")
    assert len(sd3.transformer.transformer_blocks) == 24
    _, sd2 = build_shape("sd2-inpaint", "meta")
    assert sd2.unet.config.block_out_channels == (320, 640, 1280, 1280)
    params = sum(p.numel() for p in sd2.unet.parameters())
    assert 860e6 < params < 870e6  # the SD2-inpainting UNet's 865 M
    _, sdxl = build_shape("sdxl-inpaint", "meta")
    assert sdxl.unet.config.transformer_layers_per_block == (1, 2, 10)
    assert 2.56e9 < sum(p.numel() for p in sdxl.unet.parameters()) < 2.58e9  # 2.567 B
    _, qwen = build_shape("qwen-image", "meta")
    assert len(qwen.transformer.transformer_blocks) == 60
    assert 20.4e9 < sum(p.numel() for p in qwen.transformer.parameters()) < 20.5e9  # 20.43 B
    assert qwen.vae_scale_factor == 8 and qwen.vae.config.base_dim == 96
    _, edit = build_shape("qwen-image-edit", "meta")  # Qwen-Image's MMDiT, reading an image
    assert dict(edit.transformer.config) == dict(qwen.transformer.config)
    vision, images = edit.text_encoder.config.vision_config, edit.processor.image_processor
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (
        images.patch_size, images.merge_size, images.temporal_patch_size)  # fmt: skip
    with pytest.raises(ValueError, match="scale"):
        build_shape("flux-dev", "meta", scale=1.5)


@pytest.mark.parametrize("name", ON_CPU)
def test_loader_and_sync_reads_give_identical_edits_on_cpu(name: str) -> None:
    editor, request, store = _setup(name, "cpu")
    synchronous = _edit(editor, request, store, None)
    streamed = _edit(editor, request, store, LoadMode.OVERLAPPED)
    assert np.isfinite(synchronous).all()
    np.testing.assert_array_equal(synchronous, streamed)


@cuda
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_device_tier_and_pinned_slabs_match_host_rows(name: str) -> None:
    editor, request, store = _setup(name, "cuda")
    host = _edit(editor, request, store, None)  # rows gathered on the host, copied
    loader = RowLoader.for_editor(editor, LoadMode.OVERLAPPED)
    editor.set_row_loader(loader)
    try:
        pinned = store.placed("cpu", pin=True)
        slabs = editor.edit(request, pinned, output_type="np")
        assert loader.totals.bytes > 0 and loader.totals.host_gathered == 0
        device = store.placed("cuda")
        before = loader.totals.bytes
        resident = editor.edit(request, device, output_type="np")
        assert loader.totals.bytes == before  # nothing crossed: the rows live on the GPU
    finally:
        editor.set_row_loader(None)
        loader.close()
    np.testing.assert_array_equal(host, slabs)
    np.testing.assert_array_equal(host, resident)


def test_fp8_rows_halve_the_bytes_and_stay_close() -> None:
    """fp8 codes with per-channel scales: half of bf16's bytes (plus one scale per
    channel), every value within e4m3's relative step of its channel's scale."""
    from retouch.runtime.maskaware.rowformat import FP8_MAX, decode

    torch.manual_seed(0)
    rows = (torch.randn(1, 4096, 256) * torch.logspace(-2, 2, 256)).to(torch.bfloat16)
    store = MemoryActivations()
    store.put(0, "b", "k", rows)
    fp8 = store.placed("cpu", fmt="fp8")
    assert fp8.nbytes <= store.nbytes / 2 + 256 * 4  # codes, and a float32 scale a channel
    codes, scale = fp8.encoded(0, "b", "k")
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (1, 1, 256)
    decoded = decode(codes, scale, torch.bfloat16)
    error = (decoded.float() - rows.float()).abs()
    assert (error <= scale * FP8_MAX * 2**-4 + 1e-6).all()
    assert fp8.get(0, "b", "k").dtype == torch.bfloat16
    assert torch.equal(fp8.get(0, "b", "k"), decoded)


def test_block_outputs_rest_in_int8_with_a_per_channel_offset() -> None:
    """Y in 8 uniform bits over each channel's own range: every value within half a step
    of its channel's scale, channels far off zero included (residual streams)."""
    torch.manual_seed(0)
    rows = (torch.randn(2, 1024, 64) + torch.linspace(-30, 30, 64)) * torch.logspace(-1, 1, 64)
    store = MemoryActivations()
    store.put(0, "b", "y", rows)
    packed = store.placed("cpu", fmt="fp8")
    codes, scale = packed.encoded(0, "b", "y")
    assert codes.dtype == torch.int8 and scale.shape == (2, 2, 1, 64)
    error = (packed.get(0, "b", "y") - rows).abs()
    assert (error <= scale[0] * 0.5 + 1e-5 * rows.abs()).all()
    assert packed.nbytes == rows.numel() + scale.numel() * 4  # a byte a value, the scales


@pytest.mark.parametrize("name", ["flux-dev"])
def test_fp8_rows_stream_like_synchronous_reads(name: str) -> None:
    editor, request, store = _setup(name, "cpu")
    fp8 = store.placed("cpu", fmt="fp8")
    synchronous = _edit(editor, request, fp8, None)
    streamed = _edit(editor, request, fp8, LoadMode.OVERLAPPED)
    np.testing.assert_array_equal(synchronous, streamed)
    assert np.abs(synchronous - _edit(editor, request, store, None)).mean() < 0.05


@cuda
def test_fp8_rows_decode_alike_on_host_and_gpu() -> None:
    editor, request, store = _setup("flux-dev", "cuda")
    host = _edit(editor, request, store.placed("cpu", fmt="fp8"), None)  # decoded on the host
    pinned = _edit(editor, request, store.placed("cpu", pin=True, fmt="fp8"), LoadMode.OVERLAPPED)
    # encoded on the host like the others: float→e4m3 rounding may differ between devices
    resident = _edit(editor, request, store.placed("cuda", fmt="fp8", encode_on="cpu"), None)
    np.testing.assert_allclose(host, pinned, atol=1e-2)
    np.testing.assert_allclose(host, resident, atol=1e-2)


def test_a_batch_mixing_resident_and_host_rows_loads_only_the_host_ones() -> None:
    """One request's rows resident (copied whole), the other's gathered by the loader."""
    editor, request, store = _setup("flux-dev", "cpu")
    resident = store.placed("cpu")
    other = EditRequest(
        request.image, request.mask, "a blue kite", 9, STEPS, 4.0, "a quiet street", 1
    )

    def edits(mode: LoadMode | None) -> list[np.ndarray]:
        loader = None if mode is None else RowLoader.for_editor(editor, mode)
        editor.set_row_loader(loader)
        try:
            states = [editor.prepare(request, resident), editor.prepare(other, store)]
            while not states[0].done:
                editor.step(states)
            return [editor.finish(s, "np") for s in states]
        finally:
            editor.set_row_loader(None)
            if loader is not None:
                loader.close()

    synchronous = edits(None)
    streamed = edits(LoadMode.OVERLAPPED)
    for a, b in zip(synchronous, streamed, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ON_CPU)
def test_a_batch_of_resident_templates_edits_as_host_rows_do(name: str) -> None:
    """Every request's rows resident (one concatenation and one scatter per block) gives
    the pixels that host rows gathered per request give, mask by mask."""
    editor, request, store = _setup(name, "cpu")
    second_image, second = template_image((SIZE, SIZE), seed=2), MemoryActivations()
    editor.bake(second_image, "a beach", 3, STEPS, 4.0, second)
    cell = editor.model_family.token_cell(editor.impl.pipe)
    mask = aligned_mask(SIZE, 0.4, cell)
    other = EditRequest(
        second_image, mask, "a blue kite", 9, STEPS, 4.0, "a beach", 3, 0, request.halo
    )

    def edits(first: MemoryActivations, then: MemoryActivations) -> list[np.ndarray]:
        states = [editor.prepare(request, first), editor.prepare(other, then)]
        while not states[0].done:
            editor.step(states)
        return [editor.finish(s, "np") for s in states]

    host = edits(store, second)
    for a, b in zip(host, edits(store.placed("cpu"), second.placed("cpu")), strict=True):
        np.testing.assert_array_equal(a, b)
