"""``retouch bench wire``: what decoding one invocation costs the gateway.

The body a client sends (msgpack: a template, a mask of ``size_mb`` megabytes, a prompt and
the usual arguments) is decoded and validated the way the gateway does it (``unpack`` then
``InvokeRequest.from_wire``), ``repeats`` times in a fresh process, and the median taken.
With ``baseline`` (another checkout of retouch, e.g. a worktree of an older commit) the same
is measured for that checkout's code, rounds alternating between the two so both see the
same noise; ``ratio`` is this tree's median over the baseline's, per round.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from retouch.platform.lab.bench.gateway import importable_checkout

# Runs in the measured process; it imports only what every version of the wire has had.
PROBE = """
import json, os, statistics, sys, time
try:
    from retouch.functions.wire.codec import pack, unpack
    from retouch.functions.wire.invoke import InvokeRequest
except ImportError:  # a checkout from before the wire was split by concept
    from retouch.functions.wire import InvokeRequest, pack, unpack
import retouch

size, repeats = int(sys.argv[1]), int(sys.argv[2])
body = pack({
    "template": "shirt", "mask": os.urandom(size), "prompt": "a red hat on the person",
    "seed": 7, "num_inference_steps": 20, "guidance_scale": 7.5, "strength": 0.8,
    "format": "png",
})
times = []
for _ in range(repeats):
    t0 = time.perf_counter()
    InvokeRequest.from_wire(unpack(body))
    times.append(time.perf_counter() - t0)
print(json.dumps({"us": statistics.median(times) * 1e6, "package": retouch.__path__[0]}))
"""


def run_wire_bench(
    size_mb: float = 1.0, repeats: int = 300, rounds: int = 5, baseline: Path | None = None
) -> dict[str, Any]:
    size = int(size_mb * 2**20)
    trees: dict[str, dict[str, str]] = {"this": {}}
    with tempfile.TemporaryDirectory(prefix="retouch-bench-wire-") as tmp:
        if baseline is not None:
            trees["baseline"] = {"PYTHONPATH": str(importable_checkout(baseline, Path(tmp)))}
        medians: dict[str, list[float]] = {name: [] for name in trees}
        packages: dict[str, str] = {}
        for _ in tqdm(range(rounds), desc="wire decode", unit="round"):
            for name, env in trees.items():
                figures = _probe(size, repeats, env)
                medians[name].append(figures["us"])
                packages[name] = figures["package"]
    out: dict[str, Any] = {"body_bytes": size, "repeats": repeats, "rounds": rounds}
    for name, series in medians.items():
        out[name] = {
            "decode_us_p50": round(statistics.median(series), 1),
            "decode_us_rounds": [round(x, 1) for x in series],
            "package": packages[name],
        }
    if baseline is not None:
        ratios = [a / b for a, b in zip(medians["this"], medians["baseline"], strict=True)]
        out["ratio_rounds"] = [round(x, 3) for x in ratios]
        out["ratio_median"] = round(statistics.median(ratios), 3)
    return out


def _probe(size: int, repeats: int, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(size), str(repeats)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the decode probe failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
