"""A function's ``storage`` setting in the served store: an fp8 bake is its own cache entry,
holds its keys and values as fp8 codes (about half of bf16's bytes), and every tier it is
read from (host, streamed by step, device) gives edits bit-identical to
``MemoryActivations.placed(fmt="fp8")`` of the same bake."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from retouch.cachestore.devicetier import DeviceTier
from retouch.cachestore.store import ActivationStore, HostTemplate, StoreConfig
from retouch.cachestore.streaming import StreamedTemplate
from retouch.functions.demo.images import template_image
from retouch.functions.demo.production import build_shape
from retouch.functions.spec import parse_spec
from retouch.platform.lab.bench.engine import aligned_mask
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.loader import LoadMode, RowLoader
from retouch.runtime.maskaware.store import TEMPLATE_STEP, MemoryActivations
from retouch.runtime.maskaware.storedrows import DecodedTemplate, decoded
from retouch.runtime.templates import Template, TemplateCache

SIZE, STEPS = 128, 4
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _spec(storage: str):
    return parse_spec(
        {
            "name": f"fn-{storage}",
            "model": "m",
            "family": "flux-inpaint",
            "resolution": SIZE,
            "steps": STEPS,
            "storage": storage,
            "templates": {"t": {"prompt": "a quiet street", "seed": 1}},
        }
    )


def _store(path: Path, budget: int = 1 << 30) -> ActivationStore:
    return ActivationStore(StoreConfig(path=path, host_budget_bytes=budget, map_size=1 << 28))


def _register(cache: TemplateCache, storage: str) -> Template:
    image = template_image((SIZE, SIZE), seed=1)
    (template,) = cache.register(_spec(storage), {"t": image}, "model-fp", {})
    return template


def _bake(cache: TemplateCache, template: Template, memory: MemoryActivations) -> None:
    """The served bake path, recording the tensors of ``memory``'s bake."""

    def record(writer) -> None:
        for (step, block, name), tensor in memory.tensors.items():
            writer.put(step, block, name, tensor.cpu())  # encoded on the host, as ``placed``

    cache.bake(template, record)
    assert template.error is None


def _memory_bake(device: str) -> tuple[MaskAwareEditor, EditRequest, MemoryActivations]:
    dtype = torch.float32 if device == "cpu" else None
    shape, pipe = build_shape("flux-dev", device, scale=0.05, dtype=dtype)
    editor = MaskAwareEditor(pipe, shape.family, device)
    image = template_image((SIZE, SIZE), seed=1)
    memory = MemoryActivations()
    editor.bake(image, "a quiet street", 1, STEPS, 4.0, memory)
    mask = aligned_mask(SIZE, 0.25, editor.model_family.token_cell(pipe))
    request = EditRequest(image, mask, "a red bicycle", 7, STEPS, 4.0, "a quiet street", 1)
    return editor, request, memory


@pytest.fixture(scope="module")
def baked() -> tuple[MaskAwareEditor, EditRequest, MemoryActivations]:
    return _memory_bake("cpu")


def _edits(editor: MaskAwareEditor, request: EditRequest, reader) -> list[np.ndarray]:
    """The edit read synchronously and through the overlapped row loader."""
    out = []
    for mode in (None, LoadMode.OVERLAPPED):
        loader = None if mode is None else RowLoader.for_editor(editor, mode)
        editor.set_row_loader(loader)
        try:
            out.append(editor.edit(request, reader, output_type="np"))
        finally:
            editor.set_row_loader(None)
            if loader is not None:
                loader.close()
    return out


def test_storage_is_part_of_the_cache_key(tmp_path: Path) -> None:
    with _store(tmp_path / "c") as store:
        cache = TemplateCache(store)
        native, fp8 = _register(cache, "native"), _register(cache, "fp8")
        assert native.key != fp8.key  # changing the setting re-bakes
        assert _register(cache, "fp8").key == fp8.key


def test_an_fp8_bake_stores_every_row_in_8_bits(tmp_path: Path) -> None:
    """bf16 keys, values and block outputs: the fp8 bake's bytes for them are half the
    native bake's, plus one float32 scale per channel (and one offset for Y); keys and
    values are e4m3 codes, Y int8; per-template tensors are kept as recorded."""
    memory = MemoryActivations()
    torch.manual_seed(0)
    for step in range(2):
        for name in ("k", "v", "y"):
            memory.put(step, "b0", name, torch.randn(2, 256, 64).to(torch.bfloat16))
    memory.put(TEMPLATE_STEP, "template", "noise", torch.randn(1, 16, 8, 8))
    with _store(tmp_path / "c") as store:
        cache = TemplateCache(store)
        native, fp8 = _register(cache, "native"), _register(cache, "fp8")
        _bake(cache, native, memory)
        _bake(cache, fp8, memory)
        store.flush()
        entries = {row["key"]: row for row in store.ls()}
        assert store.nbytes(fp8.key) < store.nbytes(native.key) == native.nbytes
        assert fp8.nbytes == store.nbytes(fp8.key)  # what the executor reports
        with store.acquire(native.key) as n, store.acquire(fp8.key) as f:
            rows = [s for s in n.slots() if s[0] != TEMPLATE_STEP]
            native_rows = sum(n.get(*s).nbytes for s in rows)
            fp8_rows = sum(
                f.get(*s).nbytes + f.get(s[0], s[1], s[2] + ".scale").nbytes for s in rows
            )
            kv, y = [s for s in rows if s[2] != "y"], [s for s in rows if s[2] == "y"]
            scales = (len(kv) + 2 * len(y)) * 2 * 64 * 4  # [2, 1, 64] each; Y: and offsets
            assert fp8_rows == native_rows // 2 + scales
            assert all(f.get(*s).dtype == torch.float8_e4m3fn for s in kv)
            assert all(f.get(*s).dtype == torch.int8 for s in y)
            for s in n.slots():
                if s not in rows:
                    assert torch.equal(f.get(*s), n.get(*s))
        assert entries[fp8.key]["meta"]["rows"] == "fp8"


def test_fp8_edits_from_the_host_tier_match_memory(tmp_path: Path, baked) -> None:
    editor, request, memory = baked
    expected = _edits(editor, request, memory.placed("cpu", fmt="fp8"))
    with _store(tmp_path / "c") as store:
        cache = TemplateCache(store)
        template = _register(cache, "fp8")
        _bake(cache, template, memory)
        got = cache.acquire(template)
        assert isinstance(got.handle, DecodedTemplate)
        assert isinstance(got.handle.handle, HostTemplate)
        try:
            edits = _edits(editor, request, got.handle)
        finally:
            got.handle.release()
    for edit in edits:
        np.testing.assert_array_equal(edit, expected[0])
    np.testing.assert_array_equal(expected[0], expected[1])
    native = _edits(editor, request, memory)[0]
    assert not np.array_equal(expected[0], native)  # the codes are what was read
    assert np.abs(expected[0] - native).mean() < 0.05


def test_fp8_edits_streamed_by_step_match_memory(tmp_path: Path, baked) -> None:
    editor, request, memory = baked
    expected = _edits(editor, request, memory.placed("cpu", fmt="fp8"))[0]
    with _store(tmp_path / "c") as store:
        cache = TemplateCache(store)
        template = _register(cache, "fp8")
        _bake(cache, template, memory)
        store.flush()
        with store.acquire(template.key) as handle:
            step_bytes = sum(handle.get(*s).nbytes for s in handle.slots() if s[0] == 0)
    with _store(tmp_path / "c", int(step_bytes * 3.5)) as small:  # ~3 of 4 steps fit
        before = small.stats()
        with small.acquire(template.key) as handle:
            assert isinstance(handle, StreamedTemplate)
            edits = _edits(editor, request, decoded(handle))
        assert small.stats()["streamed_steps"] - before["streamed_steps"] >= STEPS
    for edit in edits:
        np.testing.assert_array_equal(edit, expected)


def test_fp8_edits_from_the_device_tier_match_memory(tmp_path: Path, baked) -> None:
    """The device tier (CPU memory here) holds the codes and decodes them as blocks copy."""
    editor, request, memory = baked
    expected = _edits(editor, request, memory.placed("cpu", fmt="fp8"))[0]
    tier = DeviceTier(torch.device("cpu"), budget=1 << 30)
    with _store(tmp_path / "c") as store:
        cache = TemplateCache(store, device_tier=tier)
        template = _register(cache, "fp8")
        _bake(cache, template, memory)
        cache.acquire(template).handle.release()  # from the host tier; promotes it
        tier.wait()
        got = cache.acquire(template)
        assert got.tier == "device"
        try:
            placed = memory.placed("cpu", fmt="fp8")
            step_bytes = [
                sum(t.nbytes for (s, _, _), t in table.items() if s != TEMPLATE_STEP)
                for table in (memory.tensors, placed.tensors, placed.scales)
            ]
            # the tier holds the codes and scales, not decoded rows
            assert tier.usage()["device_bytes"] == step_bytes[1] + step_bytes[2] < step_bytes[0]
            edits = _edits(editor, request, got.handle)
        finally:
            got.handle.release()
        tier.close()
    for edit in edits:
        np.testing.assert_array_equal(edit, expected)


@cuda
def test_fp8_pinned_host_tier_decodes_on_the_gpu_like_memory(tmp_path: Path) -> None:
    """Pinned host codes cross by DMA and are decoded on the GPU (the loader's slabs), as
    from ``MemoryActivations.placed(pin=True, fmt="fp8")``."""
    editor, request, memory = _memory_bake("cuda")
    expected = _edits(editor, request, memory.placed("cpu", pin=True, fmt="fp8", encode_on="cpu"))
    config = StoreConfig(path=tmp_path / "c", map_size=1 << 28, pin_memory=True)
    with ActivationStore(config) as store:
        cache = TemplateCache(store)
        template = _register(cache, "fp8")
        _bake(cache, template, memory)
        got = cache.acquire(template)
        try:
            assert got.handle.streams_to(torch.device("cuda"))
            edits = _edits(editor, request, got.handle)
        finally:
            got.handle.release()
    for edit, want in zip(edits, expected, strict=True):
        np.testing.assert_array_equal(edit, want)
