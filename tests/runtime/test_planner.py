"""The engine's planner on synthetic cost models: free loads, prohibitive loads, levels."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from retouch.runtime.costmodel import BlockProfile, CostModel, LinearFit
from retouch.runtime.maskaware.context import Mode
from retouch.runtime.maskaware.request import EditRequest, RequestState
from retouch.runtime.maskaware.tokens import TokenSet
from retouch.runtime.plan import Policy
from retouch.runtime.planner import batch_tokens, make_planner
from retouch.runtime.prediction import plan_table

BLOCKS = ["b0", "b1", "b2", "b3"]


@dataclass
class FakeState:
    """What the planner reads of a RequestState: this step's token sets per grid and reader
    (a request in no warm-up step: its own)."""

    tokens: dict[tuple[int, int], TokenSet]
    reader: Any = field(default=None)

    @property
    def step_tokens(self) -> dict[tuple[int, int], TokenSet]:
        return self.tokens

    @property
    def step_reader(self) -> Any:
        return self.reader


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
    planner = make_planner(_model(load_slope=0.0), "cpu")
    modes = planner([_state(0.25), _state(0.5)], BLOCKS)
    assert modes == dict.fromkeys(BLOCKS, Mode.SPARSE)
    assert planner.last is not None and planner.last.sparse_blocks == 4


def test_prohibitive_loads_make_every_block_full() -> None:
    modes = make_planner(_model(load_slope=1.0), "cpu")([_state(0.25)], BLOCKS)
    assert modes == dict.fromkeys(BLOCKS, Mode.FULL)


def test_the_sparse_policy_ignores_loads_and_batch() -> None:
    """Deterministic mode's plan: every block sparse however slow the loads were profiled
    and whatever the batch (the pixels of an edit follow its plan), and the latency the
    planner reports and the gateway's table are those of that plan, bubbles included."""
    model = _model(load_slope=1.0)  # the bubble-free plan runs all full here
    planner = make_planner(model, "cpu", policy=Policy.SPARSE)
    for batch in ([_state(0.25)], [_state(0.25), _state(0.5)]):
        assert planner(batch, BLOCKS) == dict.fromkeys(BLOCKS, Mode.SPARSE)
    assert planner.last is not None and planner.last.load_time > planner.last.latency / 2
    sparse = plan_table(model, [256, 64], 2, policy=Policy.SPARSE)[0][:-1]  # mask 1: equal
    bubble_free = plan_table(model, [256, 64], 2)[0][:-1]
    assert all(a > b for a, b in zip(sparse, bubble_free, strict=True))
    assert planner([_state(0.25, reader=None)], BLOCKS) == dict.fromkeys(BLOCKS, Mode.FULL)


def test_requests_without_cache_compute_everything() -> None:
    planner = make_planner(_model(load_slope=0.0), "cpu")
    assert planner([_state(0.25, reader=None)], BLOCKS) == dict.fromkeys(BLOCKS, Mode.FULL)
    counts = batch_tokens(_model(0.0), [_state(0.25), _state(0.25, reader=None)], "cpu")
    assert counts[0] == (64 + 256, 512, 192)  # the reader-less request counts every token


def test_tokens_are_counted_on_each_blocks_grid() -> None:
    model = _model(0.0, levels=(0, 1, 1, 0))
    counts = batch_tokens(model, [_state(0.5), _state(0.25)], "cpu")
    assert counts == [
        (128 + 64, 512, 320),
        (32 + 16, 128, 80),
        (32 + 16, 128, 80),
        (128 + 64, 512, 320),
    ]


class Resident:
    """A reader whose rows are resident on the cost model's device (a device tier)."""

    def holds_on(self, device: torch.device) -> bool:
        return True


def test_rows_resident_on_the_device_cost_no_load() -> None:
    """Prohibitive loads make every block full, unless the template is on the device."""
    planner = make_planner(_model(load_slope=1.0), "cpu")
    assert planner([_state(0.25, Resident())], BLOCKS) == dict.fromkeys(BLOCKS, Mode.SPARSE)
    counts = batch_tokens(_model(1.0), [_state(0.25, Resident()), _state(0.25)], "cpu")
    assert counts[0] == (128, 512, 192)  # only the host-tier request's rows are loaded


def test_a_profile_made_on_a_gpu_plans_on_the_editors_device() -> None:
    """A GPU profile's ``device`` names the hardware (``cuda-<GPU name>``), which is no torch
    device: the planner asks residency of the device it was made for."""
    on_gpu = dataclasses.replace(_model(load_slope=1.0), device="cuda-NVIDIA-H100-80GB-HBM3")
    planner = make_planner(on_gpu, torch.device("cpu"))
    assert planner([_state(0.25, Resident())], BLOCKS) == dict.fromkeys(BLOCKS, Mode.SPARSE)


def test_blocks_outside_the_cost_model_stay_full() -> None:
    modes = make_planner(_model(0.0), "cpu")([_state(0.25)], [*BLOCKS, "extra"])
    assert modes["extra"] is Mode.FULL and list(modes) == [*BLOCKS, "extra"]


def test_a_request_in_its_warmup_counts_every_token() -> None:
    """Real ``RequestState``s: during ``full_steps`` the planner sees every token masked and
    no reader; afterwards the request's own mask."""

    def state(full_steps: int) -> RequestState:
        image = Image.new("RGB", (16, 16))
        request = EditRequest(image, np.zeros((16, 16), bool), "p", 1, 3, 1.0, "t", 1, full_steps)
        fake = _state(0.25)
        return RequestState(
            request, torch.zeros(1), None, torch.arange(3), None, fake.tokens, "cache"
        )

    warming, plain = state(full_steps=1), state(full_steps=0)
    assert warming.warming and warming.step_reader is None and not plain.warming
    assert batch_tokens(_model(0.0), [warming, plain], "cpu")[0] == (256 + 64, 512, 192)
    warming.index = 1  # warm-up over
    assert not warming.warming and warming.step_reader == "cache"
    assert batch_tokens(_model(0.0), [warming, plain], "cpu")[0] == (64 + 64, 512, 384)
