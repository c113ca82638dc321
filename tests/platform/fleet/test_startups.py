"""The fleet's measured start-ups (``platform/fleet/startups.py``): the least a model
pool's scale-down waits."""

from __future__ import annotations

from retouch.platform.fleet.startups import StartupTimes


def test_a_pool_is_estimated_by_its_own_starts_then_everyones_then_zero() -> None:
    times = StartupTimes()
    assert times.estimate_s("sd", woken=False) == 0.0  # nothing measured: not weighed
    times.started("flux", 40.0)
    assert times.estimate_s("sd", woken=False) == 40.0  # another pool's, on these machines
    for seconds in (9.0, 30.0, 10.0):
        times.started("sd", seconds)
    assert times.estimate_s("sd", woken=False) == 10.0  # its own median
    assert times.estimate_s("flux", woken=False) == 40.0


def test_an_executor_woken_from_sleep_is_estimated_by_wakes() -> None:
    times = StartupTimes()
    times.started("sd", 60.0)
    assert times.estimate_s("sd", woken=True) == 0.0  # no wake measured yet
    times.woke("flux", 4.0)
    times.woke("sd", 2.0)
    times.woke("sd", 3.0)
    assert times.estimate_s("sd", woken=True) == 2.5
    assert times.estimate_s("sd", woken=False) == 60.0
    assert list(times.cold) == [60.0] and list(times.wakes) == [4.0, 2.0, 3.0]
