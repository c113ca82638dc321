"""The row loader: overlapped and sequential loading give exactly the synchronous results,
report their load wait, and hand loading errors to the block that needed the rows."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxInpaintPipeline, StableDiffusionInpaintPipeline

from retouch.cachestore.store import ActivationStore, StoreConfig
from retouch.functions.demo.images import mask_of_ratio, template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.runtime.maskaware.context import Mode
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.loader import FamilyRows, LoadMode, RowLoader, attach, family_rows
from retouch.runtime.maskaware.store import MemoryActivations

SIZE = 128
STEPS = 2
MODELS = {"sd-inpaint": "retouch:tiny-sd", "flux-inpaint": "retouch:tiny-flux"}
PIPELINES = {"sd-inpaint": StableDiffusionInpaintPipeline, "flux-inpaint": FluxInpaintPipeline}
S, F = Mode.SPARSE, Mode.FULL


@pytest.fixture(scope="module", params=list(MODELS))
def baked(request: pytest.FixtureRequest, models_dir: Path):
    """(editor, template image, in-memory bake) of one tiny model."""
    torch.set_num_threads(1)
    family = request.param
    pipe = PIPELINES[family].from_pretrained(ensure_demo_model(MODELS[family], models_dir))
    pipe.set_progress_bar_config(disable=True)
    editor = MaskAwareEditor(pipe, family, torch.device("cpu"))
    image = template_image((SIZE, SIZE), 3)
    store = MemoryActivations()
    editor.bake(image, "a door", 1, STEPS, 4.0, store)
    yield editor, image, store
    attach(editor, None)


def _requests(image, ratios=(0.2, 0.45)) -> list[EditRequest]:
    return [
        EditRequest(
            image,
            mask_of_ratio((SIZE, SIZE), r, "blob", seed=i),
            "red",
            5 + i,
            STEPS,
            4.0,
            "a door",
            1,
        )
        for i, r in enumerate(ratios)
    ]


def _run(editor, requests, readers, plan) -> list[torch.Tensor]:
    states = [editor.prepare(r, reader) for r, reader in zip(requests, readers, strict=True)]
    while not states[0].done:
        editor.step(states, plan(editor.blocks))
    return [s.latents.clone() for s in states]


PLANS = {
    "all-sparse": lambda blocks: dict.fromkeys(blocks, S),
    "sparse-full": lambda blocks: {b: F if i % 2 else S for i, b in enumerate(blocks)},
    "full-sparse": lambda blocks: {b: S if i % 2 else F for i, b in enumerate(blocks)},
}


CASES = [  # (plan, loading mode, lookahead depth)
    ("all-sparse", LoadMode.SEQUENTIAL, 4),
    ("all-sparse", LoadMode.OVERLAPPED, 4),
    ("sparse-full", LoadMode.OVERLAPPED, 1),
    ("sparse-full", LoadMode.SEQUENTIAL, 4),
    ("full-sparse", LoadMode.OVERLAPPED, 2),
]


@pytest.fixture(scope="module")
def references(baked) -> dict[str, list[torch.Tensor]]:
    """The synchronous path's latents per plan (two requests, two masks)."""
    editor, image, store = baked
    attach(editor, None)
    return {plan: _run(editor, _requests(image), [store, store], PLANS[plan]) for plan in PLANS}


@pytest.mark.parametrize(("plan", "mode", "depth"), CASES)
def test_loading_modes_match_the_synchronous_path(
    baked, references, plan: str, mode: LoadMode, depth: int
) -> None:
    editor, image, store = baked
    loader = RowLoader.for_editor(editor, mode, depth=depth)
    attach(editor, loader)
    try:
        got = _run(editor, _requests(image), [store, store], PLANS[plan])
    finally:
        attach(editor, None)
        loader.close()
    assert all(torch.equal(a, b) for a, b in zip(references[plan], got, strict=True))
    assert loader.steps == STEPS and loader.totals.bytes > 0


def test_padded_layout_and_a_request_without_cache(baked) -> None:
    """A reader-less request (every token computed) rides along; padded layout too."""
    editor, image, store = baked
    requests = _requests(image)
    padded = MaskAwareEditor(editor.impl.pipe, editor.family, editor.device, packed=False)
    for ed in (editor, padded):
        attach(ed, None)
        reference = _run(ed, requests, [store, None], PLANS["sparse-full"])
        loader = RowLoader.for_editor(ed, LoadMode.OVERLAPPED)
        attach(ed, loader)
        try:
            got = _run(ed, requests, [store, None], PLANS["sparse-full"])
        finally:
            attach(ed, None)
            loader.close()
        assert all(torch.equal(a, b) for a, b in zip(reference, got, strict=True))


def test_cachestore_reader_through_the_loader(baked, tmp_path: Path) -> None:
    """The production reader (a host-resident template, gathered with RowSelections)."""
    editor, image, store = baked
    requests = _requests(image, (0.3,))
    with ActivationStore(StoreConfig(path=tmp_path / "cache")) as cache:
        with cache.bake("t", {"function": "test"}) as writer:
            for (step, block, name), tensor in store.tensors.items():
                writer.put(step, block, name, tensor)
        with cache.acquire("t") as handle:
            attach(editor, None)
            reference = _run(editor, requests, [handle], PLANS["all-sparse"])
            loader = RowLoader.for_editor(editor, LoadMode.OVERLAPPED)
            attach(editor, loader)
            try:
                got = _run(editor, requests, [handle], PLANS["all-sparse"])
            finally:
                attach(editor, None)
                loader.close()
    assert torch.equal(reference[0], got[0])


class SlowReader(MemoryActivations):
    """A bake whose row reads take ``delay`` seconds each (a slow host->device link)."""

    def __init__(self, source: MemoryActivations, delay: float, fail: bool = False) -> None:
        super().__init__()
        self.tensors = source.tensors
        self.delay, self.fail, self.reads = delay, fail, 0

    def read_rows(self, step, block, name, rows, out):
        self.reads += 1
        if self.fail:
            raise OSError("link down")
        time.sleep(self.delay)
        return super().read_rows(step, block, name, rows, out)


def test_load_wait_is_reported(baked) -> None:
    editor, image, store = baked
    requests = _requests(image, (0.3,))
    slow = SlowReader(store, delay=0.01)
    for mode in (LoadMode.SEQUENTIAL, LoadMode.OVERLAPPED):
        loader = RowLoader.for_editor(editor, mode)
        attach(editor, loader)
        try:
            slow.reads = 0
            _run(editor, requests, [slow], PLANS["all-sparse"])
        finally:
            attach(editor, None)
            loader.close()
        stats = loader.last
        assert stats is not None and stats.mode == mode.value and stats.jobs > 0
        assert stats.load_s >= stats.jobs * 0.01 * 0.9
        if mode is LoadMode.SEQUENTIAL:  # every read happens while a block waits
            assert loader.totals.wait_s >= slow.reads * 0.01 * 0.9
        else:  # tiny blocks compute in far less than 10 ms: they wait for loads, which
            # bound the wait; the slack is a loaded machine's late wake-ups (a wait counted
            # in ms would still be far over it)
            assert 0 < loader.totals.wait_s <= loader.totals.load_s + 5.0


def test_a_failed_load_fails_the_step_and_the_loader_carries_on(baked) -> None:
    editor, image, store = baked
    requests = _requests(image, (0.3,))
    loader = RowLoader.for_editor(editor, LoadMode.OVERLAPPED)
    attach(editor, loader)
    try:
        with pytest.raises(RuntimeError, match="loading the cached rows") as info:
            _run(editor, requests, [SlowReader(store, 0.0, fail=True)], PLANS["all-sparse"])
        assert isinstance(info.value.__cause__, OSError)
        _run(editor, requests, [store], PLANS["all-sparse"])
        assert loader.last is not None and loader.last.bytes > 0
    finally:
        attach(editor, None)
        loader.close()


def test_sync_mode_loads_nothing(baked) -> None:
    editor, image, store = baked
    loader = RowLoader.for_editor(editor, LoadMode.SYNC)
    attach(editor, loader)
    try:
        _run(editor, _requests(image, (0.3,)), [store], PLANS["all-sparse"])
    finally:
        attach(editor, None)
    assert loader.steps == STEPS and loader.totals.bytes == 0


def test_jobs_follow_execution_order_and_the_feasibility_rule(baked) -> None:
    editor, _, _ = baked
    rows = family_rows(editor)
    assert sorted(rows.order) == sorted(editor.blocks)
    if editor.family == "sd-inpaint":  # mid runs between down and up
        stages = [name.split(".")[0] for name in rows.order]
        assert stages == sorted(stages, key=["down_blocks", "mid_block", "up_blocks"].index)
        assert all(rows.sparse[b][-1] == "y" and not rows.exit[b] for b in rows.order)
    plan = {b: F if i % 2 else S for i, b in enumerate(rows.order)}
    needs = rows.needs(lambda b: plan[b])
    for need in needs:
        if plan[need.consumer] is S:
            assert need.source == need.consumer
        else:  # a full block after a sparse one reads that block's exit rows
            previous = rows.order[rows.order.index(need.consumer) - 1]
            assert need.source == previous and need.names == rows.exit[previous]


def test_family_rows_needs_on_a_synthetic_family() -> None:
    rows = FamilyRows(
        ("a", "b", "c", "d"),
        dict.fromkeys("abcd", ("k", "v")),
        dict.fromkeys("abcd", ("y",)),
    )
    plan = dict(zip("abcd", (S, F, F, S), strict=True))
    needs = rows.needs(lambda b: plan[b])
    assert [(n.consumer, n.source, n.names) for n in needs] == [
        ("a", "a", ("k", "v")),
        ("b", "a", ("y",)),
        ("d", "d", ("k", "v")),
    ]
    assert np.all([n.consumer != "c" for n in needs])
