"""``retouch bench wake``: an executor woken against the same executor started cold.

Starts a real ``retouch serve --autoscale`` (sleep on) with one function of ``--model``
that scales from zero to one executor with short delays, then, each round:

1. an invocation at the empty pool: the autoscaler starts an executor **cold** (process,
   imports, weights, store, profile: the first round profiles the model, later rounds read
   the cached profile);
2. idle, the pool scales to zero and the executor **sleeps**;
3. an invocation at the pool of one sleeper: it is **woken**;
4. idle again, it sleeps; then it is SIGKILLed and dropped, so that the next round starts
   cold again (the dead-sleeper path, exercised each round).

The gateway's own figures (``/metrics``: ``startup_s_last``, process start to ready;
``wake_s_last``, wake to ready) and each invocation's latency as the client saw it, round by
round in one run. ``wake_vs_cold``: the median wake over the median cold start of the rounds
whose cold start read a cached profile (all rounds when there is one).
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image
from tqdm import tqdm

from retouch.functions.imaging import encode_image
from retouch.functions.modelcheck import model_family
from retouch.functions.models import known_builtin
from retouch.functions.spec import parse_spec
from retouch.platform.api.client import Client
from retouch.platform.api.server import ServerProcess
from retouch.platform.fleet.tls import tls_context

FUNCTION, TEMPLATE = "woken", "t"
WAIT_S = 600.0
SCALING = {  # from zero to one, back to zero after a second or two idle
    "min_executors": 0,
    "max_executors": 1,
    "upscale_delay_s": 1.0,
    "stable_window_s": 1.0,
    "downscale_delay_s": 1.0,
    "downscale_to_zero_delay_s": 1.0,
}


def _metric(server: ServerProcess, quantity: str) -> float:
    text = httpx.get(server.metrics_url, timeout=30, verify=tls_context()).text
    return float(text.split(f'retouch_pool{{quantity="{quantity}"}}')[1].split()[0])


def _rows(client: Client) -> list[dict[str, Any]]:
    return client.executors()["executors"]


def _wait(what: str, ok: Any) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = ok()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"bench wake: no {what} within {WAIT_S:.0f} s")


def _asleep(client: Client) -> int | None:
    """The sleeper's pid once the pool's only executor sleeps."""
    rows = _rows(client)
    if len(rows) == 1 and rows[0]["phase"] == "sleeping" and rows[0]["state"]:
        return rows[0]["state"]["pid"]
    return None


def _invoke(client: Client, mask: np.ndarray, steps: int, seed: int) -> float:
    started = time.perf_counter()
    client.invoke(FUNCTION, TEMPLATE, mask, "a red door", seed=seed, steps=steps, format="raw")
    return time.perf_counter() - started


def run_wake_bench(model: str, rounds: int = 3, steps: int = 4) -> dict[str, Any]:
    size = known_builtin(model).resolution
    spec = parse_spec(
        {
            "name": FUNCTION,
            "model": model,
            "family": model_family(model),
            "resolution": size,
            "steps": steps,
            "scaling": SCALING,
            "templates": {TEMPLATE: {"prompt": "a quiet street", "seed": 1}},
        }
    )
    template = encode_image(Image.new("RGB", (size, size), (90, 120, 150)), "png")
    mask = np.zeros((size, size), bool)
    mask[size // 4 : size // 2, size // 4 : size // 2] = True
    args = [
        "--autoscale",
        "--sleep-keep-s",
        "3600",
        "--invoke-timeout",
        "3600",
        "--queue-timeout",
        "3600",
    ]
    per_round: list[dict[str, float]] = []
    device = ""
    with (
        tempfile.TemporaryDirectory(prefix="retouch-bench-wake-") as tmp,
        ServerProcess(Path(tmp) / "data", extra_args=args) as server,
        Client(server.url, timeout=3600) as client,
    ):
        client.deploy(spec, {TEMPLATE: template})
        for i in tqdm(range(rounds), desc=f"wake {model}", unit="round"):
            cold_invoke = _invoke(client, mask, steps, i)
            cold = _metric(server, "startup_s_last")
            device = _rows(client)[0]["device"]
            _wait("sleeping executor", lambda: _asleep(client))
            woken_invoke = _invoke(client, mask, steps, i)
            woken = _metric(server, "wake_s_last")
            pid = _wait("sleeping executor", lambda: _asleep(client))
            os.kill(pid, signal.SIGKILL)
            _wait("empty pool", lambda: not _rows(client))
            per_round.append(
                {
                    "cold_ready_s": round(cold, 3),
                    "wake_ready_s": round(woken, 3),
                    "cold_invoke_s": round(cold_invoke, 3),
                    "woken_invoke_s": round(woken_invoke, 3),
                }
            )
    cached = per_round[1:] or per_round  # the first cold start profiled the model
    cold_s = round(statistics.median(r["cold_ready_s"] for r in cached), 4)
    wake_s = round(statistics.median(r["wake_ready_s"] for r in cached), 4)
    return {
        "model": model,
        "device": device,
        "rounds": rounds,
        "steps": steps,
        "first_cold_ready_s": per_round[0]["cold_ready_s"],
        "cold_ready_s": cold_s,
        "wake_ready_s": wake_s,
        "wake_vs_cold": round(wake_s / cold_s, 4) if cold_s else None,
        "cold_invoke_s": round(statistics.median(r["cold_invoke_s"] for r in cached), 3),
        "woken_invoke_s": round(statistics.median(r["woken_invoke_s"] for r in cached), 3),
        "per_round": per_round,
    }
