"""``retouch bench deploy``: a deployed function's latency while another model deploys.

Starts a real ``retouch serve`` with a fresh shared folder (so the second model is really
loaded *and* profiled, nothing comes from a cache), deploys a first function and measures
its invocations undisturbed, then while a second function on another model deploys (model
load, worker loads, device profile), then undisturbed again — one run, same requests.
The figure of merit is the ratio of the p50 during the deploy to the undisturbed p50.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from retouch.functions.demo.images import mask_of_ratio
from retouch.platform.api.client import Client, read_spec_file
from retouch.platform.api.server import ServerProcess

SERVED, DEPLOYED = "tiny-sd.toml", "tiny-flux.toml"


def _timed_invoke(client: Client, seed: int, steps: int) -> float:
    mask = mask_of_ratio((128, 128), 0.2, "ellipse", 1)
    t0 = time.perf_counter()
    client.invoke("tiny-sd", "street", mask, "a red door", seed=seed, steps=steps)
    return (time.perf_counter() - t0) * 1e3


def _phase(client: Client, count: int, steps: int, desc: str) -> list[float]:
    return [_timed_invoke(client, i, steps) for i in tqdm(range(count), desc=desc, unit="req")]


def run_deploy_bench(examples: Path, requests: int = 12, steps: int = 10) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="retouch-bench-deploy-") as tmp:
        env = {"RETOUCH_SHARED_DIR": str(Path(tmp) / "shared")}
        with (
            ServerProcess(Path(tmp) / "data", env={**os.environ, **env}) as server,
            Client(server.url) as client,
        ):
            client.deploy_file(examples / SERVED)
            _phase(client, 3, steps, "warm up")
            before = _phase(client, requests, steps, "undisturbed")
            spec, images = read_spec_file(examples / DEPLOYED)
            spec = dataclasses.replace(spec, name="second-model")
            deploy_s: list[float] = []

            def deploy() -> None:
                t0 = time.perf_counter()
                with Client(server.url) as admin:
                    admin.deploy(spec, images)
                deploy_s.append(time.perf_counter() - t0)

            thread = threading.Thread(target=deploy)
            thread.start()
            during: list[float] = []
            with tqdm(desc="during the deploy", unit="req") as bar:
                while thread.is_alive():
                    during.append(_timed_invoke(client, len(during), steps))
                    bar.update()
            thread.join()
            after = _phase(client, requests, steps, "undisturbed again")
    undisturbed = before + after
    p50_before, p50_during = statistics.median(undisturbed), statistics.median(during)
    return {
        "served": SERVED,
        "deployed": DEPLOYED,
        "steps": steps,
        "second_deploy_s": round(deploy_s[0], 1) if deploy_s else None,
        "undisturbed_requests": len(undisturbed),
        "during_requests": len(during),
        "undisturbed_p50_ms": round(p50_before, 1),
        "during_p50_ms": round(p50_during, 1),
        "p50_ratio": round(p50_during / p50_before, 3),
    }
