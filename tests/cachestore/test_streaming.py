"""A template bigger than the host tier is read step by step from disk, never loaded whole
per acquire, and gives the same edits as the host tier and as memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from retouch.cachestore.store import ActivationStore, StoreConfig
from retouch.cachestore.streaming import StreamedTemplate
from retouch.functions.demo.images import template_image
from retouch.functions.demo.production import build_shape
from retouch.platform.lab.bench.engine import aligned_mask
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.loader import LoadMode, RowLoader
from retouch.runtime.maskaware.store import MemoryActivations

SIZE, STEPS, KEY = 128, 4, "tpl"


def _store(path: Path, budget: int) -> ActivationStore:
    return ActivationStore(StoreConfig(path=path, host_budget_bytes=budget, map_size=1 << 28))


def test_big_template_streams_by_step_with_identical_edits(tmp_path: Path) -> None:
    shape, pipe = build_shape("flux-dev", "cpu", scale=0.05, dtype=torch.float32)
    editor = MaskAwareEditor(pipe, shape.family, "cpu")
    template = template_image((SIZE, SIZE), seed=1)
    memory = MemoryActivations()
    editor.bake(template, "a quiet street", 1, STEPS, 4.0, memory)
    step_bytes = sum(t.nbytes for (s, _, _), t in memory.tensors.items() if s == 0)
    with _store(tmp_path / "c", 1 << 30) as big:  # bake on disk
        with big.bake(KEY, {"function": "f"}) as writer:
            for (step, block, name), tensor in memory.tensors.items():
                writer.put(step, block, name, tensor)
        big.flush()
    mask = aligned_mask(SIZE, 0.25, editor.model_family.token_cell(pipe))
    request = EditRequest(template, mask, "a red bicycle", 7, STEPS, 4.0, "a quiet street", 1)
    expected = editor.edit(request, memory, output_type="np")

    with _store(tmp_path / "c", int(step_bytes * 3.5)) as small:  # holds ~3 steps, not 4
        for mode in (None, LoadMode.OVERLAPPED):
            loader = None if mode is None else RowLoader.for_editor(editor, mode)
            editor.set_row_loader(loader)
            before = small.stats()
            try:
                with small.acquire(KEY) as handle:
                    assert isinstance(handle, StreamedTemplate)
                    edited = editor.edit(request, handle, output_type="np")
            finally:
                editor.set_row_loader(None)
                if loader is not None:
                    loader.close()
            after = small.stats()
            np.testing.assert_array_equal(edited, expected)
            read = after["disk_bytes_read"] - before["disk_bytes_read"]
            # every step crossed once (plus the per-template tensors), nothing twice
            assert after["streamed_steps"] - before["streamed_steps"] == STEPS
            assert read < memory.nbytes * 1.01, (read, memory.nbytes)
        assert small.stats()["streamed"] == 2
        assert small.stats()["host_overcommits"] == 0
        assert small.prefetch(KEY).result() == 0  # a prefetch does not load it whole
