"""Continuous vs static step-level batching on a device where a step costs the sum of its
requests' costs (a CPU: batching buys no throughput), as a queueing simulation.

Why it exists: ``retouch bench load --model retouch:small-flux --compare continuous,static``
measures the two engines on this 2-core machine; this script shows what queueing theory
predicts for the same workload, so the measured ratio can be read against it (see
docs/benchmarks.md, "Load"). Run: ``python docs/sim/batching.py``. Standard library + numpy.

Per-step cost of one request with mask ratio r: ``FIXED + PER_RATIO * r`` seconds, fitted to
the small-flux rows of ``retouch bench engine`` (batch 1, 4 steps); ``flat`` models a GPU,
where a step of b requests costs about as much as the largest one (up to max_batch).
"""

from __future__ import annotations

import numpy as np

STEPS = 4
FIXED, PER_RATIO = 0.22, 3.9  # s per step: 1.90 s at mask 0.05, 3.83 at 0.2, 16.5 at 1.0
MASK_MEAN, CONCENTRATION = 0.19, 4.0  # the load bench's beta (FlashPS public trace)


def workload(n: int, rate: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    at = np.cumsum(rng.exponential(1.0 / rate, n))
    a, b = MASK_MEAN * CONCENTRATION, (1 - MASK_MEAN) * CONCENTRATION
    return at - at[0], np.clip(rng.beta(a, b, n), 0.01, 1.0)


def step_time(ratios: list[float], device: str) -> float:
    costs = [FIXED + PER_RATIO * r for r in ratios]
    return sum(costs) if device == "linear" else max(costs)


def simulate(at: np.ndarray, ratios: np.ndarray, mode: str, max_batch: int, device: str):
    """Latencies of every request; ``continuous`` admits between steps, ``static`` only
    when the running batch has finished."""
    t, nxt, queue, left = 0.0, 0, [], {}
    done = np.zeros(len(at))
    while nxt < len(at) or queue or left:
        while nxt < len(at) and at[nxt] <= t:
            queue.append(nxt)
            nxt += 1
        if mode == "continuous" or not left:
            while queue and len(left) < max_batch:
                left[queue.pop(0)] = STEPS
        if not left:
            t = at[nxt]
            continue
        t += step_time([ratios[j] for j in left], device)
        for j in list(left):
            left[j] -= 1
            if not left[j]:
                del left[j]
                done[j] = t
    return done - at


def capacity(device: str, max_batch: int) -> float:
    """Invocations/s with max_batch requests always running (the bench's closed loop)."""
    ratios = workload(20000, 1.0, 1)[1]
    groups = ratios[: len(ratios) // max_batch * max_batch].reshape(-1, max_batch)
    per_batch = np.mean([step_time(list(g), device) for g in groups]) * STEPS
    return max_batch / per_batch


def main() -> None:
    for device in ("linear", "flat"):
        for load in (0.5, 0.7, 0.9):
            rate = load * capacity(device, 8)
            p95 = {}
            for mode in ("continuous", "static"):
                runs = [simulate(*workload(44, rate, s), mode, 8, device) for s in range(300)]
                p95[mode] = float(np.mean([np.percentile(r, 95) for r in runs]))
            print(
                f"{device:>6} step cost, load {load}: P95 continuous {p95['continuous']:6.1f} s,"
                f" static {p95['static']:6.1f} s, ratio {p95['continuous'] / p95['static']:.2f}"
            )


if __name__ == "__main__":
    main()
