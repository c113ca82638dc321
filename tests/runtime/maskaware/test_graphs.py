"""Steps run from captured graphs give the same edits as eager steps.

On a CPU the graph runner keeps its bookkeeping (static inputs, static cached rows refilled
before every run, one layout per set of masks) and "replays" eagerly, so these tests check
that substitution on every family; on CUDA the same tests capture and replay for real."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from retouch.functions.demo.images import template_image
from retouch.functions.demo.production import SHAPES, build_shape
from retouch.functions.families import family_spec
from retouch.platform.lab.bench.engine import aligned_mask
from retouch.runtime.maskaware.buckets import Buckets
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.store import MemoryActivations
from tests.support import CPU_SKIPPED_SHAPES

SIZE, STEPS = 128, 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread: multi-threaded CPU kernels may split work by buffer alignment, and
    the static buffers are other allocations than the eager ones (ULP differences)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(
    scope="module",
    params=[s for s in sorted(SHAPES) if DEVICE == "cuda" or s not in CPU_SKIPPED_SHAPES],
)
def setup(request):
    shape, pipe = build_shape(
        request.param, DEVICE, scale=0.05, dtype=torch.float32 if DEVICE == "cpu" else None
    )
    editor = MaskAwareEditor(pipe, shape.family, DEVICE)
    template = template_image((SIZE, SIZE), seed=1)
    baked = MemoryActivations()
    editor.bake(template, "a quiet street", 1, STEPS, 4.0, baked)
    return editor, template, baked.placed(DEVICE), family_spec(shape.family).halo


def _requests(editor, template, halo, ratios):
    cell = editor.model_family.token_cell(editor.impl.pipe)
    prompt, template_prompt = "a red bicycle", "a quiet street"
    return [
        EditRequest(
            template,
            aligned_mask(SIZE, r, cell),
            prompt,
            7 + i,
            STEPS,
            4.0,
            template_prompt,
            1,
            0,
            halo,
        )
        for i, r in enumerate(ratios)
    ]


def _edits(editor, requests, store) -> list[np.ndarray]:
    states = [editor.prepare(r, store) for r in requests]
    while not states[0].done:
        editor.step(states)
    return [editor.finish(s, "np") for s in states]


def _compare(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    for x, y in zip(a, b, strict=True):
        if DEVICE == "cpu":
            np.testing.assert_array_equal(x, y)
        else:  # kernels chosen under capture may round differently
            np.testing.assert_allclose(x, y, atol=2e-2)


def test_graph_steps_match_eager_steps(setup) -> None:
    editor, template, store, halo = setup
    requests = _requests(editor, template, halo, [0.25, 0.1])
    editor.set_graphs(False)
    eager = _edits(editor, requests, store)
    alone = _edits(editor, requests[:1], store)  # a batch of one rounds differently
    editor.set_graphs(True)
    try:
        first = _edits(editor, requests, store)
        again = _edits(editor, requests, store)  # the captured layout, replayed from step 1
        graphs = editor.graphs
        assert graphs.captures == 2  # one per parity (on a CPU, the bookkeeping of one)
        assert graphs.replays == 2 * STEPS - 2  # one eager step per parity, then replays
        assert graphs.prefetched == 2 * STEPS - 3  # each step's rows copied in a step ahead
        assert len(graphs.layouts) == 1
        other = _edits(editor, requests[:1], store)  # another layout: eager, then captured
        assert len(graphs.layouts) == 2
    finally:
        editor.set_graphs(False)
    _compare(eager, first)
    _compare(eager, again)
    _compare(alone, other)


@pytest.mark.skipif(
    DEVICE != "cuda", reason="a capture's check: on a CPU, test_buckets.py replays new masks"
)
def test_bucketed_graphs_replay_other_masks_as_their_eager_steps(setup) -> None:
    """Served traffic: each edit its own mask, one graph per bucket. The same masks moved
    elsewhere replay the layouts captured for the first ones, with their own eager steps'
    pixels: nothing gathered for the capture's masks (RoPE rows among them) stays in it
    (a capture runs the call twice: warm-up, then capture)."""
    editor, template, store, halo = setup
    first = _requests(editor, template, halo, [0.25, 0.1])
    cell = editor.model_family.token_cell(editor.impl.pipe)
    moved = [
        dataclasses.replace(r, mask=np.roll(r.mask, (2 * cell, -3 * cell), (0, 1))) for r in first
    ]
    editor.set_buckets(Buckets())
    try:
        eager = _edits(editor, moved, store)
        editor.set_graphs(True)
        _edits(editor, first, store)  # each layout: eager once, then captured
        graphs = editor.graphs
        captures, layouts = graphs.captures, len(graphs.layouts)
        graphed = _edits(editor, moved, store)
        assert graphs.captures == captures and len(graphs.layouts) == layouts  # replays only
    finally:
        editor.set_graphs(False)
        editor.set_buckets(None)
    atol = 1e-5 if DEVICE == "cpu" else 2e-2  # static buffers: other allocations, ULPs
    for x, y in zip(eager, graphed, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)


def test_graphs_stay_off_for_rows_on_the_host(setup) -> None:
    editor, template, store, halo = setup
    host = MemoryActivations()
    host.tensors = store.tensors  # same rows, not placed: gathered per step
    editor.set_graphs(True)
    try:
        _edits(editor, _requests(editor, template, halo, [0.25]), host)
        assert editor.graphs.replays == 0 and not editor.graphs.layouts
    finally:
        editor.set_graphs(False)


@pytest.mark.skipif(DEVICE != "cuda", reason="pinned host memory needs CUDA")
def test_graph_steps_from_pinned_host_rows_match_eager(setup) -> None:
    """Rows in pinned host memory are copied into the graph's buffers a step ahead."""
    editor, template, store, halo = setup
    pinned = MemoryActivations()
    pinned.tensors = {k: v.cpu() for k, v in store.tensors.items()}
    pinned = pinned.placed("cpu", pin=True)
    requests = _requests(editor, template, halo, [0.25, 0.1])
    eager = _edits(editor, requests, store)
    editor.set_graphs(True)
    try:
        _edits(editor, requests, pinned)
        again = _edits(editor, requests, pinned)
        assert editor.graphs.captures == 2 and editor.graphs.prefetched == 2 * STEPS - 3
    finally:
        editor.set_graphs(False)
    _compare(eager, again)
