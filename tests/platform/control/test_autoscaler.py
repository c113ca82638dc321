"""The autoscaling policy on a virtual clock: scale-up, panics, held scale-downs, zero."""

from __future__ import annotations

import itertools
import math

import pytest

from retouch.platform.control.autoscaler import Autoscaler, AutoscalingConfig

CONFIG = AutoscalingConfig(
    min_executors=0, max_executors=16, target_s=10.0, downscale_delay_s=120.0,
    downscale_to_zero_delay_s=60.0,
)  # fmt: skip


def run(scaler: Autoscaler, work, start: float, end: float, target: int, queued=0, tick=2.0):
    """Tick every ``tick`` seconds, applying each decision at once; returns the decisions."""
    decisions, now = [], start
    while now < end:
        d = scaler.tick(now, work(now), queued, target)
        decisions.append((now, d.desired))
        target = d.desired
        now += tick
    return decisions, target


def test_work_at_an_empty_pool_starts_one_at_once():
    scaler = Autoscaler(CONFIG)
    assert scaler.tick(0.0, 0.0, 0, 0).desired == 0
    d = scaler.tick(2.0, 0.0, 1, 0)  # an invocation queued, nothing running
    assert d.desired == 1 and d.panicking


def test_a_step_in_work_scales_up_within_a_tick_and_counts_starting_executors():
    scaler = Autoscaler(CONFIG)
    _, target = run(scaler, lambda t: 38.0, 0.0, 120.0, 4)  # 4 executors' worth: steady
    assert target == 4 and scaler.decisions == 0
    decisions, target = run(scaler, lambda t: 80.0, 120.0, 140.0, target)
    first_up = next(t for t, n in decisions if n > 4)
    assert first_up - 120.0 <= 2.0
    assert target == 8  # not more: the starting executors count as capacity
    assert scaler.reversals == 0


def test_scale_down_waits_for_the_window_and_never_while_queued():
    scaler = Autoscaler(CONFIG)
    _, target = run(scaler, lambda t: 80.0, 0.0, 100.0, 8)
    decisions, after = run(scaler, lambda t: 20.0, 100.0, 200.0, target, queued=3)
    assert after == 8 and all(n == 8 for _, n in decisions)  # invocations queued: held
    decisions, after = run(scaler, lambda t: 20.0, 200.0, 400.0, after)
    assert after == 2
    assert scaler.reversals == 0  # straight down, no flapping on the way


def test_idle_goes_to_zero_only_after_the_zero_delay_and_never_below_min():
    scaler = Autoscaler(CONFIG)
    _, target = run(scaler, lambda t: 5.0, 0.0, 60.0, 1)
    decisions, target = run(scaler, lambda t: 0.0, 60.0, 400.0, target)
    zero_at = next(t for t, n in decisions if n == 0)
    assert zero_at - 60.0 >= CONFIG.downscale_to_zero_delay_s
    keep_one = Autoscaler(AutoscalingConfig(min_executors=1, max_executors=4, target_s=10.0))
    _, target = run(keep_one, lambda t: 0.0, 0.0, 2000.0, 1)
    assert target == 1


def test_stationary_noisy_load_does_not_flap():
    import random

    rng = random.Random(0)
    scaler = Autoscaler(CONFIG)
    run(scaler, lambda t: rng.uniform(30.0, 50.0), 0.0, 3600.0, 4)
    assert scaler.reversals <= 2


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        AutoscalingConfig(min_executors=3, max_executors=2)
    with pytest.raises(ValueError):
        AutoscalingConfig(target_s=0)
    with pytest.raises(ValueError, match="upscale_hold_s"):
        AutoscalingConfig(upscale_hold_s=-1.0)
    with pytest.raises(ValueError, match="rise_cap"):
        AutoscalingConfig(rise_cap=0.9)
    with pytest.raises(ValueError, match="downscale_margin"):
        AutoscalingConfig(downscale_margin=1.0)


def test_goes_to_zero_when_ticks_land_late():
    """Real ticks are a little late each time; the idle run must still reach the delay."""
    config = AutoscalingConfig(
        min_executors=0, max_executors=2, target_s=1.0, stable_window_s=3.0,
        downscale_delay_s=2.0, downscale_to_zero_delay_s=3.0,
    )  # fmt: skip
    scaler = Autoscaler(config)
    _, target = run(scaler, lambda t: 0.5, 0.0, 10.0, 1, tick=1.003)
    assert target == 1
    decisions, target = run(scaler, lambda t: 0.0, 10.0, 30.0, target, tick=1.003)
    assert target == 0
    zero_at = next(t for t, n in decisions if n == 0)
    assert 10.0 + config.downscale_to_zero_delay_s <= zero_at <= 10.0 + 3 * 3.0


def test_the_pool_merges_its_functions_scaling_tables():
    from retouch.functions.spec import ScalingSpec
    from retouch.platform.fleet.scaler import pool_config

    eager = ScalingSpec(0, 3, target_s=5.0, upscale_delay_s=2.0, downscale_delay_s=60.0)
    patient = ScalingSpec(
        1, 8, target_s=20.0, downscale_to_zero_delay_s=900.0, target_utilisation=0.6
    )
    config = pool_config([eager, patient], capacity=4)
    assert config.target_utilisation == 0.6  # the eagerest keeps the most headroom
    assert (config.min_executors, config.max_executors) == (1, 4)  # capped by the devices
    assert config.target_s == 5.0 and config.panic_window_s == 2.0  # the eagerest grows
    assert config.downscale_delay_s == 600.0  # the most patient shrinks (patient's default)
    assert config.downscale_to_zero_delay_s == 900.0
    assert (config.upscale_hold_s, config.rise_cap, config.downscale_margin) == (0.0, 2.0, 0.0)
    held = ScalingSpec(0, 3, upscale_hold_s=300.0, rise_cap=1.25, downscale_margin=0.2)
    config = pool_config([eager, held], capacity=4)
    assert config.upscale_hold_s == 300.0 and config.downscale_margin == 0.2  # the patient
    assert config.rise_cap == 2.0  # the eagerest grows (eager's default)
    assert pool_config([], capacity=2).max_executors == 2  # nothing deployed: zero
    assert pool_config([], capacity=2).min_executors == 0


def test_a_step_in_arrivals_scales_up_on_demand_before_the_work_piles_up():
    """The work on the pool lags a step in the arrival rate (it grows as invocations pile
    up); the demand (executors' worth of arriving work) shows it in the first tick."""
    scaler = Autoscaler(CONFIG)
    target = 4
    for now in range(0, 120):  # 3 executors' worth arriving, little work held
        target = scaler.tick(float(now), 12.0, 0, target, demand=3.0).desired
    assert target == 4  # 3 / 0.8 = 3.75 -> 4: steady
    d = scaler.tick(120.0, 12.0, 0, target, demand=6.0)  # rate doubled, work not yet
    assert d.desired > 4


def test_no_scale_down_before_a_delay_of_history():
    """A pool that starts (or a gateway that restarts) with executors holds them until it
    has seen a scale-down delay, instead of shrinking on its first samples and growing back
    (a direction reversal)."""
    scaler = Autoscaler(CONFIG)
    d = scaler.tick(0.0, 0.0, 0, 8)
    assert d.desired == 8
    decisions, target = run(scaler, lambda t: 20.0, 2.0, 300.0, 8)
    down_at = next(t for t, n in decisions if n < 8)
    assert down_at >= CONFIG.downscale_to_zero_delay_s
    assert target == 2 and scaler.reversals == 0
    # a delay shorter than the stable window waits for the window: its mean is the load's
    short = AutoscalingConfig(max_executors=16, target_s=10.0, downscale_delay_s=10.0)
    decisions, target = run(Autoscaler(short), lambda t: 20.0, 0.0, 120.0, 8)
    assert next(t for t, n in decisions if n < 8) >= short.stable_window_s
    assert target == 2


def test_target_utilisation_is_checked():
    with pytest.raises(ValueError, match="target_utilisation"):
        AutoscalingConfig(max_executors=2, target_utilisation=0.0)


def test_a_noisy_stationary_demand_does_not_flap():
    """An hour of Poisson-like noise on the demand (6 % per tick): the pool settles and
    makes at most one direction reversal (the tolerance band and the held maximum)."""
    import random

    rng = random.Random(3)
    scaler = Autoscaler(AutoscalingConfig(min_executors=8, max_executors=64, target_s=2.0))
    target = 32
    for now in range(3600):
        demand = 30.0 * (1 + rng.gauss(0.0, 0.06))
        target = scaler.tick(float(now), 40.0, 0, target, demand=demand).desired
    assert scaler.reversals <= 1
    assert 36 <= target <= 50  # 30 / 0.8 = 37.5, plus the noise the held maximum keeps


def test_a_sustained_rise_in_demand_is_seen_within_two_ticks_and_noise_is_not():
    """The demand's CUSUM against the stable window before it: a 2x step scales up within
    two 1 s ticks; an hour of the same noise without a step raises no false rise."""
    import random

    rng = random.Random(5)
    config = AutoscalingConfig(min_executors=4, max_executors=64, downscale_delay_s=120.0)
    scaler = Autoscaler(config)
    target = 20
    for now in range(3600):
        demand = 15.0 * (1 + rng.gauss(0.0, 0.15))
        d = scaler.tick(float(now), 30.0, 0, target, demand=demand)
        assert d.reason != "the arrivals' demand rose and stayed up", now
        target = d.desired
    assert scaler.reversals <= 1
    before = target
    for now in range(3600, 3602):
        target = scaler.tick(
            float(now), 30.0, 0, target, demand=30.0 * (1 + rng.gauss(0, 0.15))
        ).desired
    assert target >= 1.5 * before


def test_square_root_headroom_gives_a_small_pool_relatively_more_room():
    """Square-root staffing: demand / utilisation + k sqrt(demand) executors."""
    plain = Autoscaler(AutoscalingConfig(max_executors=200, target_utilisation=1.0))
    roomy = Autoscaler(
        AutoscalingConfig(max_executors=200, target_utilisation=1.0, headroom_sigmas=2.0)
    )
    assert plain.tick(0.0, 0.0, 0, 0, demand=4.0).desired == 4
    assert roomy.tick(0.0, 0.0, 0, 0, demand=4.0).desired == 8  # 4 + 2 x 2: twice
    big = Autoscaler(
        AutoscalingConfig(max_executors=200, target_utilisation=1.0, headroom_sigmas=2.0)
    )
    assert big.tick(0.0, 0.0, 0, 0, demand=100.0).desired == 120  # 100 + 2 x 10: +20 %
    with pytest.raises(ValueError, match="headroom"):
        AutoscalingConfig(max_executors=2, headroom_sigmas=-1.0)


@pytest.mark.parametrize("rise_cap", [2.0, 1.25])
def test_a_burst_out_of_a_quiet_spell_raises_the_pool_at_most_to_the_rise_cap(rise_cap):
    """A few bursty seconds can average several times the baseline; the CUSUM's rise is
    taken at most to ``rise_cap`` (default 2) x the baseline, the stable window follows a
    real larger one."""
    config = AutoscalingConfig(
        min_executors=1, max_executors=200, target_utilisation=1.0, downscale_delay_s=120.0,
        rise_cap=rise_cap,
    )  # fmt: skip
    scaler = Autoscaler(config)
    target = 10
    for now in range(300):
        target = scaler.tick(float(now), 5.0, 0, target, demand=10.0).desired
    for now in range(300, 304):
        target = scaler.tick(float(now), 5.0, 0, target, demand=40.0).desired
    assert 10 < target <= math.ceil(rise_cap * 10) + 1


def burst_then_calm(config: AutoscalingConfig) -> list[tuple[float, int]]:
    """Four executors' worth of work, a 10 s burst of ten, then four again: the decisions
    from the burst on."""
    scaler = Autoscaler(config)
    _, target = run(scaler, lambda t: 38.0, 0.0, 200.0, 4)
    decisions, _ = run(scaler, lambda t: 100.0 if t < 210.0 else 38.0, 200.0, 600.0, target)
    return decisions


def test_a_scale_up_holds_the_pool_for_the_longer_of_the_delay_and_the_hold():
    """Without a hold the burst's executors go a scale-down delay after it; with one, not
    before the hold has passed since the scale-up (a bursty stream's next burst then finds
    them: no down-and-up again, two reversals)."""
    base = dict(min_executors=1, max_executors=16, target_s=10.0, downscale_delay_s=30.0)
    for hold, shortest, longest in ((0.0, 30.0, 60.0), (120.0, 120.0, 140.0)):
        decisions = burst_then_calm(AutoscalingConfig(**base, upscale_hold_s=hold))
        moves = [(t, n - m) for (_, m), (t, n) in itertools.pairwise(decisions) if n != m]
        last_up = max(t for t, change in moves if change > 0)
        first_down = min(t for t, change in moves if change < 0)
        assert shortest <= first_down - last_up <= longest, (hold, moves)
        assert decisions[-1][1] == 4
    assert AutoscalingConfig(downscale_delay_s=60.0, upscale_hold_s=10.0).hold_s == 60.0


def test_a_scale_down_keeps_its_margin_above_the_held_count():
    base = dict(min_executors=1, max_executors=16, target_s=10.0, downscale_delay_s=30.0)
    assert burst_then_calm(AutoscalingConfig(**base))[-1][1] == 4
    kept = burst_then_calm(AutoscalingConfig(**base, downscale_margin=0.25))
    assert kept[-1][1] == 5  # 4 + 1
    assert max(n for _, n in kept) == 10
    # rounded to the nearest count: a pool holding one comes down to one, not two
    small = Autoscaler(AutoscalingConfig(**base, downscale_margin=0.2))
    _, target = run(small, lambda t: 38.0, 0.0, 100.0, 4)
    _, target = run(small, lambda t: 5.0, 100.0, 300.0, target)
    assert target == 1
    # and never above the maximum (a pool over it after a redeploy lowered it comes down)
    lowered = Autoscaler(AutoscalingConfig(**{**base, "max_executors": 8}, downscale_margin=0.2))
    _, target = run(lowered, lambda t: 78.0, 0.0, 100.0, 12)
    assert target == 8


def test_counted_arrivals_floor_the_noise_and_a_jump_needs_two_ticks():
    """A flat demand of 15 arrivals a tick looks noiseless, but its arrivals are Poisson
    (sigma 3.9): one tick of 23 is noise, not a rise. Then 28 more: two ticks that high
    are a jump (a 2x step's unlucky start), seen on the second tick. Without the counts
    the flat baseline's 5 % floor takes the single tick for a rise."""
    config = AutoscalingConfig(min_executors=4, max_executors=64, downscale_delay_s=120.0)

    def after(ticks: list[float], counted: bool) -> list[int]:
        scaler = Autoscaler(config)
        target, desired = 20, []
        for now in range(200):
            target = scaler.tick(float(now), 30.0, 0, target, 15.0, 15 if counted else 0).desired
        assert target == 20
        for now, d in enumerate(ticks, 200):
            desired.append(
                scaler.tick(float(now), 30.0, 0, target, d, int(d) if counted else 0).desired
            )
        return desired

    assert after([23.0], counted=False)[0] > 20
    first, second = after([23.0, 28.0], counted=True)
    assert first == 20 and second > 20


def test_a_poisson_2x_step_is_seen_within_two_ticks_mostly_and_an_hour_does_not_flap():
    """Arrivals counted, Poisson at 15 a tick: most 2x steps scale up within two ticks
    (the slow CUSUM alone: 17 of these 30); an hour at 30 a tick does not flap."""
    import numpy as np

    rng = np.random.default_rng(7)
    config = AutoscalingConfig(
        min_executors=4, max_executors=200, target_utilisation=0.9, headroom_sigmas=1.5,
        downscale_delay_s=120.0,
    )  # fmt: skip
    seen = 0
    for _ in range(30):
        scaler, target = Autoscaler(config), 24
        counts = np.concatenate([rng.poisson(15.0, 100), rng.poisson(30.0, 2)])
        for now, n in enumerate(counts):
            desired = scaler.tick(float(now), 20.0, 0, target, float(n), int(n)).desired
            if now < 100:
                target = desired
            elif desired > target:
                seen += 1
                break
    assert seen >= 21  # 70 % (the slow CUSUM alone: 17 of these 30)
    scaler, target = Autoscaler(config), 46
    for now, n in enumerate(rng.poisson(30.0, 3600)):
        target = scaler.tick(float(now), 60.0, 0, target, float(n), int(n)).desired
    assert scaler.reversals <= 2


def test_a_scale_down_waits_at_least_the_pools_start_up():
    """Delays of 120 s (down) and 60 s (to zero). The work falls from 8 executors' worth to
    2 at 100 s; the stable window's mean asks for 7 or fewer from 110 s on, so the pool
    comes down after the 120 s delay at 230 s, and with a measured start-up of 300 s at
    410 s. A start-up shorter than the delay (a wake) changes nothing. To zero likewise:
    idle from 100 s, 180 s later, or 360 s with the start-up."""

    def first_below(startup_s: float, target: int, work: float, start: float) -> float:
        scaler = Autoscaler(CONFIG)
        now = 0.0
        while now < start:
            scaler.tick(now, 10.0 * target, 0, target, startup_s=startup_s)
            now += 2.0
        while True:
            d = scaler.tick(now, work, 0, target, startup_s=startup_s)
            if d.desired < target:
                return now - start
            now += 2.0
            assert now < start + 1000.0, "never scaled down"

    assert first_below(0.0, 8, 20.0, 100.0) == 130.0
    assert first_below(3.0, 8, 20.0, 100.0) == 130.0
    assert first_below(300.0, 8, 20.0, 100.0) == 310.0
    assert first_below(0.0, 1, 0.0, 100.0) == 180.0
    assert first_below(300.0, 1, 0.0, 100.0) == 360.0


def test_a_start_up_estimate_that_dips_and_recovers_keeps_its_whole_wait():
    """The estimate moves (a fast start among slow ones, then the median again): the
    history kept for the longest seen still holds the high recommendations, so the pool
    comes down 300 s after the load fell, as with a steady estimate."""
    scaler = Autoscaler(CONFIG)
    now = 0.0
    while now < 100.0:
        scaler.tick(now, 80.0, 0, 8, startup_s=300.0)
        now += 2.0
    while True:
        dip = 150.0 <= now < 250.0
        d = scaler.tick(now, 20.0, 0, 8, startup_s=0.0 if dip else 300.0)
        if d.desired < 8 and not dip:
            break
        now += 2.0
    assert now - 100.0 == 310.0
