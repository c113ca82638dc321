"""The engine's planner: each step's plan from the model's profiled cost model.

:mod:`retouch.runtime.plan` decides a plan from block costs alone; this module costs a
batch's blocks with the cost model (its masked, total and streamed tokens per block) and
asks it, once per step. Apart from the plan so that the plan imports no cost model (the
cost model predicts :class:`~retouch.runtime.plan.BlockCost` s).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from retouch.runtime.plan import Mode, Plan, Policy, plan_step

if TYPE_CHECKING:
    from retouch.runtime.costmodel import CostModel
    from retouch.runtime.maskaware.buckets import Buckets
    from retouch.runtime.maskaware.request import RequestState

PlanFn = Callable[[list["RequestState"], list[str]], dict[str, Mode]]


@dataclass
class Planner:
    """The plan of each step from the cost model (``editor.plan`` signature): the
    bubble-free plan, or every block sparse under ``Policy.SPARSE``.

    Each block's (masked, total) tokens are summed over the batch on that block's token
    grid (its ``level``: 0 the finest grid of a request, 1 the next...). A request without
    a cache computes every token: masked = total. ``last`` keeps the latest plan (the
    predicted step latency and load time) for the engine's metrics.
    """

    cost_model: CostModel
    device: str  # where the rows must rest to be read without a load
    buckets: Buckets | None = None  # the editor's: steps are costed as padded
    policy: Policy = Policy.BUBBLE_FREE
    last: Plan | None = None

    def __call__(
        self, states: list[RequestState], blocks: list[str], *, resident: bool = False
    ) -> dict[str, Mode]:
        """``resident``: plan as if every template rested on the device (no row loads)."""
        modes = dict.fromkeys(blocks, Mode.FULL)
        tokens = batch_tokens(self.cost_model, states, self.device, self.buckets, resident)
        costs = self.cost_model.block_costs(tokens)
        if not any(s.step_reader is not None for s in states):
            # Nothing cached: sparse would compute every token anyway. The all-full plan
            # is still kept: its latency is what the step is predicted to take.
            self.last = Plan(tuple(modes.values()), sum(c.full for c in costs), 0.0)
            return modes
        plan = plan_step(costs, self.policy)
        self.last = plan
        for profile, mode in zip(self.cost_model.blocks, plan.modes, strict=True):
            if profile.name in modes:
                modes[profile.name] = mode
        return modes


def make_planner(
    cost_model: CostModel,
    device: object,
    buckets: Buckets | None = None,
    policy: Policy = Policy.BUBBLE_FREE,
) -> Planner:
    """``editor.set_planner(make_planner(cost_model, editor.device, editor.buckets))``; the
    engine passes its result to ``step``. *device* is the torch device the editor runs on:
    the cost model's own ``device`` is a label of the hardware profiled
    (``cuda-NVIDIA-H100…``), not one."""
    return Planner(cost_model, str(device), buckets, policy)


def batch_tokens(
    cost_model: CostModel,
    states: list[RequestState],
    device: object,
    buckets: Buckets | None = None,
    resident: bool = False,
) -> list[tuple[int, int, int]]:
    """Per profiled block, the batch's (masked, total, streamed) tokens on the block's token
    grid; *streamed* counts the unmasked tokens whose rows must be loaded: none of a
    request whose template is resident on *device* (the editor's torch device). With the
    editor's ``buckets``, masked counts are the bucket the step is padded to: what it
    computes, and one plan per bucket (a captured graph's modes do not follow the mask).
    ``resident``: count no row as streamed (a graphed step copies them all in ahead)."""
    import torch  # the executor's planner runs this; the gateway never does (torch-free)

    from retouch.runtime.maskaware.store import all_resident

    padding = None
    if buckets is not None:
        sizes = {size for s in states for size in s.step_tokens}
        padding = buckets.padding(tuple(s.step_tokens[size] for s in states) for size in sizes)
    grids = [sorted(s.step_tokens.items(), key=lambda kv: -kv[1].n_tokens) for s in states]
    device = torch.device(device)
    held = [
        s.step_reader is not None and (resident or all_resident(s.step_reader, device))
        for s in states
    ]
    out = []
    for profile in cost_model.blocks:
        masked = total = streamed = 0
        for state, levels, here in zip(states, grids, held, strict=True):
            tokens = levels[min(profile.level, len(levels) - 1)][1]
            total += tokens.n_tokens
            count = tokens.count if state.step_reader is not None else tokens.n_tokens
            if padding is not None:
                count = padding[tokens.n_tokens]
            masked += count
            streamed += 0 if here else tokens.n_tokens - count
        out.append((masked, total, streamed))
    return out
