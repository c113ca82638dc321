"""The engine's planner on synthetic cost models: free loads, prohibitive loads, levels."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from retouch.runtime.costmodel import BlockProfile, CostModel, LinearFit
from retouch.runtime.maskaware.context import Mode
from retouch.runtime.maskaware.tokens import TokenSet
from retouch.runtime.plan import batch_tokens, make_planner

BLOCKS = ["b0", "b1", "b2", "b3"]


@dataclass
class FakeState:
    """What the planner reads of a RequestState: token sets per grid and the reader."""

    tokens: dict[tuple[int, int], TokenSet]
    reader: Any = field(default=None)


def _state(ratio: float, reader: Any = "cache") -> FakeState:
    """A 16x16 grid (and its 8x8 level) with the first ``ratio`` of rows masked."""
    tokens = {}
    for side in (16, 8):
        grid = torch.zeros(side, side, dtype=torch.bool)
        grid[: round(side * ratio)] = True
        tokens[(side, side)] = TokenSet.from_grid(grid)
    return FakeState(tokens, reader)


def _model(load_slope: float, levels: tuple[int, ...] = (0, 0, 0, 0)) -> CostModel:
    compute = LinearFit(1e-4, 1e-5, 0.99)  # 0.1 ms + 10 us per token
    blocks = [
        BlockProfile(name, compute, 1024, 512, level)
        for name, level in zip(BLOCKS, levels, strict=True)
    ]
    return CostModel("cpu", blocks, LinearFit(0.0, load_slope, 0.99))


def test_free_loads_make_every_block_sparse() -> None:
    planner = make_planner(_model(load_slope=0.0))
    modes = planner([_state(0.25), _state(0.5)], BLOCKS)
    assert modes == dict.fromkeys(BLOCKS, Mode.SPARSE)
    assert planner.last is not None and planner.last.sparse_blocks == 4


def test_prohibitive_loads_make_every_block_full() -> None:
    modes = make_planner(_model(load_slope=1.0))([_state(0.25)], BLOCKS)
    assert modes == dict.fromkeys(BLOCKS, Mode.FULL)


def test_requests_without_cache_compute_everything() -> None:
    planner = make_planner(_model(load_slope=0.0))
    assert planner([_state(0.25, reader=None)], BLOCKS) == dict.fromkeys(BLOCKS, Mode.FULL)
    counts = batch_tokens(_model(0.0), [_state(0.25), _state(0.25, reader=None)])
    assert counts[0] == (64 + 256, 512)  # the reader-less request counts every token


def test_tokens_are_counted_on_each_blocks_grid() -> None:
    model = _model(0.0, levels=(0, 1, 1, 0))
    counts = batch_tokens(model, [_state(0.5), _state(0.25)])
    assert counts == [(128 + 64, 512), (32 + 16, 128), (32 + 16, 128), (128 + 64, 512)]


def test_blocks_outside_the_cost_model_stay_full() -> None:
    modes = make_planner(_model(0.0))([_state(0.25)], [*BLOCKS, "extra"])
    assert modes["extra"] is Mode.FULL and list(modes) == [*BLOCKS, "extra"]
