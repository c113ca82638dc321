"""Executors as Ray actors on a real three-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``: a head with no room for executors and two worker nodes
with two executor slots each), served through ``retouch serve --provider ray``.

The pool's two executors land on different workers and run at normal priority; an actor
killed under load loses no invocation (the pool restarts it); the autoscaler adds and
removes actors; and, last (it takes a node away), a worker node killed while invocations
run there (async jobs and sync invokes) loses none: each ends ``succeeded`` once, those the
lost node held re-run on the other worker, which the pool's replacement executor joins at
its first start (the pool saw the executor die before Ray's health checks saw its node).
Beside the cluster: a gateway started before its Ray head waits for it, and one whose head
never answers fails in one line."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest

from retouch.functions.spec import ScalingSpec
from retouch.functions.wire.invoke import InvokeResult
from retouch.functions.wire.jobs import JobEventKind
from retouch.platform.api.client import Client, read_spec_file
from retouch.platform.api.server import ServerProcess, free_port
from retouch.platform.fleet.rayprovider import NAMESPACE, RESOURCE, wait_for_head
from tests.e2e.loadgen import Load
from tests.support import WAIT_S, cli_refusal, wait_for

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install retouch[ray]")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow

SLOTS = 2  # executor slots per worker: room for the whole pool on either one
MASK = np.zeros((128, 128), bool)
MASK[16:80, 24:88] = True


@dataclasses.dataclass
class Nodes:
    cluster: Cluster
    workers: list  # ray._private.node.Node

    @property
    def address(self) -> str:
        return self.cluster.address


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    workers = [cluster.add_node(num_cpus=0, resources={RESOURCE: SLOTS}) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    yield Nodes(cluster, workers)
    ray.shutdown()
    cluster.shutdown()


def pool_of_two(examples: Path, name: str, steps: int) -> tuple:
    """tiny-flux as ``name``, with exactly two executors (no SLO: admission would refuse
    the edits a loaded machine predicts late)."""
    spec, images = read_spec_file(examples / "tiny-flux.toml")
    scaling = dataclasses.replace(spec.scaling, min_executors=2, max_executors=2)
    return dataclasses.replace(spec, name=name, steps=steps, slo_ms=None, scaling=scaling), images


def serve(nodes: Nodes, data: Path, *extra: str) -> ServerProcess:
    args = ["--provider", "ray", "--ray-address", nodes.address, "--autoscale", *extra]
    return ServerProcess(data, extra_args=args)


def two_ready(client: Client) -> list[dict]:
    """The pool's two executors, once both are ready (they start after the deploy)."""
    wait_for(
        "two executors ready",
        lambda: [e["healthy"] for e in client.executors()["executors"]] == [True, True],
        detail=lambda: client.executors()["executors"],
    )
    return client.executors()["executors"]


def test_executors_spread_and_survive_a_killed_actor(
    nodes: Nodes, tmp_path: Path, examples: Path, executor_zygote: Path
) -> None:
    spec, images = pool_of_two(examples, "on-ray", 8)

    def invoke(client: Client, seed: int) -> object:
        return client.invoke("on-ray", "shirt", MASK, "a red shirt", seed=seed, format="raw")

    with serve(nodes, tmp_path / "data") as server, Client(server.url) as client:
        client.deploy(spec, images)
        executors = two_ready(client)
        workers = {w.node_id for w in nodes.workers}
        assert sorted(e["node"] for e in executors) == sorted(workers)  # one on each worker
        # served at normal priority, not at the niceness 15 of Ray's workers
        ours = [psutil.Process(e["state"]["pid"]) for e in executors]
        # this cluster's (their logs under its data dir), forked from this test process's
        # zygote (RETOUCH_EXECUTOR_ZYGOTE, inherited by the nodes) with their imports done
        assert all(any(str(tmp_path) in f.path for f in p.open_files()) for p in ours)
        assert all(str(executor_zygote) in p.parent().cmdline() for p in ours)
        assert all(p.nice() == 0 for p in ours)
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
    nodes: Nodes, tmp_path: Path, examples: Path
) -> None:
    spec, images = read_spec_file(examples / "tiny-flux.toml")
    scaling = ScalingSpec(0, 2, target_s=1.0, upscale_delay_s=2.0, stable_window_s=3.0,
                          downscale_delay_s=2.0, downscale_to_zero_delay_s=3.0)  # fmt: skip
    spec = dataclasses.replace(spec, name="ray-scaled", steps=4, scaling=scaling, slo_ms=None)
    # a scaled-down actor sleeps for 5 s (its process and GPU reservation kept), then stops
    server = serve(nodes, tmp_path / "data", "--sleep-keep-s", "5")
    with server, Client(server.url) as client:
        assert client.executors()["executors"] == []
        client.deploy(spec, images)

        def actors() -> list[str]:
            return [n for n in ray.util.list_named_actors() if n.startswith("exec-")]

        before = set(actors())
        result = client.invoke("ray-scaled", "shirt", MASK, "a red shirt", format="raw")
        assert result.path in ("stock", "maskaware")  # answered after an actor started
        started = set(actors()) - before
        assert started, "no Ray actor was started"

        def phases() -> list[str]:
            return [e["phase"] for e in client.executors()["executors"]]

        wait_for("its actor asleep", lambda: phases() == ["sleeping"], detail=phases)
        assert set(actors()) & started  # asleep, not stopped
        wait_for("back to zero executors", lambda: phases() == [], detail=phases)
        wait_for("its actor removed", lambda: not (set(actors()) & started), 60.0)


def test_a_lost_worker_node_loses_no_invocation(
    nodes: Nodes, tmp_path: Path, examples: Path
) -> None:
    """Last in the module: it kills a worker node."""
    spec, images = pool_of_two(examples, "on-workers", 12)
    with serve(nodes, tmp_path / "data") as server, Client(server.url) as client:
        client.deploy(spec, images)

        def pool() -> list[dict]:
            return client.executors()["executors"]

        by_id = {w.node_id: w for w in nodes.workers}
        assert sorted(e["node"] for e in two_ready(client)) == sorted(by_id)  # one on each

        def invoke(seed: int) -> InvokeResult:
            with Client(server.url) as own:
                return own.invoke("on-workers", "shirt", MASK, "a red shirt", seed=seed)

        with ThreadPoolExecutor(2) as callers:
            jobs = [client.submit("on-workers", "shirt", MASK, "a hat", seed=i) for i in range(4)]
            sync = [callers.submit(invoke, 100 + i) for i in range(2)]
            victim = wait_for(
                "an executor running several invocations",
                lambda: next((e for e in pool() if e["inflight"] >= 2), None),
                detail=pool,
            )
            survivor = next(n for n in by_id if n != victim["node"])
            # the machine goes: its Ray processes and its executor (forked by the zygote,
            # which on a real node goes with it; here the zygote is this test process's)
            os.kill(victim["state"]["pid"], signal.SIGKILL)
            nodes.cluster.remove_node(by_id[victim["node"]], allow_graceful=False)
            answered = [future.result() for future in sync]  # a failed invoke raises here
        finished = [job.wait(timeout=WAIT_S) for job in jobs]

        assert [job.doc["status"] for job in jobs] == ["succeeded"] * len(jobs)
        terminal = {JobEventKind.SUCCEEDED, JobEventKind.FAILED}
        for job in jobs:  # each job ended once: one terminal event in its stream
            assert [e.kind for e in job.events() if e.kind in terminal] == [JobEventKind.SUCCEEDED]
        listed = [doc["id"] for doc in client.jobs(function="on-workers")]
        assert sorted(listed) == sorted(job.id for job in jobs)  # none lost, none twice
        # the lost node's invocations were sent again, to the other worker
        assert any(result.attempts > 1 for result in [*answered, *finished])
        wait_for(
            "the lost executor replaced on the surviving worker",
            lambda: [(e["healthy"], e["node"]) for e in pool()] == [(True, survivor)] * 2,
            detail=pool,
        )
        assert [e["restarts"] for e in pool() if e["name"] == victim["name"]] == [1]
        # at the first try: not on the lost node, which Ray's health checks mark dead later
        assert "could not start" not in (tmp_path / "data" / "gateway.log").read_text()
        assert invoke(200).path in ("stock", "maskaware")


def test_a_gateway_waits_for_a_ray_head_that_starts_after_it() -> None:
    """As beside a KubeRay head: the head's port answers later, and the wait returns."""
    port = free_port()
    listener = socket.socket()

    def head_comes_up() -> None:
        time.sleep(1.5)
        listener.bind(("127.0.0.1", port))
        listener.listen()

    threading.Thread(target=head_comes_up, daemon=True).start()
    started = time.monotonic()
    try:
        wait_for_head(f"127.0.0.1:{port}", 30.0)
        assert time.monotonic() - started >= 1.0
    finally:
        listener.close()


def test_a_gateway_fails_in_one_line_when_no_ray_head_answers(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    code, err = cli_refusal(
        capsys, "serve", "--data-dir", str(tmp_path), "--provider", "ray",
        "--ray-address", address, "--ray-wait-s", "1.5",
    )  # fmt: skip
    assert code == 1
    assert err.startswith("error: ray_head_unavailable: ")
    assert f"the Ray head at {address} did not answer within 1.5 s" in err
    assert len(err.strip().splitlines()) == 1
