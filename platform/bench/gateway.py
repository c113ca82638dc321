"""``retouch bench gateway``: what the gateway adds to an invocation.

Starts a real ``retouch serve``, deploys the tiny Flux example and measures, per invocation,
the gateway's own time (total at the gateway minus executor queue and run) and the client's
round trip, for template-only invocations (no model run) and 20 % edits.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from retouch.functions.demo.images import mask_of_ratio
from retouch.platform.client import Client
from retouch.platform.server import ServerProcess


def run_gateway_bench(examples: Path, requests: int = 50, steps: int = 2) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="retouch-bench-") as tmp,
        ServerProcess(Path(tmp)) as server,
        Client(server.url) as client,
    ):
        client.deploy_file(examples / "tiny-flux.toml")
        cases = {
            "empty_mask": np.zeros((128, 128), bool),
            "mask_0.2": mask_of_ratio((128, 128), 0.2, "ellipse", 1),
        }
        out: dict[str, Any] = {"requests": requests}
        for case, mask in cases.items():
            client.invoke("tiny-flux", "shirt", mask, "warm up", steps=steps)
            overhead, outside_run, round_trip = [], [], []
            for i in tqdm(range(requests), desc=f"gateway {case}", unit="req"):
                t0 = time.perf_counter()
                result = client.invoke("tiny-flux", "shirt", mask, "a hat", seed=i, steps=steps)
                round_trip.append((time.perf_counter() - t0) * 1e3)
                t = result.timings
                overhead.append(t.total_ms - t.run_ms - t.queue_ms)
                outside_run.append(t.total_ms - t.run_ms)
            out[case] = {
                "gateway_overhead_ms_p50": statistics.median(overhead),
                "gateway_overhead_ms_p95": float(np.percentile(overhead, 95)),
                "total_minus_run_ms_p50": statistics.median(outside_run),
                "client_round_trip_ms_p50": statistics.median(round_trip),
            }
        return out
