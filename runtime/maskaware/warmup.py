"""Graph warm-up: every bucketed layout captured before an executor serves.

A layout's first runs are eager and its capture stalls the step that makes it (136-422 ms
of host time per capture at production shapes, docs/benchmarks.md). With bucketed token
layouts (``maskaware.buckets``) the layouts a model can need are known in advance: one
per (bucket level, batch size) at a resolution. Warm-up bakes a synthetic template into
device memory and runs a few steps of each: masks chosen so every reachable level occurs
(UNet halos and coarser grids make some levels unreachable: no served mask needs them),
batches of every batch size the buckets pad to (1 to ``max_batch`` without batch-size
buckets), and stock steps (every token) of each.
The last steps of every layout are timed (``runtime/replaytimes``): what the executor's path
choice compares, and what the gateway's predictions interpolate. Served steps of device-resident templates then only
replay, and so do those of pinned host rows (a graphed step is planned as resident). What
still captures on the request path (``StepGraphs.request_captures``): a batch with an edit
in its full steps, another resolution, another adapter set.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from retouch.functions.demo.images import mask_of_ratio, template_image
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.store import ActivationReader, MemoryActivations
from retouch.runtime.replaytimes import ReplayTimes

log = logging.getLogger(__name__)

PROMPT = "a quiet street"  # the demo tokenizers take 14 characters
CAPTURED = 4  # a layout's runs until both parities are captured: eager, eager, capture x 2
TIMED = 5  # replays timed after them: their fastest is the layout's step time
RATIOS = tuple(np.linspace(0.01, 1.0, 34))  # mask ratios tried to reach every bucket level


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up made: the paddings it found (bucket size per grid, one per reachable
    level), layouts (paddings × batch sizes), captures, and its time."""

    paddings: tuple[tuple[tuple[int, int], ...], ...]
    layouts: int
    captures: int
    seconds: float
    times: ReplayTimes | None = None  # per batch size: mask-aware per bucket, and stock

    def __str__(self) -> str:
        return (
            f"{self.layouts} layouts ({len(self.paddings)} buckets), {self.captures} captures "
            f"in {self.seconds:.1f} s"
        )


@dataclass(frozen=True)
class _Trial:
    """What every run of a warm-up shares: its editor, the synthetic template, and each
    edit's steps (the captures' runs, then the timed ones; the template is baked as long)."""

    editor: MaskAwareEditor
    image: Image.Image
    halo: int
    guidance: float
    runs: int

    def request(self, mask: np.ndarray, seed: int) -> EditRequest:
        return EditRequest(
            self.image, mask, PROMPT, seed + 1, self.runs, self.guidance, PROMPT, 0, 0, self.halo
        )

    def fastest_step(self, mask: np.ndarray, reader: ActivationReader | None, batch: int) -> float:
        """Every step of ``batch`` edits with ``mask``: the fastest of the timed ones (what
        the step costs; slower ones waited for something else on a shared machine)."""
        editor = self.editor
        states = [editor.prepare(self.request(mask, i), reader) for i in range(batch)]
        times = []
        for _ in range(self.runs):
            _sync(editor.device)
            started = time.perf_counter()
            editor.step(states)
            _sync(editor.device)
            times.append(time.perf_counter() - started)
        return min(times[CAPTURED:])


@torch.inference_mode()
def warm_graphs(
    editor: MaskAwareEditor,
    size: tuple[int, int],
    max_batch: int,
    halo: int = 0,
    guidance: float = 4.0,
    timed: int = TIMED,
) -> WarmUp:
    """Run every (bucket level, batch size) layout of ``editor`` at ``size`` (width,
    height) until its graphs are captured, then ``timed`` replays of it (their fastest is
    its step time; fewer, a noisier time); nothing without graphs and buckets."""
    if timed < 1:
        raise ValueError(f"a warm-up times at least one replay per layout, got {timed}")
    graphs, buckets = editor.graphs, editor.buckets
    started = time.perf_counter()
    if graphs is None or buckets is None:
        return WarmUp((), 0, 0, 0.0)
    trial = _Trial(editor, template_image(size, seed=0), halo, guidance, CAPTURED + timed)
    baked = MemoryActivations()
    editor.bake(trial.image, PROMPT, 0, trial.runs, guidance, baked)
    reader = baked.placed(editor.device)
    masks = _mask_per_level(trial, reader)
    full = np.ones((size[1], size[0]), dtype=bool)
    before = graphs.captures
    fractions = sorted({_finest_fraction(key) for key in masks})
    batches = buckets.batch_sizes or tuple(range(1, max_batch + 1))
    sparse: list[tuple[float, ...]] = []
    stock: list[float] = []
    with graphs.warming():
        for batch in batches:
            row = dict.fromkeys(fractions, 0.0)  # levels of one finest bucket: the slowest
            for key, mask in masks.items():
                fraction = _finest_fraction(key)
                row[fraction] = max(row[fraction], trial.fastest_step(mask, reader, batch))
            # a step of fewer tokens is no slower than one of more: a bucket whose timed
            # runs all waited for something else takes the time of a larger one
            sparse.append(tuple(itertools.accumulate(reversed(row.values()), min))[::-1])
            # stock steps (every token, no cached rows) replay from graphs too
            stock.append(trial.fastest_step(full, None, batch))
    times = ReplayTimes(batches, tuple(fractions), tuple(sparse), tuple(stock)) if masks else None
    return WarmUp(
        tuple(masks),
        (len(masks) + 1) * len(batches),
        graphs.captures - before,
        time.perf_counter() - started,
        times,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _finest_fraction(padding: tuple[tuple[int, int], ...]) -> float:
    """The padded share of the finest grid (its tokens → bucket size)."""
    n, bucket = max(padding)
    return bucket / n


def _mask_per_level(
    trial: _Trial, reader: ActivationReader
) -> dict[tuple[tuple[int, int], ...], np.ndarray]:
    """One mask for each bucket level a mask can reach, found by trying ratios: its key is
    the padding the editor itself lays the request's token sets out with."""
    buckets = trial.editor.buckets
    assert buckets is not None
    masks: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
    for ratio in RATIOS:
        mask = np.asarray(mask_of_ratio(trial.image.size, float(ratio), "rect", seed=0)) > 0
        if not mask.any():
            continue
        state = trial.editor.prepare(trial.request(mask, 0), reader)
        padding = buckets.padding((tokens,) for tokens in state.step_tokens.values())
        if padding is not None:
            masks.setdefault(tuple(sorted(padding.items())), mask)
    return masks
