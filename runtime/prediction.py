"""Predicted completion of an invocation on an executor: its batch ⊕ a newcomer, stepped
forward with the executor's cost model and the bubble-free plan the executor itself runs.

One function, :func:`predict`, used by placement, admission, the autoscaler and the
simulator. It is torch-free (the gateway imports it) and shares the plan code with the
executor's :class:`~retouch.runtime.planner.Planner`: each step of a batch is costed by
``plan_step(cost_model.block_costs(tokens), policy)``, the very call the planner makes, plus
what the profile leaves out (time outside the profiled blocks, fitted by the executor from
its own steps: :class:`StepCalibration`).

The batch is stepped forward as the engine runs it: a group (the invocations of one model)
steps all its members at once, groups take turns, members leave when their steps are done,
waiting invocations join in order while the batch has room (``max_batch``). Between two
departures the batch is constant, so a prediction costs one plan per *segment*, not per
step, and plans are memoised per batch signature (:class:`StepCoster`): a decision over
hundreds of executors stays well under a millisecond.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from retouch.runtime.costmodel import CostModel
from retouch.runtime.plan import Policy, plan_step


@dataclass(frozen=True)
class StepCalibration:
    """What turns planned block costs into observed time.

    ``step_intercept_s + step_slope × planned`` is what a step really takes, fitted by the
    executor on its own steps (the time outside the profiled blocks; a profile taken while
    the device was busier or quieter than now); ``scale`` the ratio of observed to
    predicted completion the gateway sees on top (drift since that fit); ``pre_s`` and
    ``post_s`` the encode and decode an invocation waits for outside the engine's steps,
    each in one of ``pre_workers`` (``post_workers``) worker processes: more at once queue
    for them (0: not modelled, as if there were always a free worker); ``hop_s`` the time
    outside the executor's own account (the request and the answer between gateway and
    executor, the executor's admission)."""

    step_intercept_s: float = 0.0
    step_slope: float = 1.0
    scale: float = 1.0
    pre_s: float = 0.0
    post_s: float = 0.0
    pre_workers: int = 0
    post_workers: int = 0
    hop_s: float = 0.0


def queued_share(ahead: int, workers: int) -> float:
    """Extra service times a job waits with ``ahead`` jobs before it at ``workers`` workers
    (0 without a queue model): each one beyond the free workers adds 1/``workers``, the one
    in service counted whole (right for a burst placed at once, long by up to one service
    time for a job placed while another is half-encoded). A burst of encodes placed on one
    executor finishes one service time apart per worker (measured: 8 arrivals within
    0.14 s on one pre worker took 39, 68, ... 276 ms, where 47 ms was predicted)."""
    if workers <= 0:
        return 0.0
    return max(0, ahead + 1 - workers) / workers


TABLE_POINTS = 17  # masked fractions 0, 1/16, ..., 1 at which a step's plan is tabulated


def plan_table(
    cost_model: CostModel,
    grids: Sequence[int],
    max_batch: int,
    *,
    resident: bool = False,
    policy: Policy = Policy.BUBBLE_FREE,
) -> list[list[float]]:
    """The bubble-free plan's latency for batches of 1..``max_batch`` requests at masked
    fractions 0, 1/16, ..., 1 (the same fraction on every token grid). The executor builds
    it once per profile (a plan of a 57-block model takes milliseconds, too long for the
    gateway's event loop) and ships it with its cost model; predictions interpolate.
    ``resident``: every template in the device tier, so no row is loaded (the plan is the
    sparse compute alone). ``policy``: the executor's planner's (deterministic mode plans
    every block sparse)."""
    return [_plan_row(cost_model, grids, n, resident, policy) for n in range(1, max_batch + 1)]


def _plan_row(
    cost_model: CostModel,
    grids: Sequence[int],
    n: int,
    resident: bool = False,
    policy: Policy = Policy.BUBBLE_FREE,
) -> list[float]:
    row = []
    for i in range(TABLE_POINTS):
        fraction = i / (TABLE_POINTS - 1)
        tokens: list[tuple[int, ...]] = []
        for block in cost_model.blocks:
            total = n * grids[min(block.level, len(grids) - 1)]
            masked = round(fraction * total)
            tokens.append((masked, total, 0) if resident else (masked, total))
        row.append(plan_step(cost_model.block_costs(tokens), policy).latency)
    return row


class StepCoster:
    """Step latency of one model's batch from its cost model.

    ``grids`` are a request's token counts per grid level (finest first), as the cost
    model's blocks index them. A batch is summarised by its size and the masked fraction of
    its finest grid; the plan latency is interpolated in the executor's :func:`plan_table`
    (rows for batch sizes it lacks are planned here, once). Members whose template is in
    the device tier load nothing: a batch with ``resident`` of its ``n`` members so is
    costed between the plan that loads every unmasked row and the one that loads none
    (``resident_table``, shipped by an executor that has a device tier), in proportion.
    """

    def __init__(
        self,
        cost_model: CostModel,
        grids: Sequence[int],
        table: list[list[float]] | None = None,
        resident_table: list[list[float]] | None = None,
    ) -> None:
        if not grids:
            raise ValueError("a step coster needs the token grid of a request")
        self.cost_model = cost_model
        self.grids = tuple(int(g) for g in grids)
        self._rows: dict[int, list[float]] = {n + 1: row for n, row in enumerate(table or [])}
        self._held: dict[int, list[float]] = {
            n + 1: row for n, row in enumerate(resident_table or [])
        }

    def full_masks(self) -> tuple[int, ...]:
        """The per-level token counts of an invocation that computes every token."""
        return self.grids

    def step_s(self, n: int, masked: Sequence[int]) -> float:
        """Predicted seconds of the profiled blocks for ``n`` requests with ``masked``
        tokens per level, summed over the batch (the bubble-free plan's finish)."""
        return self.step_s0(n, masked[0])

    def step_s0(self, n: int, masked0: int, resident: int = 0) -> float:
        """:meth:`step_s` from the masked tokens of the finest grid alone; ``resident``
        of the ``n`` members have their template in the device tier."""
        if n <= 0:
            return 0.0
        row = self._rows.get(n)
        if row is None:
            row = self._rows[n] = _plan_row(self.cost_model, self.grids, n)
        x = min(1.0, max(0.0, masked0 / (n * self.grids[0]))) * (TABLE_POINTS - 1)
        i = min(int(x), TABLE_POINTS - 2)
        streamed = row[i] + (row[i + 1] - row[i]) * (x - i)
        if resident <= 0:
            return streamed
        held = self._held.get(n)
        if held is None:
            held = self._held[n] = _plan_row(self.cost_model, self.grids, n, resident=True)
        loads_none = held[i] + (held[i + 1] - held[i]) * (x - i)
        return streamed + (loads_none - streamed) * min(1.0, resident / n)


@dataclass
class Member:
    """An invocation as the prediction sees it: its model's coster, steps left, masked
    tokens per level (equal to the grid when it runs the full path: nothing cached), and
    its template's load from disk, which starts with its encode (0: the template is in host
    memory), and whether the template rests in the device tier (its steps load no rows)."""

    coster: StepCoster
    steps_left: int
    masked: tuple[int, ...]
    load_s: float = 0.0
    resident: bool = False

    def stepped(self, steps_left: int | None = None) -> list:
        """As :func:`predict` steps it: ``[end, masked tokens of the finest grid, coster,
        1 if device-resident else 0]``."""
        end = self.steps_left if steps_left is None else steps_left
        return [end, self.masked[0], self.coster, int(self.resident)]


@dataclass(frozen=True)
class Arrivals:
    """Work expected to join after the newcomer: one invocation like ``typical`` every
    ``interval_s`` (the executor's recent placement rate). On a device whose step time
    grows with the batch (a CPU, a saturated GPU) later arrivals slow the newcomer down;
    predicting them is what keeps the error small at high load."""

    interval_s: float
    typical: Member
    limit: int = 16  # at most this many expected arrivals are stepped


@dataclass(frozen=True)
class Prediction:
    """Seconds from now until the newcomer joins the batch and until its result is ready."""

    start_s: float
    finish_s: float


def predict(
    batch: Sequence[Member],
    waiting: Sequence[Member],
    newcomer: Member | None,
    max_batch: int,
    calibration: StepCalibration,
    arrivals: Arrivals | None = None,
) -> Prediction:
    """When would ``newcomer`` finish on an executor running ``batch`` with ``waiting``
    invocations ahead of it (in join order), and with ``arrivals`` expected after it? With
    ``newcomer`` None: when would the executor have drained everything it holds
    (``start_s == finish_s``; expected arrivals are not counted then).

    A decision runs this for every shortlisted executor, so it stays allocation-light.
    Members are stepped as ``[end, masked tokens of the finest grid, coster, resident]`` lists,
    where ``end`` is the round after which the member is done: the batch's rounds are
    counted once (``done``) instead of decrementing every member, and the batch's masked
    tokens are kept as a running sum (integers: the same as summing each round). A queued
    member's ``end`` holds its steps left until it joins."""
    active = [m.stepped(max(1, m.steps_left)) for m in batch]
    queue = deque(m.stepped(max(1, m.steps_left)) for m in waiting)
    target = None
    if newcomer is not None:
        target = newcomer.stepped(max(1, newcomer.steps_left))
        queue.append(target)
    expected = arrivals if arrivals is not None and target is not None else None
    coster = _one_coster(active, queue, expected)  # None: groups of several models
    # the newcomer's encode runs while the batch steps, after those placed before it; a
    # template on disk is loaded meanwhile (the prefetch), and what is left of it waits
    ready_at = calibration.pre_s * (1.0 + queued_share(len(waiting), calibration.pre_workers))
    if newcomer is not None:
        ready_at = max(ready_at, newcomer.load_s)
    step_s0 = coster.step_s0 if coster is not None else None
    intercept, slope, scale = (
        calibration.step_intercept_s,
        calibration.step_slope,
        calibration.scale,
    )
    tenth = 0.1 * slope  # as _calibrated multiplies: (0.1 * slope) * planned
    now = 0.0
    start = None
    next_arrival = expected.interval_s if expected is not None else math.inf
    arrived = 0
    done = 0  # rounds stepped so far
    masked = sum(m[1] for m in active)  # the running batch's masked tokens
    held = sum(m[3] for m in active)  # and its members with device-resident templates
    next_end = min((m[0] for m in active), default=0)  # the first departure's round
    # The post workers' backlog, as a fluid: each departure adds one decode, served by
    # ``post_workers`` at once (post_unit each); the newcomer's decode waits behind it.
    post_workers = calibration.post_workers if target is not None else 0
    post_unit = calibration.post_s / post_workers if post_workers > 0 else 0.0
    post_free = 0.0
    while True:
        while queue and len(active) < max_batch:
            if queue[0] is target and now < ready_at:
                break
            joining = queue.popleft()
            joining[0] += done
            if joining is target:
                start = now  # it joined the running batch
            next_end = joining[0] if not active else min(next_end, joining[0])
            active.append(joining)
            masked += joining[1]
            held += joining[3]
        if not active:
            if target is None or not queue:
                break
            now = max(now, ready_at)  # only the newcomer's own encode left to wait for
            continue
        if coster is not None:  # _calibrated(step_s0(...)), inlined: the hot path
            planned = step_s0(len(active), masked, held)
            step = intercept + slope * planned
            floor = tenth * planned
            round_s = max(1e-9, (step if step >= floor else floor) * scale)
        else:
            round_s = max(1e-9, _round_s(active, calibration))
        k = next_end - done
        if queue and queue[0] is target and len(active) < max_batch:
            k = max(1, min(k, math.ceil((ready_at - now) / round_s)))  # joins when encoded
        if next_arrival < now + k * round_s:  # the next expected arrival comes earlier
            k = max(1, min(k, math.ceil((next_arrival - now) / round_s)))
        now += k * round_s
        done += k
        if start is not None and target[0] <= done:
            break
        if next_end <= done:  # departures
            if post_workers > 0:
                for m in active:
                    if m[0] <= done:
                        post_free = max(post_free, now) + post_unit
            active = [m for m in active if m[0] > done]
            masked = sum(m[1] for m in active)
            held = sum(m[3] for m in active)
            next_end = min((m[0] for m in active), default=0)
        while expected is not None and next_arrival <= now and arrived < expected.limit:
            typical = expected.typical
            queue.append(typical.stepped(max(1, typical.steps_left)))
            arrived += 1
            next_arrival += expected.interval_s
        if expected is not None and arrived >= expected.limit:
            next_arrival = math.inf
    if target is None:
        return Prediction(now, now)
    post_s = calibration.post_s
    if post_workers > 0:  # its decode after those that left the batch before it
        for m in active:
            if m is target:
                break
            if m[0] <= done:  # left in its round, ahead of it
                post_free = max(post_free, now) + post_unit
        # the backlog drains at post_unit per decode; with spare workers it waits less
        now += max(0.0, post_free - now - (post_workers - 1) * post_unit)
    return Prediction(start if start is not None else now, now + post_s + calibration.hop_s)


def _one_coster(
    active: list[list], queue: deque[list], expected: Arrivals | None
) -> StepCoster | None:
    """The coster every member shares (the common case: one model), else None: then each
    round is costed by its groups (:func:`_round_s`)."""
    members = [*active, *queue]
    if not members:
        return None
    coster = members[0][2]
    if any(m[2] is not coster for m in members):
        return None
    if expected is not None and expected.typical.coster is not coster:
        return None
    return coster


def _round_s(active: list[list], calibration: StepCalibration) -> float:
    """One step of every group (the engine takes turns between models): each group's plan,
    calibrated."""
    coster = active[0][2]
    if all(m[2] is coster for m in active):  # the common case: one model
        planned = coster.step_s0(len(active), sum(m[1] for m in active), sum(m[3] for m in active))
        return _calibrated(planned, calibration)
    groups: dict[int, list] = {}
    for m in active:
        group = groups.setdefault(id(m[2]), [m[2], 0, 0, 0])
        group[1] += 1
        group[2] += m[1]
        group[3] += m[3]
    return sum(
        _calibrated(c.step_s0(n, masked, held), calibration)
        for c, n, masked, held in groups.values()
    )


def _calibrated(planned_s: float, calibration: StepCalibration) -> float:
    """A planned step as it will take: the executor's fit, times the drift."""
    fitted = fitted_step_s(planned_s, calibration.step_intercept_s, calibration.step_slope)
    return fitted * calibration.scale


def fitted_step_s(planned_s: float, intercept_s: float, slope: float) -> float:
    """A planned step as an engine's step fit says it takes: ``intercept + slope x plan``,
    never below a tenth of the (sloped) plan however far a negative intercept reaches (the
    simulated engine steps with the same fit)."""
    return max(intercept_s + slope * planned_s, 0.1 * slope * planned_s)


def batch_step_s(batch: Sequence[Member], calibration: StepCalibration) -> float:
    """Predicted seconds of one step of ``batch`` (every model's group once), calibrated."""
    if not batch:
        return 0.0
    return _round_s([m.stepped() for m in batch], calibration)


def departure_s(batch: Sequence[Member], calibration: StepCalibration, k: int = 1) -> float:
    """Seconds until the ``k``-th member of a running batch finishes (``k`` places in it
    free), at the batch's present round time; the last member's when ``k`` exceeds it."""
    if not batch:
        return 0.0
    active = [m.stepped() for m in batch]
    steps = sorted(m.steps_left for m in batch)
    return steps[min(k, len(steps)) - 1] * _round_s(active, calibration)


# -- what a mask costs on each token grid ----------------------------------------------------

TOKEN_PX = (8, 16, 32, 64)  # token sizes in pixels: SD UNet levels; Flux and SD3 pack 16
LATENT_PX = 8  # every family served has an 8x VAE: one latent pixel per 8x8 image pixels


@dataclass(frozen=True)
class MaskFootprint:
    """An edit mask summarised for prediction: masked tokens on every token size a family
    uses, counted as the executor computes them (see :meth:`of`)."""

    ratio: float
    pixels: int  # image pixels (H x W)
    masked: dict[int, int]  # token size in pixels -> masked tokens
    _on: dict[tuple[int, ...], tuple[int, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def of(cls, mask: np.ndarray, halo: int = 0) -> MaskFootprint:
        """The tokens the executor will compute for ``mask``: the pipeline's nearest resize
        onto the latent grid (one image pixel stands for its 8x8 cell), grown by ``halo``
        latent pixels, then max-pooled onto each token grid (``runtime/maskaware/tokens``).
        Counting a token whenever *any* of its pixels is masked overestimated irregular
        masks: a 0.6 blob touches every 16-px token, the executor computes 83 % of them,
        and such invocations were predicted 1.46x long (measured on small-flux)."""
        h, w = mask.shape
        lh, lw = max(1, h // LATENT_PX), max(1, w // LATENT_PX)
        # F.interpolate(mode="nearest") reads source index floor(i * in / out)
        latent = mask[np.ix_(np.arange(lh) * h // lh, np.arange(lw) * w // lw)]
        latent = _dilate(latent.astype(bool), halo)
        masked = {}
        for px in TOKEN_PX:
            k = max(1, px // LATENT_PX)
            gh, gw = -(-lh // k), -(-lw // k)
            padded = np.zeros((gh * k, gw * k), dtype=bool)
            padded[:lh, :lw] = latent
            masked[px] = int(padded.reshape(gh, k, gw, k).any(axis=(1, 3)).sum())
        return cls(float(mask.mean()) if mask.size else 0.0, h * w, masked)

    def on(self, grids: Sequence[int]) -> tuple[int, ...]:
        """Masked tokens per level of a model whose request has ``grids`` tokens per level."""
        key = tuple(grids)
        cached = self._on.get(key)
        if cached is None:
            cached = self._on[key] = self._tokens_on(key)
        return cached

    def _tokens_on(self, grids: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(min(tokens, self.masked[self._token_px(tokens)]) for tokens in grids)

    def _token_px(self, tokens: int) -> int:
        """The token size of a grid of ``tokens``: the one whose grid of the image, taken a
        whole number of times, makes it (fewest copies first: a grid holding a reference
        image's tokens after the image's, as Kontext's, is twice the image's), else the
        nearest by area. Only the image's own tokens are ever masked."""
        if not tokens:
            return TOKEN_PX[-1]
        copies = {}
        for px in TOKEN_PX:
            times = tokens * px * px / self.pixels
            if times >= 0.9 and abs(times - round(times)) <= 0.1:
                copies[px] = round(times)
        if copies:
            return min(copies, key=lambda px: (copies[px], px))
        px = math.sqrt(self.pixels / tokens)
        return min(TOKEN_PX, key=lambda p: abs(p - px))


def _dilate(grid: np.ndarray, pixels: int) -> np.ndarray:
    """``grid`` grown by ``pixels`` in every direction (a square window), as
    ``tokens.dilate`` grows the latent mask by a family's halo."""
    if pixels <= 0:
        return grid
    out = grid.copy()
    for axis in (0, 1):
        grown = out.copy()
        n = out.shape[axis]
        for d in range(1, min(pixels, n - 1) + 1):
            ahead = [slice(None)] * 2
            behind = [slice(None)] * 2
            ahead[axis], behind[axis] = slice(d, None), slice(None, n - d)
            grown[tuple(behind)] |= out[tuple(ahead)]
            grown[tuple(ahead)] |= out[tuple(behind)]
        out = grown
    return out
