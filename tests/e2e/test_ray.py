"""Executors as Ray actors on a real 2-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``, CPU resources): deploy and invoke through the gateway, one
executor per node, and an actor killed under load with every invocation still answered."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from retouch.platform.client import Client, read_spec_file
from retouch.platform.server import ServerProcess
from tests.e2e.loadgen import Load
from tests.support import wait_for

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install retouch[ray]")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow

SLOT = {"retouch_executor": 1}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": SLOT, "include_dashboard": False},
    )
    nodes.add_node(num_cpus=1, resources=SLOT)
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, namespace="retouch", log_to_driver=False)
    yield nodes
    ray.shutdown()
    nodes.shutdown()


def test_executors_on_two_nodes_serve_and_survive_a_killed_actor(
    cluster: Cluster,
    tmp_path: Path,
    examples: Path,
) -> None:
    spec, images = read_spec_file(examples / "tiny-flux.toml")
    # No SLO: admission would refuse the edits a loaded machine predicts late.
    spec = dataclasses.replace(spec, name="on-ray", steps=8, slo_ms=None)
    mask = np.zeros((128, 128), bool)
    mask[16:80, 24:88] = True

    def invoke(client: Client, seed: int) -> object:
        return client.invoke("on-ray", "shirt", mask, "a red shirt", seed=seed, format="raw")

    args = ["--provider", "ray", "--ray-address", cluster.address]
    server = ServerProcess(tmp_path / "data", extra_args=args)
    with server, Client(server.url) as client:
        executors = client.executors()["executors"]
        assert len(executors) == 2
        assert len({e["node"] for e in executors}) == 2  # Ray put one on each node
        # served at normal priority, not at the niceness 15 of Ray's workers
        ours = [psutil.Process(e["state"]["pid"]) for e in executors]
        assert all(str(tmp_path) in " ".join(p.cmdline()) for p in ours)  # this cluster's
        assert all(p.nice() == 0 for p in ours)
        client.deploy(spec, images)
        assert invoke(client, 0).path in ("stock", "maskaware")

        with Load(server.url, invoke, clients=4) as load:
            wait_for("invocations under way", lambda: len(load.results) >= 8)
            victim = next(n for n in ray.util.list_named_actors() if n.startswith("exec-0-"))
            ray.kill(ray.get_actor(victim))
            wait_for("the killed executor restarted", lambda: (
                [e["healthy"] for e in client.executors()["executors"]] == [True, True]
                and any(e["restarts"] for e in client.executors()["executors"])
            ))  # fmt: skip
            time.sleep(1.0)
        assert not load.errors, load.errors[:3]  # every invocation answered
        assert {r.executor for r in load.results} >= {"exec-0", "exec-1"}


def test_the_autoscaler_adds_and_removes_ray_actors(
    cluster: Cluster,
    tmp_path: Path,
    examples: Path,
) -> None:
    from retouch.functions.spec import ScalingSpec

    spec, images = read_spec_file(examples / "tiny-flux.toml")
    scaling = ScalingSpec(0, 2, target_s=1.0, upscale_delay_s=2.0, stable_window_s=3.0,
                          downscale_delay_s=2.0, downscale_to_zero_delay_s=3.0)  # fmt: skip
    spec = dataclasses.replace(spec, name="ray-scaled", steps=4, scaling=scaling, slo_ms=None)
    mask = np.zeros((128, 128), bool)
    mask[16:80, 24:88] = True
    args = ["--provider", "ray", "--ray-address", cluster.address, "--autoscale"]
    server = ServerProcess(tmp_path / "data", extra_args=args)
    with server, Client(server.url) as client:
        assert client.executors()["executors"] == []
        client.deploy(spec, images)

        def actors() -> list[str]:
            return [n for n in ray.util.list_named_actors() if n.startswith("exec-")]

        before = set(actors())
        result = client.invoke("ray-scaled", "shirt", mask, "a red shirt", format="raw")
        assert result.path in ("stock", "maskaware")  # answered after an actor started
        started = set(actors()) - before
        assert started, "no Ray actor was started"
        wait_for("back to zero executors", lambda: client.executors()["executors"] == [])
        wait_for("its actor removed", lambda: not (set(actors()) & started), 60.0)
