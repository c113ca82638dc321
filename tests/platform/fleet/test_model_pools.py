"""Per-model autoscaled pools, without processes: each model pool's settings merge only its
own functions' tables; the pool's load splits by model; a model pool's scale-up takes a
free device or none (never another model's), its scale-down drains only its own
executors; placement and deploy consider an executor only for its model's functions."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from retouch.functions.spec import FunctionSpec, ScalingSpec, load_spec_file
from retouch.functions.wire.executor import ExecutorPhase
from retouch.platform.control.placement import LeastRequests
from retouch.platform.fleet.executorlink import ExecutorHandle
from retouch.platform.fleet.pool import ExecutorPool
from retouch.platform.fleet.scaler import (
    NO_DEVICE,
    Arrived,
    Member,
    ModelLoad,
    PoolScaler,
    model_configs,
    pool_config,
    split_load,
)
from retouch.platform.fleet.sleepers import SleepPolicy
from retouch.platform.state.registry import StoredFunction
from tests.support import EXAMPLES

SD, FLUX = "retouch:tiny-sd", "retouch:tiny-flux"
FAST = ScalingSpec(0, 1, target_s=1.0, upscale_delay_s=1.0, stable_window_s=2.0,
                   downscale_delay_s=2.0, downscale_to_zero_delay_s=2.0)  # fmt: skip


def spec(example: str, name: str, scaling: ScalingSpec = FAST) -> FunctionSpec:
    base, _ = load_spec_file(EXAMPLES / f"{example}.toml")
    return dataclasses.replace(base, name=name, scaling=scaling)


def test_each_model_pool_merges_only_its_own_functions_tables() -> None:
    eager_sd = spec("tiny-sd", "a", ScalingSpec(0, 3, target_s=5.0, upscale_delay_s=2.0))
    patient_sd = spec("tiny-sd", "b", ScalingSpec(1, 8, target_s=20.0, downscale_delay_s=900.0))
    flux = spec("tiny-flux", "c", ScalingSpec(0, 1, target_s=60.0, upscale_delay_s=30.0))
    configs = model_configs([eager_sd, patient_sd, flux], capacity=4)
    assert set(configs) == {SD, FLUX}
    sd = configs[SD]
    assert sd == pool_config([eager_sd.scaling, patient_sd.scaling], 4)  # the same merge rules
    assert (sd.min_executors, sd.max_executors) == (1, 4)  # capped by the devices
    assert sd.target_s == 5.0 and sd.panic_window_s == 2.0 and sd.downscale_delay_s == 900.0
    # flux's table alone: sd's eager target and min do not leak into it.
    assert configs[FLUX] == pool_config([flux.scaling], 4)
    assert (configs[FLUX].min_executors, configs[FLUX].max_executors) == (0, 1)
    assert configs[FLUX].target_s == 60.0 and configs[FLUX].panic_window_s == 30.0
    assert model_configs([], capacity=2) == {}


def test_the_load_splits_by_model_pool() -> None:
    members = [
        Member(SD, 2.0, True),
        Member(SD, 0.5, True),
        Member(SD, 9.0, False),  # draining: neither work nor capacity
        Member(FLUX, 0.0, True),  # starting
        Member(None, 5.0, True),  # a static pool's executor: no model pool
    ]
    queued = [("sd-a", 1.0), ("sd-b", 0.25), ("flux", 3.0), ("gone", 7.0)]
    model_of = {"sd-a": SD, "sd-b": SD, "flux": FLUX, "other": "retouch:tiny-sd3"}
    loads = split_load(members, queued, model_of)
    assert loads == {
        SD: ModelLoad(work_s=3.75, queued=2, target=2),
        FLUX: ModelLoad(work_s=3.0, queued=1, target=1),
    }  # the deleted function's queued invocation and the idle tiny-sd3 pool count nowhere
    assert split_load([], [], model_of) == {}


class FakeHandle:
    def __init__(self, name: str, model: str) -> None:
        self.name, self.model = name, model


class FakePool:
    """A :class:`ScaledFleet`: what :class:`PoolScaler` reads and calls on the fleet."""

    def __init__(self, functions: list[FunctionSpec], devices: int) -> None:
        self.functions = {s.name: s for s in functions}
        self.device_count = devices
        self.handles: list[FakeHandle] = []
        self.loads: dict[str, ModelLoad] = {}
        self.retired: list[str] = []
        self.arrived: dict[str, float] = {}  # executor-seconds that arrived, per model

    def devices(self) -> list[str]:
        return ["cpu"] * self.device_count

    def specs(self) -> list[FunctionSpec]:
        return list(self.functions.values())

    def model_loads(self) -> dict[str, ModelLoad]:
        return dict(self.loads)

    def take_arrived(self) -> dict[str, Arrived]:
        # no counts: the autoscaler's noise is the demand's own spread
        arrived, self.arrived = self.arrived, {}
        return {model: Arrived(executor_s) for model, executor_s in arrived.items()}

    def spawn(self, devices: list[str], model: str | None = None) -> bool:
        if len(self.handles) >= self.device_count:
            return False
        self.handles.append(FakeHandle(f"exec-{len(self.handles)}", model or ""))
        return True

    def scale_down_victims(self, count: int, model: str | None = None) -> list[Any]:
        return [h for h in self.handles if h.model == model][:count]

    def retire(self, handle: FakeHandle) -> None:
        self.retired.append(handle.name)
        self.handles.remove(handle)


def test_model_pools_scale_on_their_own_load_and_share_the_devices() -> None:
    pool = FakePool([spec("tiny-sd", "sd"), spec("tiny-flux", "flux")], devices=1)
    clock = [0.0]
    scaler = PoolScaler(pool, clock=lambda: clock[0])
    devices = ["cpu"]

    pool.loads = {SD: ModelLoad(0.0, 1, 0)}  # an sd invocation waits; flux is idle
    decisions = scaler.tick(devices)
    assert decisions[SD].desired == 1 and decisions[FLUX].desired == 0
    assert [(h.name, h.model) for h in pool.handles] == [("exec-0", SD)]

    # flux work arrives while sd holds the only device: flux starts nothing, takes nothing.
    pool.loads = {SD: ModelLoad(0.5, 0, 1), FLUX: ModelLoad(0.0, 1, 0)}
    for _ in range(3):
        clock[0] += 1.0
        scaler.tick(devices)
    assert [h.model for h in pool.handles] == [SD] and pool.retired == []
    flux = scaler.models[FLUX]
    assert flux.no_device == 3 and flux.ups == 0
    assert [e.reason for e in flux.events] == [f"work arrived at an empty pool ({NO_DEVICE})"]
    assert not flux.events[0].applied  # recorded once per blocked run, not every tick
    assert scaler.describe()["models"][FLUX]["reason"].endswith(f"({NO_DEVICE})")

    # sd goes idle and drains on its own delays; then flux gets the freed device.
    pool.loads = {SD: ModelLoad(0.0, 0, 1), FLUX: ModelLoad(0.0, 1, 0)}
    while not pool.retired:
        clock[0] += 1.0
        scaler.tick(devices)
        assert clock[0] < 30, "sd never scaled to zero"
    assert pool.retired == ["exec-0"]
    assert scaler.models[SD].downs == 1
    pool.loads = {FLUX: ModelLoad(0.0, 1, 0)}
    clock[0] += 1.0
    scaler.tick(devices)
    assert [h.model for h in pool.handles] == [FLUX]
    assert scaler.models[FLUX].ups == 1 and scaler.ups == 2 and scaler.downs == 1
    doc = scaler.describe()
    assert doc["desired"] == 1 and set(doc["models"]) == {SD, FLUX}
    assert {e["model"] for e in doc["events"]} == {SD, FLUX}


def test_a_model_pool_without_functions_drains_at_once() -> None:
    pool = FakePool([spec("tiny-sd", "sd")], devices=2)
    scaler = PoolScaler(pool)
    pool.loads = {SD: ModelLoad(0.0, 1, 0)}
    scaler.tick(["cpu", "cpu"])
    assert [h.model for h in pool.handles] == [SD]
    pool.functions.clear()  # the function was deleted: nothing may be placed there
    pool.loads = {SD: ModelLoad(0.0, 0, 1)}
    scaler.tick(["cpu", "cpu"])
    assert pool.retired == ["exec-0"]
    assert scaler.models[SD].last is not None
    assert scaler.models[SD].last.reason == "no function uses the model"


class FakeProcess:
    def __init__(self, name: str) -> None:
        self.name, self.device, self.url = name, "cpu", f"http://{name}"
        self.alive, self.exit_code, self.node = True, None, "local"


class NoProvider:
    token = "t"

    def devices(self) -> list[str]:
        return ["cpu", "cpu"]


def test_placement_sees_an_executor_only_for_its_models_functions() -> None:
    async def run() -> None:
        pool = ExecutorPool(NoProvider(), LeastRequests(), autoscale=True)  # type: ignore[arg-type]
        fleet = pool.fleet
        for s in (spec("tiny-sd", "sd"), spec("tiny-flux", "flux")):
            fleet.deploys.functions[s.name] = StoredFunction(s, {})
        sd = ExecutorHandle(FakeProcess("exec-0"), model=SD)
        static = ExecutorHandle(FakeProcess("exec-1"))  # model None: a static pool's
        for handle in (sd, static):
            handle.phase = ExecutorPhase.READY
            handle.functions = {"sd", "flux"}  # as if both had been pushed
        fleet.executors.extend([sd, static])
        assert fleet.candidates("sd") == [sd, static]
        assert fleet.candidates("flux") == [static]  # exec-0 holds it but serves tiny-sd only
        assert sd.serves(SD) and not sd.serves(FLUX) and static.serves(FLUX)
        assert pool.report.describe()[0]["model"] == SD
        loads = fleet.model_loads()
        assert loads == {SD: ModelLoad(0.0, 0, 1)}  # the static executor is in no model pool
        await pool.link.close()

    asyncio.run(run())


def test_a_model_pools_demand_scales_it_before_its_work_piles_up() -> None:
    """The executor-seconds that arrived for one model (per second of tick) scale that
    model's pool at its next tick, though its predicted work has not grown yet; the other
    model's pool is untouched."""
    wide = dataclasses.replace(FAST, max_executors=4)
    pool = FakePool([spec("tiny-sd", "sd", wide), spec("tiny-flux", "flux", wide)], devices=4)
    clock = [0.0]
    scaler = PoolScaler(pool, clock=lambda: clock[0])
    pool.loads = {SD: ModelLoad(0.0, 1, 0)}
    scaler.tick(["cpu"] * 4)  # one sd executor for the first invocation
    pool.loads = {SD: ModelLoad(0.5, 0, 1)}
    clock[0] += 1.0
    pool.arrived = {SD: 2.0}  # two executors' worth arrived in the last second
    decisions = scaler.tick(["cpu"] * 4)
    # the 1 s panic window holds this tick (2 executors' worth) and the last (0): a mean
    # of 1, over the 0.8 target utilisation -> 2 executors
    assert decisions[SD].desired == 2
    assert [h.model for h in pool.handles] == [SD, SD]
    assert decisions[FLUX].desired == 0


def test_a_model_pools_measured_start_up_reaches_its_policy() -> None:
    """The fleet's load of a pool carries what bringing back a scale-down's victim takes:
    its measured cold starts, or its wakes when victims sleep; the scaler holds the pool up
    at least that long: idle after a start from zero, the pool stops its executor once the
    start's panic hold (10 s) is over, or after a 20 s start-up."""

    async def loads(sleep: bool) -> list[float]:
        policy = SleepPolicy(keep_s=60.0 if sleep else 0.0)
        pool = ExecutorPool(NoProvider(), LeastRequests(), autoscale=True, sleep=policy)  # type: ignore[arg-type]
        fleet = pool.fleet
        fleet.deploys.functions["sd"] = StoredFunction(spec("tiny-sd", "sd"), {})
        ready = ExecutorHandle(FakeProcess("exec-0"), model=SD)
        ready.phase = ExecutorPhase.READY
        fleet.executors.append(ready)
        seen = [fleet.model_loads()[SD].startup_s]
        fleet.startups.started(SD, 30.0)
        seen.append(fleet.model_loads()[SD].startup_s)
        fleet.startups.woke(SD, 1.0)
        seen.append(fleet.model_loads()[SD].startup_s)
        await pool.link.close()
        return seen

    assert asyncio.run(loads(sleep=False)) == [0.0, 30.0, 30.0]
    assert asyncio.run(loads(sleep=True)) == [0.0, 0.0, 1.0]  # no wake measured: 0

    for startup_s, idle_s in ((20.0, 20.0), (0.0, 10.0)):
        pool = FakePool([spec("tiny-sd", "sd")], devices=1)
        clock = [0.0]
        scaler = PoolScaler(pool, clock=lambda clock=clock: clock[0])
        pool.loads = {SD: ModelLoad(0.0, 1, 0, startup_s)}
        scaler.tick(["cpu"])  # from zero: one at once
        pool.loads = {SD: ModelLoad(0.0, 0, 1, startup_s)}  # idle from here
        while not pool.retired:
            clock[0] += 1.0
            scaler.tick(["cpu"])
            assert clock[0] < 60, "never scaled to zero"
        assert clock[0] == pytest.approx(idle_s, abs=1.0), startup_s
        assert scaler.describe()["models"][SD]["startup_s"] == startup_s
