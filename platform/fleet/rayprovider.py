"""Executors as Ray actors (``retouch serve --provider ray``).

Each executor is the same HTTP process as with the local provider, started by a Ray actor
on whichever node Ray places it: one GPU each (``num_gpus=1``), or, on CPU clusters, one unit
of the custom resource ``retouch_executor`` (a node offers as many executors as it has
units). The gateway stays the one control plane: it reaches executors over HTTP at the
address the actor reports, and Ray's own autoscaler adds nodes for actors that cannot be
placed (two-layer scaling). Executors spread over the nodes: each new one is sent (a soft
node affinity) to the node offering the resource that holds the fewest of this gateway's
executors (running or starting), so a lost node takes one executor, not several, and never
to a node an executor just died on (Ray's health checks take seconds to mark a lost node
dead; a replacement sent there dies with it); only when no node qualifies, wherever Ray's
``SPREAD`` puts it. (``SPREAD`` alone only rotates: an executor started again after a
failed start, or two started at once, can land beside another.) The executor binds its
node's address and keeps its
activation store under ``<data-dir>/nodes/<node id>`` (the node's ``RETOUCH_DATA_DIR`` when
it sets one, else the gateway's), shared by the executors of that node.

The actor owns its executor process: a fresh one is the actor's child (the executor's parent
watch ends it when the actor dies); on a node whose environment names an executor zygote
(``RETOUCH_EXECUTOR_ZYGOTE``) a CPU executor is forked by it, imports done, and the
actor's connection to the zygote is its lifeline instead (``platform/fleet/forkedprocess``).
The provider owns the actors. An actor killed or a node lost
shows as ``alive == False`` (a ``wait`` call on the actor returns or fails), and the pool
re-places that executor's invocations as for a local process.

The gateway may start before the Ray head answers (KubeRay starts it as a second container
of the head pod): :meth:`RayProvider.connect` waits, with backoff and up to a bounded time,
for the head's port to accept connections, then joins. Ray is an optional extra
(``pip install retouch[ray]``); nothing imports it unless this provider is chosen.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retouch.functions.errors import Unavailable
from retouch.platform.fleet.providers import (
    START_TIMEOUT_S,
    ZYGOTE_ENV,
    Child,
    Executor,
    LocalProvider,
    start_executor_process,
    wait_healthy,
)
from retouch.runtime.executor.app import TOKEN_ENV

log = logging.getLogger(__name__)

RESOURCE = "retouch_executor"  # the custom resource of CPU executor slots
NAMESPACE = "retouch"
STOP_TIMEOUT_S = 15.0
LOST_NODE_S = 120.0  # a node an executor died on is not preferred for this long
BACKOFF_S = (0.5, 5.0)  # first and longest pause between two looks at the Ray head


class ExecutorActor:
    """Runs one executor process on its node (a threaded actor: ``wait`` blocks)."""

    def __init__(
        self, name: str, device: str, data_dir: str, token: str, args: list[str], threads: int
    ) -> None:
        self.name, self.device, self.threads = name, device, threads
        self.data_dir, self.token, self.args = Path(data_dir), token, args
        self.process: Child | None = None

    def start(self) -> tuple[str, str, int]:
        """Start the executor; returns its URL, this node's id and the process id."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        host = ray.util.get_node_ip_address()
        # A node's own data dir (its local NVMe, RETOUCH_DATA_DIR in its environment) wins
        # over the gateway's, which is only reachable here on a single-machine cluster.
        base = Path(os.environ.get("RETOUCH_DATA_DIR") or self.data_dir)
        data_dir = base / "nodes" / node[:12]
        run_dir = data_dir / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        port_file = run_dir / f"{self.name}.port"
        port_file.unlink(missing_ok=True)
        argv = [
            "--name", self.name, "--device", self.device, "--data-dir", str(data_dir),
            "--port-file", str(port_file), "--threads", str(self.threads), "--host", host,
            *self.args,
        ]  # fmt: skip
        # A node's executor zygote (RETOUCH_EXECUTOR_ZYGOTE in its environment) forks CPU
        # executors with their imports done; else a fresh interpreter watches this actor.
        zygote = Path(os.environ[ZYGOTE_ENV]) if os.environ.get(ZYGOTE_ENV) else None
        self.process = start_executor_process(
            argv,
            _executor_env(self.token, forked=zygote is not None and self.device == "cpu"),
            run_dir / f"{self.name}.log",
            zygote,
            self.device,
        )
        _normal_priority(self.process.pid)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"executor {self.name} did not start (see {run_dir})")
            time.sleep(0.05)
        return f"http://{host}:{int(port_file.read_text())}", node, self.process.pid

    def wait(self) -> int | None:
        """Returns the executor's exit code when its process ends."""
        return self.process.wait() if self.process is not None else None

    def stop(self) -> None:
        if self.process is not None:
            LocalProvider.stop_now(self.process)


def _executor_env(token: str, forked: bool) -> dict[str, str]:
    """The executor's environment: this worker's, and where it is to fork from the node's
    zygote (``forked``), less an ``OMP_NUM_THREADS`` Ray set in this process (to 1 in a
    worker holding no CPU, as this actor: ``num_cpus=0``) for the worker's own code: the
    zygote forks only an executor whose import-time variables are the node's, and the
    executor sets its torch threads itself (``--threads``). What Ray set shows as a
    variable missing from the environment this process was started with
    (``/proc/self/environ``); where that cannot be read the environment stays as it is."""
    env = {**os.environ, TOKEN_ENV: token}
    started = _started_environ() if forked else None
    if started is not None and "OMP_NUM_THREADS" not in started:
        env.pop("OMP_NUM_THREADS", None)
    return env


def _started_environ() -> dict[str, str] | None:
    """The environment this process was started with (Linux), None if unreadable."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return None
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


def _normal_priority(pid: int) -> None:
    """Run the executor at niceness 0, not the niceness 15 Ray gives its workers.

    Ray lowers its workers' priority so they never starve the raylet; an executor is a
    latency-bound server, and at 15 it lost the CPU to everything else on a busy node
    (measured on a 2-core machine under load: gateway overhead p50 1.8 s vs 0.19 s for the
    same executor started locally). Set right after the start, before the executor spawns
    its pre/post workers, which inherit it. Raising priority needs CAP_SYS_NICE: without it
    the executor stays at Ray's niceness and says so.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, pid, 0)
    except PermissionError:
        log.warning(
            "executor pid %d keeps Ray's worker niceness %d (no CAP_SYS_NICE): it yields the "
            "CPU to other processes on its node; start Ray with RAY_worker_niceness=0",
            pid,
            os.getpriority(os.PRIO_PROCESS, pid),
        )


@dataclass
class RayExecutor:
    """An executor under a Ray actor, as the pool holds it."""

    name: str
    device: str
    url: str
    actor: Any  # ray.actor.ActorHandle
    ended: Any  # ray.ObjectRef of the actor's ``wait``: ready once the process is gone
    node: str
    pid: int

    @property
    def alive(self) -> bool:
        import ray

        ready, _ = ray.wait([self.ended], timeout=0)
        return not ready

    @property
    def exit_code(self) -> int | None:
        import ray

        if self.alive:
            return None
        try:
            return ray.get(self.ended, timeout=0)
        except Exception:  # the actor or its node died: no exit code to read
            return -1


def head_endpoint(address: str) -> tuple[str, int] | None:
    """The host and port of a ``host:port`` Ray address; None for ``auto`` (the cluster
    this machine runs, found from Ray's own files) and other forms Ray resolves itself."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or "/" in address or not port.isdigit():
        return None
    return host, int(port)


def wait_for_head(address: str, wait_s: float) -> None:
    """Return once the Ray head at ``address`` accepts connections; raise
    :class:`Unavailable` after ``wait_s`` seconds.

    ``ray.init`` is not the probe: against an address where nothing listens yet it retries
    the head inside for minutes (measured: still waiting after 200 s) and cannot be
    interrupted, so the gateway would neither start nor fail. A TCP connect to the head's
    port answers at once either way."""
    endpoint = head_endpoint(address)
    if endpoint is None:
        return
    deadline = time.monotonic() + wait_s
    pause = BACKOFF_S[0]
    while True:
        try:
            socket.create_connection(endpoint, timeout=min(pause, 2.0)).close()
            return
        except OSError as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(
                    f"the Ray head at {address} did not answer within {wait_s:g} s ({exc})",
                    code="ray_head_unavailable",
                ) from exc
            log.warning(
                "waiting for the Ray head at %s (%s); next look in %.1f s", address, exc, pause
            )
            time.sleep(min(pause, left))
            pause = min(pause * 2, BACKOFF_S[1])


class RayProvider:
    """Starts executors as Ray actors on the cluster at ``address``."""

    owns_processes = True  # see providers.Provider

    def __init__(
        self,
        data_dir: Path,
        token: str,
        address: str = "auto",
        executor_args: tuple[str, ...] = (),
        threads: int = 0,
        *,
        head_wait_s: float,
    ) -> None:
        self.data_dir, self.token, self.address = data_dir, token, address
        self.executor_args, self.threads = executor_args, threads
        self.head_wait_s = head_wait_s
        self._connected = False
        # the node each executor of this provider runs on, or was sent to while it starts
        self._nodes: dict[str, str] = {}
        # nodes an executor died on, and when: not chosen again for LOST_NODE_S (Ray may
        # still list a lost node alive for a while, and a soft affinity to it would wait)
        self._lost: dict[str, float] = {}

    def connect(self) -> None:
        """Join the cluster, first waiting up to ``head_wait_s`` for its head to answer.
        The gateway calls it before it serves, so it never runs without its executors'
        cluster (it fails with one line instead)."""
        self._ray()

    def _ray(self) -> Any:
        import ray

        if not self._connected:
            wait_for_head(self.address, self.head_wait_s)
            ray.init(
                address=self.address,
                namespace=NAMESPACE,
                ignore_reinit_error=True,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
            self._connected = True
        return ray

    def devices(self) -> list[str]:
        """One entry per executor the cluster can hold now: its GPUs, else its
        ``retouch_executor`` units (each actor sees its own GPU as ``cuda:0``)."""
        resources = self._ray().cluster_resources()
        gpus = int(resources.get("GPU", 0))
        if gpus:
            return ["cuda:0"] * gpus
        return ["cpu"] * int(resources.get(RESOURCE, 0))

    def threads_per_executor(self, count: int) -> int:
        return self.threads or 1

    def _strategy(self, name: str, resource: str) -> Any:
        """Where the executor ``name`` goes: of the nodes offering ``resource`` that no
        executor just died on, the one holding the fewest of this provider's others (soft:
        Ray places it elsewhere if that node fills meanwhile), else Ray's ``SPREAD``. A node
        lost a moment ago still looks alive to Ray, and ``SPREAD`` would place half the
        replacements there."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray = self._ray()
        now = time.monotonic()
        self._lost = {n: t for n, t in self._lost.items() if now - t < LOST_NODE_S}
        held = Counter(node for other, node in self._nodes.items() if other != name)
        usable = sorted(
            n["NodeID"]
            for n in ray.nodes()
            if n.get("Alive")
            and n.get("Resources", {}).get(resource, 0) >= 1
            and n["NodeID"] not in self._lost
        )
        if not usable:
            self._nodes.pop(name, None)
            return "SPREAD"
        node = min(usable, key=lambda n: held[n])  # sorted: ties go to the first
        self._nodes[name] = node
        return NodeAffinitySchedulingStrategy(node_id=node, soft=True)

    async def start(self, name: str, device: str, threads: int) -> Executor:
        ray = self._ray()
        gpu = device.startswith("cuda")
        placement = {"num_gpus": 1} if gpu else {"resources": {RESOURCE: 1}}
        actor = (
            ray.remote(ExecutorActor)
            .options(
                name=f"{name}-{uuid.uuid4().hex[:8]}",
                num_cpus=0,
                max_concurrency=4,
                max_restarts=0,
                scheduling_strategy=self._strategy(name, "GPU" if gpu else RESOURCE),
                **placement,
            )
            .remote(name, device, str(self.data_dir), self.token, list(self.executor_args), threads)
        )
        try:
            url, node, pid = await asyncio.to_thread(
                ray.get, actor.start.remote(), timeout=START_TIMEOUT_S
            )
            self._nodes[name] = node  # where it runs (a soft affinity may have moved it)
            ended = actor.wait.remote()
            executor = RayExecutor(name, device, url, actor, ended, node, pid)
            await wait_healthy(url, self.token, lambda: executor.exit_code)
        except Exception as exc:
            self._nodes.pop(name, None)
            ray.kill(actor)
            if isinstance(exc, Unavailable):
                raise
            raise Unavailable(f"executor {name} did not start under Ray: {exc}") from exc
        log.info("executor %s on node %s at %s (Ray actor)", name, node[:12], url)
        return executor

    async def stop(self, executor: Executor, *, failed: bool = False) -> None:
        """Stop the actor; an executor that died (the pool's probes saw it, or Ray did)
        sends its replacement elsewhere for a while: its node may be lost, and Ray's health
        checks take seconds to say so (12 s on a loaded 2-core machine), during which a
        replacement placed there dies with the node."""
        assert isinstance(executor, RayExecutor)
        self._nodes.pop(executor.name, None)
        if failed or not executor.alive:
            self._lost[executor.node] = time.monotonic()
        ray = self._ray()
        try:
            await asyncio.to_thread(ray.get, executor.actor.stop.remote(), timeout=STOP_TIMEOUT_S)
        except Exception as exc:  # already dead, or its node is gone: nothing to stop
            log.debug("stopping %s: %r", executor.name, exc)
        ray.kill(executor.actor)
