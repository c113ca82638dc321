"""Bucketed token layouts: padding a step's masked tokens up to a bucket changes no real
token's value, and graphs of bucketed steps depend on the bucket, not on the masks.

Every family runs the same batch of edits with irregular masks, once with exact layouts and
once padded to buckets, from a device-resident template (rows copied whole) and from the
host (rows gathered per request), packed and padded; the images agree to 1e-5 (the pad
slots run other kernel tiles than the exact layout's rows, so rounding may differ there,
but no pad's value reaches a real token)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from retouch.functions.demo.images import template_image
from retouch.functions.demo.models import demo_model, ensure_demo_model
from retouch.functions.families import family_spec
from retouch.runtime.maskaware.buckets import BucketBatch, Buckets
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.maskaware.tokens import TokenBatch, TokenSet
from retouch.runtime.maskaware.warmup import warm_graphs
from retouch.runtime.models import load_pipeline
from tests.runtime.maskaware.test_graphs import _edits

CPU = torch.device("cpu")
STEPS = 2
TOLERANCE = 1e-5  # fp32 pixels in [0, 1]: padded and exact layouts, same weights
MODELS = (
    "retouch:tiny-sd",
    "retouch:tiny-sdxl",
    "retouch:tiny-sd3",
    "retouch:tiny-flux",
    "retouch:tiny-flux-fill",
    "retouch:tiny-flux-kontext",
    "retouch:tiny-flux2-klein",
    "retouch:tiny-qwen-image",
    "retouch:tiny-z-image",
)


def blob_mask(size: int, seed: int, ratio: float) -> np.ndarray:
    """An irregular mask: random ellipses until about ``ratio`` of the image is covered."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    mask = np.zeros((size, size), dtype=bool)
    while mask.mean() < ratio:
        cy, cx = rng.uniform(0, size, 2)
        ry, rx = rng.uniform(size / 16, size / 5, 2)
        mask |= ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1
    return mask


@pytest.fixture(scope="module", params=MODELS)
def baked(request, models_dir):
    return _baked(request.param, models_dir)


# Warm-up and the graph budget do not depend on the family's blocks: a transformer with
# packed attention and a UNet with a halo over several token grids cover them (the padded
# pixels themselves are checked on every family).
@pytest.fixture(scope="module", params=("retouch:tiny-flux", "retouch:tiny-sdxl"))
def graph_baked(request, models_dir):
    return _baked(request.param, models_dir)


# The warm-up tests take three levels, not the default six, and time one replay of each
# layout, not five: warm-up captures every level at every batch size (the default's 36
# layouts took tiny-sdxl's test 28 s of CPU), and what they check (every layout captured,
# none on the request path, a batch of three on the graph of four) does not depend on how
# many levels there are or how steady the times are.
COARSE = (0.25, 0.5, 1.0)


def _baked(model: str, models_dir):
    spec = demo_model(model)
    pipe = load_pipeline(ensure_demo_model(model, models_dir), spec.family, CPU)
    size = spec.resolution
    template = template_image((size, size), 1)
    editor = MaskAwareEditor(pipe, spec.family, CPU)
    store = MemoryActivations()
    guidance = family_spec(spec.family).guidance
    editor.bake(template, "a quiet street", 1, STEPS, guidance, store)
    return editor, template, store, guidance


def _requests(editor, template, guidance, ratios, seed=0):
    size = template.height
    halo = family_spec(editor.family).halo
    return [
        EditRequest(
            template,
            blob_mask(size, seed + i, r),
            "a red bicycle",
            7 + i,
            STEPS,
            guidance,
            "a quiet street",
            1,
            0,
            halo,
        )
        for i, r in enumerate(ratios)
    ]


@pytest.mark.parametrize(
    ("tier", "packed"), [("device", True), ("host", False)], ids=["device-packed", "host-padded"]
)
def test_padded_steps_give_the_exact_layouts_pixels(baked, tier, packed) -> None:
    editor, template, store, guidance = baked
    if tier == "device":
        store = store.placed(CPU)
    requests = _requests(editor, template, guidance, [0.08, 0.3])
    editor.packed = packed
    try:
        exact = _edits(editor, requests, store)
        editor.set_buckets(Buckets())
        padded = _edits(editor, requests, store)
        assert editor.padded_tokens > 0  # the masks were padded
    finally:
        editor.set_buckets(None)
        editor.packed = True
    for want, got in zip(exact, padded, strict=True):
        assert np.abs(want - got).max() <= TOLERANCE


def test_graphs_of_bucketed_steps_do_not_depend_on_the_mask(baked) -> None:
    """Edits with new masks at batch 1-4 reuse the layouts of their bucket and batch size
    (the CPU bookkeeping that stands in for capture), and give the eager steps' pixels."""
    editor, template, store, guidance = baked
    store = store.placed(CPU)
    rng = np.random.default_rng(5)
    sizes = [1, 2, 2, 1, 2, 1, 2, 1]
    batches = [
        _requests(editor, template, guidance, rng.uniform(0.1, 0.2, n), seed=10 * i)
        for i, n in enumerate(sizes)
    ]
    buckets = Buckets(fractions=COARSE)
    editor.set_buckets(buckets)
    try:
        eager = [_edits(editor, batch, store) for batch in batches]
        editor.set_graphs(True, limit=buckets.levels * len(set(sizes)))
        graphed = [_edits(editor, batch, store) for batch in batches]
        graphs = editor.graphs
        # every batch brought new masks: keyed by mask, each would be a layout of its own
        assert graphs.replays > 0 and len(graphs.layouts) < len(batches)
        assert all(grid[3][0] == "bucket" for _, (grids, *_) in graphs.layouts for grid in grids)
    finally:
        editor.set_graphs(False)
        editor.set_buckets(None)
    _same_images(eager, graphed)


def _same_images(eager: list[list[np.ndarray]], graphed: list[list[np.ndarray]]) -> None:
    """Every batch's images, eager and from graphs, within the padding tolerance."""
    for want, got in zip(eager, graphed, strict=True):
        for a, b in zip(want, got, strict=True):
            assert np.abs(a - b).max() <= TOLERANCE


def test_a_bucket_batch_pads_with_the_rows_last_token() -> None:
    grid = torch.zeros(4, 4, dtype=torch.bool)
    grid[1, 1:3] = True
    one = TokenSet.from_grid(grid)
    grid[3, 3] = True
    two = TokenSet.from_grid(grid)
    batch = BucketBatch(16, 2, 1, 4, packed=False, device=CPU).fill([one, two])
    assert batch.positions.tolist() == [[5, 6, 6, 6], [5, 6, 15, 15]]
    assert batch.padded_tokens == 3
    rows = torch.arange(8.0)[:, None]  # slot r carries the value r
    full = batch.scatter_rows(rows, torch.full((2, 16, 1), -1.0))
    exact = TokenBatch((one, two), 1, False, CPU)
    want = exact.scatter(exact.gather(torch.arange(32.0).view(2, 16, 1)), torch.full_like(full, -1))
    assert torch.equal(full != -1, want != -1)  # exactly the masked positions written
    assert full[0, 6, 0] == 1 and full[1, 15, 0] == 6  # by their real slots, not the pads


def test_bucket_levels_cover_every_grid() -> None:
    buckets = Buckets()
    assert buckets.sizes(64) == (8, 16, 24, 32, 48, 64)
    assert buckets.sizes(4) == (4, 4, 4, 4, 4, 4)
    assert buckets.level({64: 9, 16: 2}) == 1
    assert buckets.level({64: 9, 16: 9}) == 4  # the coarse grid: 9 of 16 needs its 16
    with pytest.raises(ValueError):
        Buckets(fractions=(0.5, 0.25, 1.0))
    with pytest.raises(ValueError):
        buckets.level({64: 65})


def test_warm_up_captures_every_layout_served_masks_need(graph_baked) -> None:
    """After the executor's warm-up, edits with new masks at batch 1-2 capture nothing on
    the request path, share one bank of rows, and give the eager steps' pixels."""
    editor, template, store, guidance = graph_baked
    store = store.placed(CPU)
    rng = np.random.default_rng(9)
    batches = [
        _requests(editor, template, guidance, rng.uniform(low, low + 0.2, n), seed=10 * i)
        for i, (n, low) in enumerate([(1, 0.05), (2, 0.1), (2, 0.5), (1, 0.7), (2, 0.3)])
    ]
    buckets = Buckets(fractions=COARSE)
    editor.set_buckets(buckets)
    try:
        eager = [_edits(editor, batch, store) for batch in batches]
        editor.set_graphs(True, limit=(buckets.levels + 1) * 2)  # and the stock steps
        halo = family_spec(editor.family).halo
        warm = warm_graphs(editor, (template.width, template.height), 2, halo, guidance, timed=1)
        graphs = editor.graphs
        assert warm.captures == 2 * warm.layouts > 0  # both parities of every layout
        assert graphs.request_captures == 0 and graphs.warm_captures == warm.captures
        replays = graphs.replays
        graphed = [_edits(editor, batch, store) for batch in batches]
        assert graphs.request_captures == 0 and graphs.replays > replays
        bank = next(iter(graphs.banks.values()))  # one resolution: one bank of rows
        assert len(graphs.banks) == 1 and all(len(rows) <= 2 for rows in bank.rows)
        assert graphs.nbytes >= bank.nbytes > 0
    finally:
        editor.set_graphs(False)
        editor.set_buckets(None)
    _same_images(eager, graphed)


def test_a_batch_of_three_replays_the_graph_of_four(graph_baked) -> None:
    """Batch-size buckets: three requests run as four (the last repeated, its prediction
    dropped), on the layout warm-up captured for four, with each request's own pixels."""
    editor, template, store, guidance = graph_baked
    store = store.placed(CPU)
    requests = _requests(editor, template, guidance, [0.1, 0.15, 0.2], seed=40)
    want = _edits(editor, requests, store)  # no buckets: a batch of three, exact layout
    buckets = dataclasses.replace(Buckets.for_batches(4), fractions=COARSE)
    editor.set_buckets(buckets)
    try:
        editor.set_graphs(True, limit=(buckets.levels + 1) * len(buckets.batch_sizes))
        halo = family_spec(editor.family).halo
        warm = warm_graphs(editor, (template.width, template.height), 4, halo, guidance, timed=1)
        graphs = editor.graphs
        assert buckets.batch_sizes == (1, 2, 4) and warm.layouts % 3 == 0
        times = warm.times
        assert times is not None and times.batch_sizes == (1, 2, 4)
        editor.set_replay_times(times)
        got = _edits(editor, requests, store)
        assert graphs.request_captures == 0 and graphs.replays > warm.captures
        # the step's expected time is the layout of four's, as warm-up timed it
        assert editor.last_expected_s in (*times.sparse_s[2], times.stock_s[2])
    finally:
        editor.set_graphs(False)
        editor.set_buckets(None)
        editor.set_replay_times(None)
    for a, b in zip(want, got, strict=True):
        assert np.abs(a - b).max() <= TOLERANCE


def test_batch_size_buckets_pad_up_and_stop_at_the_largest() -> None:
    buckets = Buckets.for_batches(6)
    assert buckets.batch_sizes == (1, 2, 4, 6)
    assert [buckets.batch_size(n) for n in range(1, 8)] == [1, 2, 4, 4, 6, 6, 7]
    assert Buckets().batch_size(3) == 3  # none declared: every size its own
    with pytest.raises(ValueError, match="batch sizes"):
        Buckets(batch_sizes=(4, 2))


def test_layouts_over_the_graph_budget_run_eagerly(graph_baked) -> None:
    editor, template, store, guidance = graph_baked
    store = store.placed(CPU)
    requests = _requests(editor, template, guidance, [0.2])
    editor.set_buckets(Buckets())
    try:
        want = _edits(editor, requests, store)
        editor.set_graphs(True, budget_bytes=1)
        got = [_edits(editor, requests, store) for _ in range(2)][-1]
        graphs = editor.graphs
        assert graphs.captures == 0 and graphs.over_budget > 0 and graphs.replays == 0
    finally:
        editor.set_graphs(False)
        editor.set_buckets(None)
    assert np.abs(want[0] - got[0]).max() <= TOLERANCE
