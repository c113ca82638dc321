"""Served edits with graphs: every edit brings its own mask, and the graphs stay few.

A real server with ``--cuda-graphs`` on a CPU (the graph runner's bookkeeping, replays run
eagerly on the static buffers) and a device tier (CPU memory standing for the GPU's, so
templates become resident): 80 edits with random masks over three templates, at batch
sizes 1-4 formed by concurrent clients. Keyed by mask, each edit would have captured its
own layouts; bucketed, the layouts are at most buckets × batch sizes, all captured at the
executor's warm-up; each answer says which path it took and why."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from retouch.functions.demo.images import mask_of_ratio
from retouch.platform.api.client import Client
from retouch.platform.api.server import ServerProcess
from retouch.platform.lab.bench.load import wait_baked
from retouch.runtime.maskaware.buckets import Buckets
from tests.support import wait_for

EDITS = 80
MAX_BATCH = 4
TEMPLATES = ("shirt", "mug", "poster")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, examples: Path):
    spec = (examples / "tiny-flux.toml").read_text()
    spec = spec.replace("latency_ms = 30000", "latency_ms = 600000")  # admit all: no 429s
    spec = spec.replace("max_executors = 2", "max_executors = 1")  # one executor's counters
    spec = spec.replace("templates/", f"{examples / 'templates'}/")
    spec += (
        f'\n[templates.poster]\nimage = "{examples / "templates" / "poster.png"}"\n'
        'prompt = "a poster on a wall"\nseed = 23\n'
    )
    path = tmp_path_factory.mktemp("spec") / "tiny-flux.toml"
    path.write_text(spec)
    # On a CPU a tiny model's sparse and stock steps are within noise of each other: the
    # path is pinned so that the edits exercise the graphs (tests/runtime/test_pathchoice.py
    # checks the choice itself)
    args = [
        "--path-choice",
        "maskaware",
        "--cuda-graphs",
        "--device-cache-bytes",
        "200000000",
        "--max-batch",
        str(MAX_BATCH),
    ]
    data = tmp_path_factory.mktemp("graphs")
    with ServerProcess(data, extra_args=args) as server, Client(server.url) as client:
        client.deploy_file(path)
        wait_baked(client, "tiny-flux")
        yield server


def engine(client: Client) -> dict:
    return client.executors()["executors"][0]["state"]["engine"]


def test_served_random_masks_share_few_graph_layouts(server: ServerProcess) -> None:
    rng = np.random.default_rng(3)
    ratios = rng.beta(2, 8, EDITS).clip(0.03, 0.9)
    with Client(server.url) as client:
        for template in TEMPLATES:  # a first read promotes each template to the device tier
            client.invoke("tiny-flux", template, mask_of_ratio((128, 128), 0.2), "a hat")
        wait_for(
            "every template in the device tier",
            lambda: (
                client.executors()["executors"][0]["state"]["cache"].get("device_templates")
                == len(TEMPLATES)
            ),
            60,
            detail=lambda: client.executors()["executors"][0]["state"]["cache"],
        )
        before = engine(client)

        def edit(i: int):
            mask = mask_of_ratio((128, 128), float(ratios[i]), "ellipse", seed=100 + i)
            return client.invoke("tiny-flux", TEMPLATES[i % 3], mask, "a green hat", seed=i)

        with ThreadPoolExecutor(2 * MAX_BATCH) as pool:
            results = list(pool.map(edit, range(EDITS)))
        after = engine(client)
    assert Counter(r.path for r in results) == {"maskaware": EDITS}
    assert {r.path_reason for r in results} == {"mask-aware: --path-choice maskaware"}
    sizes = {b for r in results for b in r.engine.batch_sizes}
    assert max(sizes) > 1  # concurrent clients made batches
    layouts = after["graph_layouts"]
    sizes_run = Buckets.for_batches(MAX_BATCH).batch_sizes  # 1, 2, 4: a batch of 3 runs as 4
    assert 0 < layouts <= (Buckets().levels + 1) * len(sizes_run)  # mask-aware buckets, stock
    assert after["graph_replays"] - before["graph_replays"] > EDITS  # most steps replayed
    # every layout was captured at warm-up, before the first edit: none on the request path
    assert after["graph_request_captures"] == before["graph_request_captures"] == 0
    assert after["graph_captures"] > 0 and after["graph_bytes"] > 0
    assert after["padded_tokens"] > before["padded_tokens"]


def test_predictions_use_the_replays_warm_up_timed(server: ServerProcess) -> None:
    """The cost model the gateway predicts from holds the step times warm-up measured per
    layout (not the profile's plans), one row per batch size up to ``max_batch``."""
    with Client(server.url) as client:
        state = client.executors()["executors"][0]["state"]
    (model,) = state["cost_models"].values()
    extra = model["extra"]
    assert extra["step_source"] == "graph replays"
    table = extra["step_table"]
    assert len(table) == MAX_BATCH and table[2] == table[3]  # three requests run as four
    assert all(t > 0 for row in table for t in row)
    assert extra["resident_step_table"] == table
