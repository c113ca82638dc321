"""Mask-aware serving over HTTP on the activation store: bake on deploy, read from the disk
tier after an executor restart without re-baking, recover from a corrupt value, and serve
three templates through a host budget smaller than two of them."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import lmdb
import numpy as np
import pytest

from retouch.cachestore.layout import MANIFEST_DB, VALUES_DB, store_path, value_key
from retouch.cachestore.manifest import Manifest
from retouch.functions.demo.images import mask_of_ratio
from retouch.platform.api.client import Client
from retouch.platform.api.server import ServerProcess
from retouch.platform.lab.bench.load import wait_baked
from tests.support import wait_for

MASK = mask_of_ratio((128, 128), 0.2, "ellipse", seed=4)


def executor_state(client: Client) -> dict:
    return client.executors()["executors"][0]["state"]


@pytest.fixture(scope="module")
def baked(
    tmp_path_factory: pytest.TempPathFactory, examples: Path
) -> Iterator[tuple[ServerProcess, Path]]:
    """A server with tiny-flux deployed and baked, and its data directory (the corrupt
    value test stops it and starts another on the same store)."""
    data = tmp_path_factory.mktemp("baked")
    with ServerProcess(data) as server, Client(server.url) as client:
        client.deploy_file(examples / "tiny-flux.toml")
        wait_baked(client, "tiny-flux")
        yield server, data


def test_baked_template_served_from_disk_after_executor_restart(
    baked: tuple[ServerProcess, Path],
) -> None:
    server, _ = baked
    with Client(server.url) as client:
        first = client.invoke("tiny-flux", "shirt", MASK, "a green hat", seed=1)
        assert first.path == "maskaware" and first.cache.tier == "host"
        assert first.cache.found == "host"  # a placement hit: nothing to load

        old = executor_state(client)
        assert old["cache"]["bakes"] == 2
        os.kill(old["pid"], signal.SIGKILL)  # the pool restarts it and re-pushes functions
        wait_for("the executor restarted with its functions", lambda: (
            (state := client.executors()["executors"][0])["healthy"]
            and state["state"]
            and state["state"]["pid"] != old["pid"]
            and "tiny-flux" in state["functions"]
        ), 120)  # fmt: skip

        again = client.invoke("tiny-flux", "shirt", MASK, "a green hat", seed=1)
        assert again.path == "maskaware"
        assert again.cache.tier in ("disk", "host")  # host if the prefetch finished first
        assert again.cache.found == "disk"  # on arrival it was on disk only: a load
        new = executor_state(client)
        assert new["cache"]["bakes"] == 0  # nothing re-baked: it came from the disk tier
        assert new["cache"]["loads"] >= 1 and new["cache"]["disk_bytes_read"] > 0
        assert new["templates"]["tiny-flux"]["shirt"]["state"] == "baked"
        assert np.frombuffer(again.image, np.uint8).size and again.image == first.image


def _corrupt_one_value(path: Path, key: str) -> None:
    """Flip one byte of one stored tensor of ``key`` through a raw LMDB transaction."""
    env = lmdb.open(str(path), max_dbs=8, map_size=1 << 40)
    with env.begin(write=True) as txn:
        manifest = Manifest.unpack(txn.get(key.encode(), db=env.open_db(MANIFEST_DB, txn=txn)))
        entry = next(e for e in manifest.entries if e.step == 0 and e.name == "k")
        values = env.open_db(VALUES_DB, txn=txn)
        vkey = value_key(manifest.gen, entry.step, entry.block, entry.name)
        bad = bytearray(txn.get(vkey, db=values))
        bad[len(bad) // 2] ^= 0xFF
        txn.put(vkey, bytes(bad), db=values)
    env.close()


def test_corrupt_value_is_detected_and_rebaked(baked: tuple[ServerProcess, Path]) -> None:
    server, data = baked
    with Client(server.url) as client:
        key = executor_state(client)["templates"]["tiny-flux"]["mug"]["key"]
        reference = client.invoke("tiny-flux", "mug", MASK, "a red mug", seed=3, format="raw")
        assert reference.path == "maskaware"
    server.stop()

    _corrupt_one_value(store_path(data), key)

    with ServerProcess(data) as server, Client(server.url) as client:
        client.wait_ready("tiny-flux")
        result = client.invoke("tiny-flux", "mug", MASK, "a red mug", seed=3, format="raw")
        assert result.path == "stock"  # the corrupt template is not used ...
        assert result.width == 128 and len(result.image) == 128 * 128 * 3
        wait_baked(client, "tiny-flux")  # ... and it is baked again
        state = executor_state(client)
        assert (
            state["cache"]["corrupt"] == 1 and state["templates"]["tiny-flux"]["mug"]["bakes"] == 1
        )
        rebaked = client.invoke("tiny-flux", "mug", MASK, "a red mug", seed=3, format="raw")
        assert rebaked.path == "maskaware"
        assert rebaked.image == reference.image  # same inputs, same bake: the same edit


def test_host_budget_below_two_templates_spills_and_reloads(tmp_path: Path, examples: Path) -> None:
    data = tmp_path / "data"
    # A tiny-sd template bakes to ~16 MB (4 steps), a tiny-flux one to ~1 MB: a 24 MB host
    # tier holds one tiny-sd template at a time.
    budget = 24 << 20
    with (
        ServerProcess(data, extra_args=["--host-cache-bytes", str(budget)]) as server,
        Client(server.url) as client,
    ):
        client.deploy_file(examples / "tiny-sd.toml")
        client.deploy_file(examples / "tiny-flux.toml")
        wait_baked(client, "tiny-sd")
        wait_baked(client, "tiny-flux")
        order = [("tiny-sd", "street"), ("tiny-sd", "poster"), ("tiny-flux", "shirt")] * 3
        before = executor_state(client)["cache"]
        paths = [client.invoke(f, t, MASK, "a kite", seed=i).path for i, (f, t) in enumerate(order)]
        assert paths == ["maskaware"] * len(order)
        cache = executor_state(client)["cache"]
        assert (
            cache["host_evictions"] - before["host_evictions"] >= 4
        )  # street and poster evict each other
        assert cache["loads"] - before["loads"] >= 4  # ... and are reloaded from the disk tier
        assert cache["disk_bytes_read"] > before["disk_bytes_read"]
        assert cache["host_bytes"] <= budget


@pytest.fixture(scope="module")
def tiered(tmp_path_factory: pytest.TempPathFactory, examples: Path) -> Iterator[ServerProcess]:
    """A server with a device tier (here CPU memory standing for the GPU's), tiny-flux
    and an fp8 copy of it deployed and baked."""
    spec = (examples / "tiny-flux.toml").read_text().replace('"tiny-flux"', '"tiny-flux-fp8"')
    spec = spec.replace("templates/", f"{examples / 'templates'}/")
    spec_path = tmp_path_factory.mktemp("fp8") / "fp8.toml"
    spec_path.write_text(spec.replace("[scaling]", 'storage = "fp8"\n\n[scaling]', 1))
    data = tmp_path_factory.mktemp("tiered")
    args = ["--device-cache-bytes", "200000000"]
    with ServerProcess(data, extra_args=args) as server, Client(server.url) as client:
        client.deploy_file(examples / "tiny-flux.toml")
        client.deploy_file(spec_path)
        wait_baked(client, "tiny-flux")
        wait_baked(client, "tiny-flux-fp8")
        yield server


def test_hot_template_served_from_the_device_tier(tiered: ServerProcess) -> None:
    """An executor with a device tier (here CPU memory standing for the GPU's) promotes a
    template after its first host-tier read; later edits read it device-resident, the same
    edit giving the same pixels each time, and the executor reports the tier's occupancy.
    (A host-tier and a device-tier edit may differ slightly: rows that need a load can make
    the bubble-free plan compute other blocks in full, by the timings profiled at deploy.)"""
    with Client(tiered.url) as client:
        first = client.invoke("tiny-flux", "shirt", MASK, "a green hat", seed=1)
        assert first.path == "maskaware" and first.cache.tier == "host"
        wait_for(
            "a template in the device tier",
            lambda: executor_state(client)["cache"].get("device_templates", 0) >= 1,
            60,
            detail=lambda: executor_state(client)["cache"],
        )
        again = client.invoke("tiny-flux", "shirt", MASK, "a green hat", seed=1)
        assert again.path == "maskaware" and again.cache.tier == "device"
        third = client.invoke("tiny-flux", "shirt", MASK, "a green hat", seed=1)
        assert third.cache.tier == "device" and third.image == again.image
        assert (again.width, again.height) == (first.width, first.height)
        cache = executor_state(client)["cache"]
        assert cache["device_hits"] >= 1 and cache["device_budget_bytes"] == 200_000_000
        assert 0 < cache["device_bytes"] <= 200_000_000


def test_an_fp8_function_edits_from_a_smaller_bake(tiered: ServerProcess) -> None:
    """``storage = "fp8"``: deployed through a real server, baked under its own key, edited
    mask-aware from its encoded rows, its templates' bakes smaller than a native function's."""
    with Client(tiered.url) as client:
        held = executor_state(client)["templates"]
        native, fp8 = held["tiny-flux"], held["tiny-flux-fp8"]
        for tid in ("shirt", "mug"):
            assert fp8[tid]["key"] != native[tid]["key"]  # same template, its own entry
            assert 0 < fp8[tid]["bytes"] < 0.75 * native[tid]["bytes"]
        edit = client.invoke("tiny-flux-fp8", "shirt", MASK, "a green hat", seed=1)
        assert edit.path == "maskaware" and edit.cache.tier == "host"
        # That the 8-bit rows are what the edit reads is shown pixel for pixel by
        # tests/runtime/maskaware/test_stored_rows.py; a served edit of a random-weight
        # model may round to the native edit's very PNG, so it is not compared here.
