"""The bubble-free plan (FlashPS Algorithm 1, generalized): per step, which blocks run
sparse (compute on masked tokens, needing cached rows loaded) and which run full.

Two resources work in parallel: the compute stream and the load stream (a CUDA stream on
GPU, a loader thread on CPU). A sparse block must wait until its rows are loaded; a full
block needs no rows of its own — but a full block right after a sparse one needs the sparse
block's output for the unmasked rows (its cached Y), which must be loaded too (DESIGN.md,
"feasibility"). FlashPS's greedy pass decides block by block; here a small dynamic
programme over (block, previous mode) keeps every non-dominated (compute clock, load clock)
pair, so it finds the plan with the earliest finish exactly, in O(N · frontier).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


class Mode(enum.Enum):
    """How a block runs in one step. Defined here, torch-free, because the gateway's
    prediction runs the same plan as the executor without importing torch."""

    FULL = "full"  # the standard block over every token
    SPARSE = "sparse"  # masked tokens only, cached K/V/Y for the rest


class Policy(enum.Enum):
    """How a step's modes are chosen. ``BUBBLE_FREE`` finishes each step earliest, so a
    step's modes follow its batch and the measured timings; and since a full block computes
    the unmasked tokens afresh (under the edit's prompt and adapters) where a sparse one
    reads the template's, an edit's pixels then depend on what it was batched with and on
    the profile (docs/maskaware.md, "Exactness and reproducibility"). ``SPARSE`` runs every
    block sparse where rows are cached: the pixels depend on the request alone
    (deterministic mode), at the cost of the bubbles the plan would have avoided."""

    BUBBLE_FREE = "bubble-free"
    SPARSE = "sparse"


@dataclass(frozen=True)
class BlockCost:
    """Measured or predicted costs of one block for the batch at hand (seconds).

    ``load_sparse``: loading the rows a sparse block itself needs (its cached K/V, plus Y
    where the family needs it inside the block). ``load_exit``: loading this block's Y when
    the *next* block runs full after it ran sparse (0 where Y is always loaded anyway).
    """

    sparse: float
    full: float
    load_sparse: float
    load_exit: float = 0.0


@dataclass(frozen=True)
class Plan:
    modes: tuple[Mode, ...]
    latency: float  # predicted finish of the last block's compute
    load_time: float  # total busy time of the load stream

    @property
    def sparse_blocks(self) -> int:
        return sum(m is Mode.SPARSE for m in self.modes)


@dataclass(frozen=True)
class _State:
    comp: float
    load: float
    modes: tuple[Mode, ...] = field(default=())


def bubble_free_plan(costs: list[BlockCost]) -> Plan:
    """The plan that finishes the step earliest with loads overlapped with compute."""
    frontier: dict[Mode | None, list[_State]] = {None: [_State(0.0, 0.0)]}
    for i, cost in enumerate(costs):
        prev_exit = costs[i - 1].load_exit if i else 0.0
        nxt: dict[Mode | None, list[_State]] = {Mode.SPARSE: [], Mode.FULL: []}
        for prev_mode, states in frontier.items():
            for s in states:
                nxt[Mode.SPARSE].append(_sparse(s, cost))
                nxt[Mode.FULL].append(
                    _full(s, cost, prev_exit if prev_mode is Mode.SPARSE else 0.0)
                )
        frontier = {mode: _pareto(states) for mode, states in nxt.items()}
    best = min((s for states in frontier.values() for s in states), key=lambda s: (s.comp, s.load))
    return Plan(best.modes, best.comp, best.load)


def _sparse(s: _State, cost: BlockCost) -> _State:
    load = s.load + cost.load_sparse
    return _State(max(load, s.comp) + cost.sparse, load, (*s.modes, Mode.SPARSE))


def _full(s: _State, cost: BlockCost, exit_load: float) -> _State:
    if exit_load:  # the previous sparse block's Y must be resident before this block runs
        load = s.load + exit_load
        return _State(max(load, s.comp) + cost.full, load, (*s.modes, Mode.FULL))
    return _State(s.comp + cost.full, s.load, (*s.modes, Mode.FULL))


def _pareto(states: list[_State]) -> list[_State]:
    """Keep states no other state beats on both clocks (earlier compute and earlier load)."""
    kept: list[_State] = []
    for s in sorted(states, key=lambda s: (s.comp, s.load)):
        if not kept or s.load < kept[-1].load:
            kept.append(s)
    return kept


def greedy_plan(costs: list[BlockCost]) -> Plan:
    """FlashPS Algorithm 1 as published (block by block), with the same feasibility rule."""
    comp = load = 0.0
    modes: list[Mode] = []
    for i, cost in enumerate(costs):
        exit_load = costs[i - 1].load_exit if modes and modes[-1] is Mode.SPARSE else 0.0
        if (
            max(load + cost.load_sparse, comp) + cost.sparse
            <= max(load + exit_load, comp) + cost.full
        ):
            load += cost.load_sparse
            comp = max(load, comp) + cost.sparse
            modes.append(Mode.SPARSE)
        else:
            if exit_load:
                load += exit_load
                comp = max(load, comp)
            comp += cost.full
            modes.append(Mode.FULL)
    return Plan(tuple(modes), comp, load)


def all_sparse_plan(costs: list[BlockCost]) -> Plan:
    """Every block sparse, loads overlapped with compute (``Policy.SPARSE``)."""
    modes = (Mode.SPARSE,) * len(costs)
    return Plan(modes, evaluate(costs, modes), sum(c.load_sparse for c in costs))


def plan_step(costs: list[BlockCost], policy: Policy = Policy.BUBBLE_FREE) -> Plan:
    """The plan *policy* gives a step with these block costs."""
    return all_sparse_plan(costs) if policy is Policy.SPARSE else bubble_free_plan(costs)


def sequential_latency(costs: list[BlockCost]) -> float:
    """All blocks sparse with each load *before* its compute and no overlap (naive loading)."""
    return sum(c.load_sparse + c.sparse for c in costs)


def evaluate(costs: list[BlockCost], modes: tuple[Mode, ...]) -> float:
    """Predicted step latency of a given plan under overlapped loading."""
    s = _State(0.0, 0.0)
    prev: Mode | None = None
    for i, (cost, mode) in enumerate(zip(costs, modes, strict=True)):
        if mode is Mode.SPARSE:
            s = _sparse(s, cost)
        else:
            s = _full(s, cost, costs[i - 1].load_exit if prev is Mode.SPARSE else 0.0)
        prev = mode
    return s.comp
