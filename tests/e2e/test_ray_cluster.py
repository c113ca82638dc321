"""A three-node Ray cluster on this machine, started as KubeRay starts one (``ray start``):
a head with no room for executors and two worker raylets with two executor slots each,
serving one function through ``retouch serve --provider ray``.

The gateway is started before the head (as beside a KubeRay head) and waits for it; the
pool's two executors land on different workers; one worker's raylet is SIGKILLed while
invocations run there (async jobs and sync invokes), and none is lost: each ends
``succeeded`` exactly once, those the lost node held re-run on the other worker, and the
pool replaces the lost executor there."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest

from retouch.functions import wire
from retouch.platform.client import Client, read_spec_file
from retouch.platform.rayprovider import RESOURCE, wait_for_head
from retouch.platform.server import ServerProcess, free_port
from tests.support import WAIT_S, cli_refusal, reap, wait_for

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install retouch[ray]")

pytestmark = pytest.mark.slow

SLOTS = 2  # executor slots per worker: room for the whole pool on either one
START_TRIES = 3
JOINED = "Ray runtime started"  # what ``ray start`` prints once its node has joined
OBJECT_STORE_BYTES = 80 << 20  # near Ray's minimum: executors move no objects through it
# Every port a raylet binds by default to a fixed number; two raylets on one host need
# their own (the node manager's is how a test knows its node in ``ray.nodes()``).
PORT_FLAGS = (
    "--object-manager-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
)


@dataclasses.dataclass
class RayNode:
    """One ``ray start --block`` process: the node's raylet and agents are its children,
    and it stops them when it is stopped or when its raylet dies."""

    process: subprocess.Popen
    manager_port: int

    log: Path

    def joined(self) -> bool:
        return JOINED in self.log.read_text()

    def settled(self) -> bool:
        """Joined, or its ``ray start`` gave up."""
        return self.joined() or self.process.poll() is not None

    def raylet(self) -> psutil.Process:
        children = psutil.Process(self.process.pid).children(recursive=True)
        return next(p for p in children if p.name() == "raylet")


class RayNodes:
    """Ray nodes on this machine, each started by the ``ray`` command as on a cluster."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        # Short: Ray puts unix sockets under it (a pytest tmp_path is too long for them).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rr-", dir="/tmp"))
        # Ports handed out: a raylet's, or one a process started meanwhile will bind (the
        # gateway binds its own only once it has joined the head)
        self.reserved: set[int] = set()
        self.port = self.free_port()
        self.nodes: list[RayNode] = []
        self._count = itertools.count()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_head(self) -> RayNode:
        """The head, once it answers (a worker started before fails to join)."""
        head = self._start(
            "--head", "--port", str(self.port), "--temp-dir", str(self.temp_dir),
            "--include-dashboard", "false",
        )  # fmt: skip
        wait_for_head(self.address, WAIT_S)
        return head

    def add_worker(self, resources: dict[str, int]) -> RayNode:
        """A worker that joined the head. One at a time, and started again when its
        ``ray start`` gives up (on a loaded machine it times out registering, as a
        Kubernetes pod's would; KubeRay restarts that pod)."""
        for _ in range(START_TRIES):
            node = self._start("--address", self.address, "--resources", json.dumps(resources))
            wait_for("a Ray worker joined or failed", node.settled)
            if node.joined():
                return node
            self.nodes.remove(node)
        raise AssertionError(f"no Ray worker joined in {START_TRIES} tries (see {self.log_dir})")

    def free_port(self) -> int:
        """A free port no node nor the gateway was given."""
        while (port := free_port()) in self.reserved:
            pass
        self.reserved.add(port)
        return port

    def _start(self, *args: str) -> RayNode:
        manager_port = self.free_port()
        ports = [part for flag in PORT_FLAGS for part in (flag, str(self.free_port()))]
        cmd = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
            "--node-ip-address", "127.0.0.1", "--num-cpus", "0",
            "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats",
            "--node-manager-port", str(manager_port), *ports, *args,
        ]  # fmt: skip
        log = self.log_dir / f"ray-node-{next(self._count)}.log"
        with log.open("ab") as log_file:
            process = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        node = RayNode(process, manager_port, log)
        self.nodes.append(node)
        return node

    def node_ids(self, nodes: list[RayNode]) -> list[str]:
        """The Ray node ids of ``nodes`` (the test's driver must be connected)."""
        by_port = {n["NodeManagerPort"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
        return [by_port[node.manager_port] for node in nodes]

    def close(self) -> None:
        for node in reversed(self.nodes):
            node.process.terminate()
        for node in self.nodes:
            reap(node.process)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[RayNodes]:
    cluster = RayNodes(tmp_path)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.close()


def alive_nodes() -> int:
    return sum(n["Alive"] for n in ray.nodes())


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


def test_three_nodes_spread_the_pool_and_a_lost_worker_loses_no_invocation(
    nodes: RayNodes, tmp_path: Path, examples: Path
) -> None:
    spec, images = read_spec_file(examples / "tiny-sd.toml")
    scaling = dataclasses.replace(spec.scaling, min_executors=2, max_executors=2)
    spec = dataclasses.replace(spec, name="on-workers", steps=8, slo_ms=None, scaling=scaling)
    mask = np.zeros((128, 128), bool)
    mask[24:96, 32:100] = True
    args = ["--provider", "ray", "--ray-address", nodes.address, "--autoscale"]
    server = ServerProcess(tmp_path / "data", extra_args=args)
    nodes.reserved.add(server.port)
    gateway_log = tmp_path / "data" / "gateway.log"

    # The gateway first, then the head: it waits for the head instead of failing.
    with ThreadPoolExecutor(1) as background:
        started = background.submit(server.start, WAIT_S)
        wait_for("the gateway waiting for the Ray head", lambda: (
            gateway_log.exists() and "waiting for the Ray head" in gateway_log.read_text()
        ), timeout=60.0)  # fmt: skip
        nodes.start_head()
        workers = [nodes.add_worker({RESOURCE: SLOTS}) for _ in range(2)]
        started.result()
    with server, Client(server.url) as client:
        ray.init(address=nodes.address, namespace="retouch-test", log_to_driver=False)
        wait_for("three Ray nodes", lambda: alive_nodes() == 3, detail=ray.nodes)
        worker_ids = nodes.node_ids(workers)
        client.deploy(spec, images)

        def pool() -> list[dict]:
            return client.executors()["executors"]

        wait_for("two executors ready", lambda: [e["healthy"] for e in pool()] == [True, True])
        assert sorted(e["node"] for e in pool()) == sorted(worker_ids)  # one on each worker

        def invoke(seed: int) -> wire.InvokeResult:
            with Client(server.url) as own:
                return own.invoke("on-workers", "street", mask, "a red door", seed=seed)

        with ThreadPoolExecutor(4) as callers:
            jobs = [client.submit("on-workers", "poster", mask, "a hat", seed=i) for i in range(6)]
            sync = [callers.submit(invoke, 100 + i) for i in range(4)]
            victim = wait_for(
                "an executor running several invocations",
                lambda: next((e for e in pool() if e["inflight"] >= 2), None),
                detail=pool,
            )
            lost = workers[worker_ids.index(victim["node"])]
            survivor = worker_ids[1 - worker_ids.index(victim["node"])]
            lost.raylet().send_signal(signal.SIGKILL)
            answered = [future.result() for future in sync]  # a failed invoke raises here
        finished = [job.wait(timeout=WAIT_S) for job in jobs]

        assert [job.doc["status"] for job in jobs] == ["succeeded"] * len(jobs)
        terminal = {wire.JobEventKind.SUCCEEDED, wire.JobEventKind.FAILED}
        for job in jobs:  # each job ended once: one terminal event in its stream
            assert [e.kind for e in job.events() if e.kind in terminal] == [
                wire.JobEventKind.SUCCEEDED
            ]
        listed = [doc["id"] for doc in client.jobs(function="on-workers")]
        assert sorted(listed) == sorted(job.id for job in jobs)  # none lost, none twice
        # the lost node's invocations were sent again, to the other worker
        assert any(result.attempts > 1 for result in [*answered, *finished])

        # The pool replaced the lost executor on the worker that has room for it.
        wait_for(
            "the lost executor replaced on the surviving worker",
            lambda: [(e["healthy"], e["node"]) for e in pool()] == [(True, survivor)] * 2,
            detail=pool,
        )
        assert [e["restarts"] for e in pool() if e["name"] == victim["name"]] == [1]
        wait_for("Ray seeing the lost node dead", lambda: alive_nodes() == 2, detail=ray.nodes)
        assert invoke(200).path in ("stock", "maskaware")
