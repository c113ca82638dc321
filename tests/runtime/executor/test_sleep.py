"""An executor's sleep state (``runtime/executor/sleep.py``) and the fleet's sleepers
(``platform/fleet/sleepers.py``): the transitions, what is refused in each, and which
sleeper a scale-up wakes or a bound stops."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from retouch.functions.errors import RetouchError
from retouch.functions.wire.executor import ExecutorPhase, SleepInfo, SleepMode
from retouch.platform.fleet.executorlink import ExecutorHandle
from retouch.platform.fleet.sleepers import Sleepers, SleepingExecutors, SleepPolicy
from retouch.platform.fleet.startups import StartupTimes
from retouch.runtime.executor.sleep import ExecutorSleep, Turn
from retouch.runtime.models import ModelCache


class Holders:
    """Counts what the sleep asked of the graphs and the device tier."""

    def __init__(self) -> None:
        self.released = self.retaken = 0

    def release_device(self) -> None:
        self.released += 1

    def retake_device(self) -> None:
        self.retaken += 1


def test_sleep_refuses_work_until_woken_and_counts_both(tmp_path: Path) -> None:
    work = [0]
    sleep = ExecutorSleep(ModelCache(tmp_path, torch.device("cpu")), Holders(), lambda: work[0])
    with sleep.awake():
        pass  # awake: work is handed over
    info = sleep.sleep()
    assert info.mode is SleepMode.ASLEEP and info.sleeps == 1 and sleep.turn is Turn.ASLEEP
    assert info.freed_bytes == 0  # a CPU keeps its weights where they are
    assert info.host_bytes > 0  # what it holds of the host, for the fleet's bound
    for refused in (sleep.awake().__enter__, sleep.kept_awake().__enter__):
        with pytest.raises(RetouchError) as err:
            refused()
        assert err.value.code == "executor_asleep" and err.value.status == 503
    assert sleep.sleep().sleeps == 1  # asleep already: nothing happens twice
    woken = sleep.wake()
    assert woken.mode is SleepMode.AWAKE and woken.wakes == 1 and woken.last_wake_ms >= 0
    with sleep.awake():
        pass
    assert sleep.wake().wakes == 1
    # what /state carries reads back on the gateway's side
    assert SleepInfo.from_wire(woken.to_wire()) == woken


def test_an_executor_with_work_in_hand_refuses_to_sleep(tmp_path: Path) -> None:
    sleep = ExecutorSleep(ModelCache(tmp_path, torch.device("cpu")), Holders(), lambda: 2)
    with pytest.raises(RetouchError) as err:
        sleep.sleep()
    assert err.value.code == "executor_busy" and err.value.status == 409
    assert sleep.turn is Turn.AWAKE


def test_a_deploy_under_way_keeps_the_executor_awake(tmp_path: Path) -> None:
    sleep = ExecutorSleep(ModelCache(tmp_path, torch.device("cpu")), Holders(), lambda: 0)
    with sleep.kept_awake():
        with pytest.raises(RetouchError) as err:
            sleep.sleep()
        assert err.value.code == "executor_busy"
    assert sleep.sleep().sleeps == 1  # once it ended


def test_an_older_executor_without_sleep_reads_as_awake() -> None:
    assert SleepInfo.from_wire({}).mode is SleepMode.AWAKE
    assert SleepInfo.from_wire({"mode": "hibernating"}).mode is SleepMode.AWAKE


@dataclass(eq=False)
class Handle:
    name: str
    model: str

    def serves(self, model: str | None) -> bool:
        return self.model == model


def test_a_scale_up_wakes_its_models_most_recent_sleeper() -> None:
    sleepers: Sleepers[Handle] = Sleepers(SleepPolicy(keep_s=60))
    a, b, c = Handle("exec-0", "sd"), Handle("exec-1", "sd"), Handle("exec-2", "flux")
    for t, h in enumerate((a, b, c)):
        assert sleepers.add(h, float(t), 100) == []
    assert sleepers.take("sd") is b and sleepers.take("sd") is a and sleepers.take("sd") is None
    assert len(sleepers) == 1 and c in sleepers
    assert sleepers.take_oldest() is c and sleepers.take_oldest() is None


def test_sleepers_stop_after_their_keep_time_and_over_the_host_bound() -> None:
    sleepers: Sleepers[Handle] = Sleepers(SleepPolicy(keep_s=10, host_bytes=250))
    a, b, c = Handle("exec-0", "sd"), Handle("exec-1", "sd"), Handle("exec-2", "sd")
    sleepers.add(a, 0.0, 100)
    sleepers.add(b, 5.0, 100)
    assert sleepers.add(c, 6.0, 100) == [a]  # 300 bytes > 250: the oldest stops
    assert sleepers.host_bytes() == 200
    assert sleepers.expired(14.0) == [] and sleepers.expired(15.0) == [b]
    assert sleepers.remove(c) and not sleepers.remove(c) and len(sleepers) == 0
    assert not SleepPolicy().enabled and SleepPolicy(keep_s=1).enabled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device given back is a GPU's")
def test_on_cuda_a_sleep_gives_the_weights_memory_back_and_a_wake_restores_it(
    models_dir: Path,
) -> None:
    """Run by ``make gpu-bench`` on a GPU machine."""
    device = torch.device("cuda")
    models = ModelCache(models_dir, device)
    pipe = models.get("retouch:tiny-sd", "sd-inpaint").pipe
    weight = next(pipe.unet.parameters())
    before = weight.detach().cpu().clone()
    holders = Holders()
    sleep = ExecutorSleep(models, holders, lambda: 0)
    info = sleep.sleep()
    assert info.freed_bytes > 0 and holders.released == 1
    assert weight.device.type == "cpu" and weight.is_pinned()
    woken = sleep.wake()
    assert weight.device == torch.device("cuda", 0) and holders.retaken == 1
    # copies only (device to host and back, no arithmetic): the same bits on any machine
    assert woken.last_wake_ms > 0 and torch.equal(weight.detach().cpu(), before)


class Process:
    def __init__(self, name: str) -> None:
        self.name, self.device, self.url, self.node = name, "cpu", "http://unused", "here"
        self.alive, self.exit_code = True, None


class Stops:
    """A provider that records what it was asked to stop."""

    token = ""

    def __init__(self) -> None:
        self.stopped: list[str] = []

    async def stop(self, process: Process, failed: bool = False) -> None:
        self.stopped.append(process.name)


def test_a_sleeper_that_dies_is_dropped_and_one_that_slept_its_time_is_stopped() -> None:
    async def run() -> tuple[Stops, list[ExecutorHandle]]:
        dead, old, young = (ExecutorHandle(Process(f"exec-{i}"), model="m") for i in range(3))
        executors, stops, tasks = [dead, old, young], Stops(), []
        sleeping = SleepingExecutors(
            SleepPolicy(keep_s=60),
            executors,
            link=None,  # type: ignore[arg-type]  # no call is made by check()
            provider=stops,  # type: ignore[arg-type]
            startups=StartupTimes(),
            ready=None,  # type: ignore[arg-type]
            on_capacity=lambda: None,
            in_background=lambda work: tasks.append(asyncio.ensure_future(work)),
        )
        for handle, since in ((dead, 50.0), (old, -100.0), (young, 50.0)):
            handle.phase = ExecutorPhase.SLEEPING
            sleeping.asleep.add(handle, time.monotonic() + since - 60, 1)
        dead.process.alive, dead.process.exit_code = False, -9
        sleeping.check()
        await asyncio.gather(*tasks)
        return stops, executors

    stops, left = asyncio.run(run())
    assert sorted(stops.stopped) == ["exec-0", "exec-1"]  # the dead one and the old one
    assert [h.name for h in left] == ["exec-2"]
