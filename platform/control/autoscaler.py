"""Autoscaling a model pool on predicted work: a pure policy and a thin stateful wrapper.

Two signals, both from the predictions placement uses; the desired count is the larger:
* the *predicted seconds of work* on the pool (running invocations' remaining time plus the
  queued invocations' service) divided by ``target_s``, the work one executor should hold;
* the *demand*: the executors the arriving work fills, i.e. the executor-seconds the recent
  arrivals need (each at its share of a full batch) per second, divided by
  ``target_utilisation``, plus ``headroom_sigmas`` × its square root (square-root
  staffing: a small pool needs relatively more room for a burst). Work on the pool rises
  only as it piles up, a tick or more after the arrival rate stepped up; the demand moves
  with the arrivals themselves (refused ones included, so admission control does not hide
  the load).
GPU utilisation is not a signal, because it stays high whether a GPU is lightly loaded or
saturated.

The rules come from Knative's KPA, Kubernetes' HPA and the failure reports of Ray Serve
users:
* decisions count **target** executors (ready + starting), so a slow start-up does not
  trigger another scale-up (Ray issue #18925);
* scale-up follows the **stable window** (60 s) of both signals, the short **panic window**
  (6 s) of the work, and two **CUSUMs** of the demand against the stable window before it
  (a sustained rise shows within a few ticks, a jump such as a 2x step within two, the
  noise of a stationary stream about once in an hour or two; the noise is at least the
  Poisson noise of the arrivals counted). The panic window does not count the demand: over a few seconds its noise would
  move the pool back and forth. When the panic window asks for ``panic_threshold`` times
  the current count the pool panics, and no scale-down happens for ``panic_hold_s``;
* either direction moves only when the recommendation leaves a **tolerance** band around
  the current count (10 %, as Kubernetes' HPA): a short window's noise must not move a pool
  that holds its load (each such move is undone later, a direction reversal);
* a scale-down takes the **highest** recommendation of the last ``downscale_delay_s``
  (HPA's stabilisation window), or count a scale-up chose in the last ``hold_s`` (the
  delay, or ``upscale_hold_s`` when longer: on a bursty stream a burst's scale-up undone a
  delay later is followed by the next burst's, two reversals each time), plus
  ``downscale_margin`` of it, and never happens while panicking or while anything is
  queued;
* no scale-down before the pool was observed for a scale-down delay (the shorter of
  ``downscale_delay_s`` and ``downscale_to_zero_delay_s``) and for the stable window: the
  highest recommendation over a delay needs that delay's history, and the stable window's
  mean its window, so a pool that starts (or a gateway that restarts) does not shrink on
  its first samples and grow back, a direction reversal;
* going to zero waits ``downscale_to_zero_delay_s`` of no work, no queue and no demand;
* from zero, any work scales up at once;
* a scale-down waits at least the pool's measured start-up too (its delays or this, the
  longer): taking an executor away is undone by a wake where the victims sleep, by a cold
  start where they stop. An executor idle for as long as its return would take has cost
  no more than that return (the ski-rental rule: never more than twice the least GPU time
  in hindsight), and a cold start that returns it within its start-up is a direction
  reversal paid for twice. With sleep (a wake of seconds) the delays decide.

Time is always passed in; the simulator runs this on a virtual clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class AutoscalingConfig:
    """A pool's scaling settings. Defaults suit executors that take minutes to start: the
    stable window outlasts a start-up, and scale-down waits ten minutes."""

    min_executors: int = 0
    max_executors: int = 1
    target_s: float = 30.0  # predicted seconds of work per executor
    target_utilisation: float = 0.8  # the share of an executor's capacity demand may fill
    tolerance: float = 0.1  # no change while the recommendation is within this of the count
    headroom_sigmas: float = 0.0  # + this x sqrt(demand) executors (see _for_demand)
    shift_k: float = 1.0  # a demand rise's CUSUM: slack per sample, in sigmas (see _risen_to)
    shift_h: float = 5.0  # ... and the sum that counts as a rise, in sigmas
    jump_k: float = 2.0  # a demand jump's CUSUM (runs of two ticks or more): slack, in sigmas
    jump_h: float = 1.3  # ... and the sum that counts as a jump, in sigmas
    jump_spread: float = 1.5  # ... on arrivals counted, no noisier than this x Poisson's
    stable_window_s: float = 60.0
    panic_window_s: float = 6.0
    panic_threshold: float = 2.0  # panic when the panic window wants this x the target count
    panic_hold_s: float = 60.0  # a panic lasts at least this long
    downscale_delay_s: float = 600.0
    downscale_to_zero_delay_s: float = 300.0
    upscale_hold_s: float = 0.0  # a scale-up's count holds at least this long (see hold_s)
    rise_cap: float = 2.0  # a demand rise is taken at most to this x its baseline
    downscale_margin: float = 0.0  # a scale-down keeps this share above the held count

    @property
    def hold_s(self) -> float:
        """How long the count a scale-up chose holds the pool up: the scale-down delay, or
        ``upscale_hold_s`` when longer."""
        return max(self.downscale_delay_s, self.upscale_hold_s)

    def __post_init__(self) -> None:
        if not 0 <= self.min_executors <= self.max_executors or self.max_executors < 1:
            raise ValueError("need 0 <= min_executors <= max_executors and max_executors >= 1")
        if self.target_s <= 0 or self.panic_window_s <= 0 or self.stable_window_s <= 0:
            raise ValueError("target and windows must be positive")
        if not 0 < self.target_utilisation <= 1:
            raise ValueError("target_utilisation must be in (0, 1]")
        if not 0 <= self.tolerance < 1:
            raise ValueError("tolerance must be in [0, 1)")
        if not self.headroom_sigmas >= 0:
            raise ValueError("headroom_sigmas must be >= 0")
        if not self.upscale_hold_s >= 0:
            raise ValueError("upscale_hold_s must be >= 0")
        if not self.rise_cap >= 1:
            raise ValueError("rise_cap must be >= 1")
        if not 0 <= self.downscale_margin < 1:
            raise ValueError("downscale_margin must be in [0, 1)")


@dataclass(frozen=True)
class LoadSample:
    """The pool at one tick: predicted seconds of work, invocations still queued, and the
    demand of the arrivals since the last tick (executors' worth; 0 when not measured) and
    how many arrivals that was (0 when not counted)."""

    at: float
    work_s: float
    queued: int
    demand: float = 0.0
    arrivals: int = 0


@dataclass(frozen=True)
class Decision:
    desired: int
    panicking: bool
    reason: str


def recommend(config: AutoscalingConfig, samples: list[LoadSample], now: float) -> int:
    """Executors for the mean work and demand over the stable window, or for the work over
    the panic window when that asks for more (the pure core). Scale-down holds the highest
    of these, and of the counts scale-ups chose, over its delay, so a scale-up made on the
    short window is not undone by the long one lagging."""
    stable = _count(config, samples, now - config.stable_window_s)
    return max(stable, _count(config, samples, now - config.panic_window_s, demand=False))


def decide(
    config: AutoscalingConfig,
    samples: list[LoadSample],
    target: int,
    now: float,
    panic_until: float,
    recent: list[tuple[float, int]],
    observed_since: float | None = None,
    upscales: Sequence[tuple[float, int]] = (),
    startup_s: float = 0.0,
) -> Decision:
    """The pool's desired executor count.

    ``samples`` are the recent ticks, ``target`` is ready + starting executors, and
    ``panic_until`` is when the current panic ends. ``recent`` holds the stable
    recommendations of the last ``downscale_delay_s`` (or ``startup_s``, the longer),
    ``upscales`` the counts scale-ups
    chose (each held for ``hold_s``); ``observed_since`` is the first sample's time
    (default: the oldest kept); ``startup_s`` what bringing back an executor a scale-down
    takes would cost (0: not measured), the least any scale-down waits."""
    latest = samples[-1] if samples else LoadSample(now, 0.0, 0)
    stable = _count(config, samples, now - config.stable_window_s)
    # The short window counts work only: the demand's noise over a few seconds would move
    # the pool back and forth; its sustained rises are the CUSUM's (_risen_to).
    panic = _count(config, samples, now - config.panic_window_s, demand=False)
    if target == 0 and (latest.work_s > 0 or latest.queued > 0 or latest.demand > 0):
        return Decision(max(1, panic, stable), True, "work arrived at an empty pool")
    if target > 0 and panic >= config.panic_threshold * target:
        return Decision(max(panic, target), True, "panic: the burst outgrows the pool")
    if now < panic_until:
        return Decision(max(target, stable, panic), True, "panicking: no scale-down")
    risen = _risen_to(config, samples, now)
    if risen > target * (1 + config.tolerance):
        return Decision(risen, False, "the arrivals' demand rose and stayed up")
    # up on the short window, down only on the long one; both beyond a tolerance (HPA's),
    # so that the noise of a short window does not move a pool that holds its load
    if max(stable, panic) > target * (1 + config.tolerance):
        return Decision(max(stable, panic), False, "more work than the pool's target")
    first = observed_since if observed_since is not None else samples[0].at if samples else now
    observe_s = min(config.downscale_delay_s, config.downscale_to_zero_delay_s)
    if now - first < max(observe_s, config.stable_window_s):
        return Decision(target, False, "not observed for a scale-down delay yet")
    if latest.queued > 0 or any(s.queued for s in samples if s.at >= now - config.panic_window_s):
        return Decision(target, False, "invocations queued: no scale-down")
    window = [n for at, n in recent if at >= now - max(config.downscale_delay_s, startup_s)]
    window += [n for at, n in upscales if at >= now - max(config.hold_s, startup_s)]
    held = max(window, default=stable)
    if held == 0:
        idle_since = _idle_since(samples)
        zero_delay_s = max(config.downscale_to_zero_delay_s, startup_s)
        if idle_since is None or now - idle_since < zero_delay_s:
            return Decision(max(config.min_executors, min(target, 1)), False, "not idle long")
    if held >= target * (1 - config.tolerance):
        return Decision(target, False, "steady: within the tolerance")
    # a pool brought down exactly to what it held takes the next burst's first executor
    # back at once (at ten executors, +1 is beyond the tolerance): a reversal. Rounded to
    # the nearest count, so that a small pool may still come down to what it holds.
    kept = held + math.floor(held * config.downscale_margin + 0.5)
    desired = _clamped(config, min(target, kept))
    return Decision(desired, False, "scale down" if desired < target else "steady")


def _risen_to(config: AutoscalingConfig, samples: list[LoadSample], now: float) -> int:
    """Executors for the demand's new level when it rose and stayed up (0: it did not).

    Two one-sided CUSUMs over the panic window's samples, against the mean and spread of
    the demand in the stable window before them; each is the largest sum, over the runs of
    samples ending now, of each sample's excess over mean + k sigma, and counts beyond h
    sigma (Page's CUSUM):
    * a *rise*, k = ``shift_k`` (1), h = ``shift_h`` (5): a moderate rise that lasts;
    * a *jump*, k = ``jump_k`` (2), h = ``jump_h`` (1.3), over runs of two ticks or more
      (a single noisy tick raised most false jumps), only where the arrivals are counted
      and the stream is no noisier than ``jump_spread`` x Poisson's: a 2x step at 15
      Poisson arrivals a tick shows within two ticks ~87 % of the time (the rise alone:
      ~60 %). On a bursty stream (Gamma, CV 2) it raised false jumps; the rise is left.
    Sigma is the demand's spread in the stable window, but at least the Poisson noise of
    the arrivals counted there (mean / sqrt(arrivals per tick)): 54 samples estimate a
    spread only to ~10 %, and each underestimate lowered the thresholds. On a stationary
    Poisson stream both together raise a false rise about once in 1.5 hours at 30
    arrivals a tick (the rise alone on the spread alone, as before: once in ~2.5 hours;
    synthetic streams). The panic window's mean alone reacts slowly (a 2x step moves a 6 s
    mean by a third after two ticks) and a shorter window flaps on noise."""
    since = now - config.panic_window_s
    baseline = [s for s in samples if now - config.stable_window_s <= s.at < since]
    stable = [s.demand for s in baseline]
    recent = [s.demand for s in samples if s.at >= since]
    if len(stable) < 2 * len(recent) or not recent:  # the baseline precedes the run
        return 0
    mean = _mean(stable)
    spread = math.sqrt(_mean([(d - mean) ** 2 for d in stable]))
    arrivals = _mean([s.arrivals for s in baseline])
    poisson = mean / math.sqrt(arrivals) if arrivals > 0 else 0.0
    # counted and not bursty, judged on the spread itself (a floor above Poisson's noise,
    # 5 % of the mean past ~900 arrivals a tick, would turn the jump rule off)
    jumps = poisson > 0 and spread <= config.jump_spread * poisson
    # the demand is at least as noisy as a Poisson stream's, and never below 5 % of its mean
    sigma = max(spread, 0.05 * mean, poisson)
    if sigma <= 0:
        return 0
    level = _cusum(recent, mean + config.shift_k * sigma, config.shift_h * sigma, 1)
    if jumps:
        jump = _cusum(recent, mean + config.jump_k * sigma, config.jump_h * sigma, 2)
        level = max(level, jump)
    if level <= 0:
        return 0
    # A few bursty seconds can average several times the baseline; the rise is taken at
    # most to ``rise_cap`` x the baseline (the CUSUM fires again on a larger one, and the
    # stable window follows it). On a bursty stream a larger cap overshoots, and the
    # overshoot comes back down a scale-down delay later: a reversal.
    return _clamped(config, _for_demand(config, min(level, config.rise_cap * mean)))


def _cusum(recent: list[float], slack: float, threshold: float, shortest: int) -> float:
    """The mean of the run of ``recent`` ending now (``shortest`` samples or more) whose
    sum of excesses over ``slack`` is the largest, when that sum exceeds ``threshold``;
    else 0."""
    best, level, total = 0.0, 0.0, 0.0
    for n, d in enumerate(reversed(recent), 1):  # the run ending now, grown backwards
        total += d - slack
        if n >= shortest and total > best:
            best, level = total, _mean(recent[-n:])
    return level if best > threshold else 0.0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _count(
    config: AutoscalingConfig, samples: list[LoadSample], since: float, demand: bool = True
) -> int:
    """Executors for the mean work (and the mean demand, unless ``demand`` is False) of
    the samples since ``since``."""
    window = [s for s in samples if s.at >= since]
    work_s = _mean([s.work_s for s in window])
    demand_mean = _mean([s.demand for s in window]) if demand else 0.0
    for_work = math.ceil(work_s / config.target_s - 1e-9) if work_s > 0 else 0
    return _clamped(config, max(for_work, _for_demand(config, demand_mean)))


def _clamped(config: AutoscalingConfig, wanted: int) -> int:
    return max(config.min_executors, min(config.max_executors, wanted))


def _for_demand(config: AutoscalingConfig, demand: float) -> int:
    """Executors for ``demand`` (executors' worth of arriving work): at the target
    utilisation, plus ``headroom_sigmas`` times its square root (square-root staffing: a
    small pool needs relatively more room for a burst than a large one)."""
    if demand <= 0:
        return 0
    wanted = demand / config.target_utilisation + config.headroom_sigmas * math.sqrt(demand)
    return math.ceil(wanted - 1e-9)


def _history_s(config: AutoscalingConfig) -> float:
    """How long samples are kept: twice the longest window. Going to zero needs an idle
    run *longer* than its delay, so a history of exactly that delay (ticks land a little
    late in real time) would never see one."""
    return 2.0 * max(config.stable_window_s, config.downscale_to_zero_delay_s)


def _idle_since(samples: list[LoadSample]) -> float | None:
    """When the last run of samples with no work began (None: the latest had work)."""
    since = None
    for s in reversed(samples):
        if s.work_s > 0 or s.queued or s.demand > 0:
            break
        since = s.at
    return since


class Autoscaler:
    """The stateful part: recent samples, recent recommendations and the panic's end.
    It makes no calls and starts nothing; the caller acts on the decisions."""

    def __init__(self, config: AutoscalingConfig) -> None:
        self.config = config
        self._keep_s = _history_s(config)
        self._samples: deque[LoadSample] = deque()
        self._recent: deque[tuple[float, int]] = deque()
        self._upscales: deque[tuple[float, int]] = deque()
        self._panic_until = -math.inf
        self._first_at: float | None = None
        # history is kept for the longest start-up seen, so that an estimate that moves back
        # up finds the recommendations of its whole wait (the first, measured at the pool's
        # first start, comes before its first scale-down)
        self._startup_s = 0.0
        self.decisions = 0
        self.reversals = 0
        self._last_direction = 0

    def reconfigure(self, config: AutoscalingConfig) -> None:
        """New settings (a function was deployed, changed or deleted); the history stays."""
        self.config = config
        self._keep_s = _history_s(config)

    def tick(
        self,
        now: float,
        work_s: float,
        queued: int,
        target: int,
        demand: float = 0.0,
        arrivals: int = 0,
        startup_s: float = 0.0,
    ) -> Decision:
        """One decision. ``demand``: the executors' worth of work that arrived since the
        last tick (executor-seconds per second); 0 leaves the work signal alone.
        ``arrivals``: how many invocations that was (0: not counted). ``startup_s``: the
        measured return of a scaled-down executor, a wake where victims sleep (0: none)."""
        self._samples.append(LoadSample(now, work_s, queued, demand, arrivals))
        self._startup_s = longest = max(self._startup_s, startup_s)
        keep_s = max(self._keep_s, 2.0 * longest)  # going to zero waits the start-up too
        while self._samples and self._samples[0].at < now - keep_s:
            self._samples.popleft()
        samples = list(self._samples)
        self._recent.append((now, recommend(self.config, samples, now)))
        while self._recent and self._recent[0][0] < now - max(
            self.config.downscale_delay_s, longest
        ):
            self._recent.popleft()
        while self._upscales and self._upscales[0][0] < now - max(self.config.hold_s, longest):
            self._upscales.popleft()
        if self._first_at is None:
            self._first_at = now
        decision = decide(
            self.config,
            samples,
            target,
            now,
            self._panic_until,
            list(self._recent),
            self._first_at,
            list(self._upscales),
            startup_s,
        )
        if decision.panicking and now >= self._panic_until:
            self._panic_until = now + self.config.panic_hold_s
        if decision.desired > target:
            self._upscales.append((now, decision.desired))
        self._count(decision.desired - target)
        return decision

    def _count(self, change: int) -> None:
        if change == 0:
            return
        self.decisions += 1
        direction = 1 if change > 0 else -1
        if self._last_direction and direction != self._last_direction:
            self.reversals += 1
        self._last_direction = direction
