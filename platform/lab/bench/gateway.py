"""``retouch bench gateway``: what the gateway adds to an invocation.

Starts real ``retouch serve`` processes, deploys the tiny Flux example and measures, per
invocation, the gateway's own time (total at the gateway minus executor queue and run) and
the client's round trip, for template-only invocations (no model run) and 20 % edits.

Two gateways run side by side, requests alternating between them: ``control_on`` (the
default: ``maskaware`` placement with SLO admission, the example has an SLO) and
``control_off`` (``least-requests``, ``--no-admission``). Each is measured quiet and while
other clients keep large (1024 x 1024) masks arriving, whose decoding and summarising must
not stall the gateway's event loop for the small invocation measured.

With ``ray=True`` a third gateway, ``ray`` (control on, ``--provider ray``), runs beside them
with its executor under a Ray actor on a one-node Ray cluster started for the run: the Ray
path's extra overhead is ``ray`` minus ``control_on``, measured in the same run.

With ``baseline`` (another checkout of retouch, e.g. a worktree of an older commit) a
``baseline`` gateway, control on, runs that checkout's code beside them: the same requests
alternate over it, so ``control_on`` against ``baseline`` compares two versions of the code
under the same noise (``vs_baseline``: the ratio of their p50 overheads, per round).
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from retouch.functions.demo.images import mask_of_ratio, template_image
from retouch.functions.imaging import encode_image, encode_mask
from retouch.functions.models import builtin_model
from retouch.functions.spec import parse_spec
from retouch.platform.api.client import Client
from retouch.platform.api.server import ServerProcess
from retouch.platform.lab.bench.load import wait_baked

CONFIGS = {"control_on": [], "control_off": ["--placement", "least-requests", "--no-admission"]}
# One torch thread per executor in every gateway: the Ray provider's default is 1, the local
# provider's the machine's cores, and an executor with more threads answers the large-mask
# load faster, which would show as less gateway overhead (measured: 1.8 s vs 0.2 s p50).
THREADS = ["--threads", "1"]
BIG = 1024  # pixels of the large-mask function (the same tiny model)
BIG_SENDERS = 4  # large-mask invocations kept in flight during the "busy" condition
CONDITIONS = ("quiet", "large_masks")


def run_gateway_bench(
    examples: Path,
    requests: int = 50,
    steps: int = 2,
    ray: bool = False,
    baseline: Path | None = None,
    rounds: int = 1,
    conditions: tuple[str, ...] = CONDITIONS,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="retouch-bench-") as tmp, ExitStack() as stack:
        configs = {name: [*args, *THREADS] for name, args in CONFIGS.items()}
        started: dict[str, dict[str, Any]] = {}  # how a config's server starts, if not as ours
        if ray:
            address = stack.enter_context(ray_cluster(1))
            configs["ray"] = ["--provider", "ray", "--ray-address", address, *THREADS]
        if baseline is not None:
            configs["baseline"] = list(THREADS)
            started["baseline"] = {
                "env": {"PYTHONPATH": str(importable_checkout(baseline, Path(tmp)))},
                "entry": cli_module(baseline),
            }
        clients = {}
        for name, args in configs.items():
            server = ServerProcess(Path(tmp) / name, extra_args=args, **started.get(name, {}))
            stack.enter_context(server)
            client = stack.enter_context(Client(server.url))
            client.deploy_file(examples / "tiny-flux.toml")
            client.deploy(*_big_function())
            clients[name] = client
        for client in clients.values():
            _settled(client)
        cases = {
            "empty_mask": np.zeros((128, 128), bool),
            "mask_0.2": mask_of_ratio((128, 128), 0.2, "ellipse", 1),
        }
        out: dict[str, Any] = {"requests": requests, "rounds": rounds}
        for r in range(rounds):
            for condition in conditions:
                for case, mask in cases.items():
                    label = f"{condition} {case}" + (f" round {r + 1}" if rounds > 1 else "")
                    with _large_masks(clients, condition == "large_masks"):
                        figures = _measure(clients, mask, requests, steps, label)
                    for name, row in figures.items():
                        cell = out.setdefault(name, {}).setdefault(condition, {})
                        cell[case] = _merged(cell.get(case), row)
        if baseline is not None:
            out["vs_baseline"] = _versus(out["control_on"], out["baseline"])
        return out


def importable_checkout(checkout: Path, tmp: Path) -> Path:
    """A folder whose ``retouch`` is ``checkout`` (the repository root is the package), for
    PYTHONPATH: it comes before this install's own ``retouch``."""
    if not (checkout / "platform").is_dir() or not (checkout / "functions").is_dir():
        raise ValueError(f"{checkout} is not a checkout of retouch")
    folder = tmp / "baseline-path"
    folder.mkdir()
    (folder / "retouch").symlink_to(checkout.resolve())
    return folder


def cli_module(checkout: Path) -> str:
    """The ``retouch`` command's module in ``checkout`` (a package of command groups, or in
    older checkouts one module)."""
    return (
        "retouch.platform.cli.main"
        if (checkout / "platform" / "cli" / "main.py").is_file()
        else "retouch.platform.cli"
    )


def _merged(before: dict[str, Any] | None, row: dict[str, float]) -> dict[str, Any]:
    """Each round's figures appended (``..._rounds``); the plain keys are their medians."""
    merged: dict[str, Any] = {}
    for key, value in row.items():
        series = [*(before or {}).get(f"{key}_rounds", []), value]
        merged[key] = statistics.median(series)
        merged[f"{key}_rounds"] = series
    return merged


def _versus(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """``control_on`` p50 overhead over ``baseline``'s, round by round, and their median."""
    out: dict[str, Any] = {}
    for condition, cases in new.items():
        for case, row in cases.items():
            key = "gateway_overhead_ms_p50_rounds"
            ratios = [a / b for a, b in zip(row[key], old[condition][case][key], strict=True)]
            out.setdefault(condition, {})[case] = {
                "p50_ratio_rounds": [round(x, 3) for x in ratios],
                "p50_ratio_median": round(statistics.median(ratios), 3),
            }
    return out


@contextmanager
def ray_cluster(nodes: int) -> Iterator[str]:
    """A Ray cluster of ``nodes`` nodes on this machine (``ray.cluster_utils.Cluster``), one
    executor slot each; yields its address."""
    from ray.cluster_utils import Cluster

    from retouch.platform.fleet.rayprovider import RESOURCE

    slot = {"num_cpus": 1, "resources": {RESOURCE: 1}}
    cluster = Cluster(initialize_head=True, head_node_args={**slot, "include_dashboard": False})
    for _ in range(nodes - 1):
        cluster.add_node(**slot)
    cluster.wait_for_nodes()
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


def _settled(client: Client, timeout: float = 600.0) -> None:
    """Wait until both functions are baked and no executor is loading or profiling a
    model: a 1024-pixel bake running beside the "quiet" measurement once added ~2 ms."""
    for function in ("tiny-flux", "big"):
        wait_baked(client, function, timeout)
    deadline = time.monotonic() + timeout
    while any((e.get("state") or {}).get("loading") for e in client.executors()["executors"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"executors still loading after {timeout:.0f} s")
        time.sleep(0.5)


def _measure(
    clients: dict[str, Client], mask: np.ndarray, requests: int, steps: int, label: str
) -> dict[str, dict[str, float]]:
    """Small invocations alternating between the gateways (same noise for all), in an
    order that rotates every request."""
    samples: dict[str, dict[str, list[float]]] = {
        name: {"overhead": [], "outside": [], "round": []} for name in clients
    }
    for client in clients.values():
        client.invoke("tiny-flux", "shirt", mask, "warm up", steps=steps)
    names = list(clients)
    for i in tqdm(range(requests), desc=f"gateway {label}", unit="req"):
        # each gateway first in turn: the one measured right after another's invocation
        # shares the machine with that one's tail (its executor's change feed, logging)
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            client = clients[name]
            t0 = time.perf_counter()
            result = client.invoke("tiny-flux", "shirt", mask, "a hat", seed=i, steps=steps)
            s = samples[name]
            s["round"].append((time.perf_counter() - t0) * 1e3)
            t = result.timings
            s["overhead"].append(t.total_ms - t.run_ms - t.queue_ms)
            s["outside"].append(t.total_ms - t.run_ms)
    return {
        name: {
            "gateway_overhead_ms_p50": statistics.median(s["overhead"]),
            "gateway_overhead_ms_p95": float(np.percentile(s["overhead"], 95)),
            "total_minus_run_ms_p50": statistics.median(s["outside"]),
            "client_round_trip_ms_p50": statistics.median(s["round"]),
        }
        for name, s in samples.items()
    }


def _big_function():
    model = "retouch:tiny-flux"
    doc = {
        "name": "big",
        "model": model,
        "family": builtin_model(model).family,
        "resolution": BIG,
        "steps": 2,
        "templates": {"t": {"prompt": "a large scene", "seed": 3}},
    }
    return parse_spec(doc), {"t": encode_image(template_image((BIG, BIG), 7), "png")}


class _large_masks:
    """While active, clients keep large empty-mask invocations arriving at both gateways
    (the gateway decodes and summarises each; the executor answers with the template)."""

    def __init__(self, clients: dict[str, Client], active: bool) -> None:
        self.urls = [c.url for c in clients.values()] if active else []
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.mask = encode_mask(np.zeros((BIG, BIG), bool))

    def __enter__(self) -> None:
        for url in self.urls:
            for _ in range(BIG_SENDERS // 2 or 1):
                thread = threading.Thread(target=self._send, args=(url,), daemon=True)
                thread.start()
                self.threads.append(thread)

    def _send(self, url: str) -> None:
        with Client(url) as client:
            while not self.stop.is_set():
                client.invoke("big", "t", self.mask, "nothing", steps=2)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)
