"""Real autoscaling on this machine (``retouch serve --autoscale``): from zero executors, a
first invocation is answered after a cold start (held in the gateway queue, never 503); a
step in load brings a second executor up; when the load falls one is drained and stopped
without losing or failing an invocation; idle, the pool goes back to zero. With sleep
(the default), scaled-down executors sleep instead: an invocation at a pool of sleepers
wakes one (the same process, far faster than its cold start), and one that dies while it
is woken is started again, its invocation answered."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from retouch.functions.spec import ScalingSpec
from retouch.platform.api.client import Client, read_spec_file
from retouch.platform.api.server import ServerProcess
from tests.e2e.loadgen import Load
from tests.support import WAIT_S, wait_for

pytestmark = pytest.mark.slow

SCALING = ScalingSpec(
    min_executors=0,
    max_executors=2,
    target_s=0.25,  # tiny-flux at 16 steps: ~0.05 s of predicted work alone, ~0.5 s under 12
    upscale_delay_s=2.0,
    stable_window_s=3.0,
    downscale_delay_s=2.0,
    downscale_to_zero_delay_s=3.0,
)


# least-requests: a new executor gets work at once (maskaware may keep a light step on the
# executor that holds the template warm, which is placement's call, not scaling's). One
# torch thread per executor: two executors with two threads each on a loaded 2-core
# machine run small models many times slower, and this is about the control plane.
ARGS = ["--autoscale", "--placement", "least-requests", "--threads", "1"]


def _phases(client: Client) -> list[str]:
    return [e["phase"] for e in client.executors()["executors"]]


def _pool_metric(server: ServerProcess, quantity: str) -> float:
    metrics = httpx.get(server.metrics_url).text
    return float(metrics.split(f'retouch_pool{{quantity="{quantity}"}}')[1].split()[0])


def test_scale_from_zero_up_down_and_back_to_zero(tmp_path: Path, examples: Path) -> None:
    spec, images = read_spec_file(examples / "tiny-flux.toml")
    # No SLO: admission would refuse the edits a loaded machine predicts late, and this
    # test is about scaling, not admission.
    spec = dataclasses.replace(spec, name="scaled", steps=16, scaling=SCALING, slo_ms=None)
    mask = np.zeros((128, 128), bool)
    mask[16:80, 24:88] = True

    def invoke(client: Client, seed: int) -> object:
        return client.invoke("scaled", "shirt", mask, "a red shirt", seed=seed, format="raw")

    # scaled-down executors stop (no sleep): the pool really goes back to zero processes
    server = ServerProcess(
        tmp_path / "data", executors=2, extra_args=[*ARGS, "--sleep-keep-s", "0"]
    )
    with server, Client(server.url) as client:
        assert _phases(client) == []  # nothing runs before there is work
        client.deploy(spec, images)
        assert _phases(client) == []
        assert client.executors()["autoscaler"]["config"]["max_executors"] == 2

        first = invoke(client, 0)  # held while exec-0 starts: answered, not 503
        assert first.path in ("stock", "maskaware") and first.executor == "exec-0"

        with Load(server.url, invoke, clients=12) as step:
            # two cold starts' worth: a second process, imports, model and workers on a
            # machine the 12 clients keep busy
            wait_for(
                "a second executor",
                lambda: _phases(client).count("ready") == 2,
                timeout=2 * WAIT_S,
                detail=lambda: _phases(client),
            )
            # Placement sends it work once that pays (it bakes the template first).
            wait_for("the second executor serving", lambda: any(
                r.executor == "exec-1" for r in list(step.results)
            ))  # fmt: skip
        assert not step.errors, step.errors[:3]

        # A trickle (one client, thinking 0.5 s): in flight during the drain, and light
        # enough for one executor however slow a loaded machine makes an invocation.
        with Load(server.url, invoke, clients=1, pause_s=0.5) as light:
            wait_for("a scale-down to one executor", lambda: len(_phases(client)) == 1)
            time.sleep(1.0)
        assert not light.errors, light.errors[:3]
        assert light.results

        wait_for("scale to zero when idle", lambda: _phases(client) == [])
        scaler = client.executors()["autoscaler"]
        changes = [e["change"] for e in scaler["events"]]
        assert changes[0] > 0 and min(changes) < 0, scaler["events"]
        again = invoke(client, 1)  # and back from zero
        assert again.path in ("stock", "maskaware")
        metrics = httpx.get(server.metrics_url).text
        for line in ('retouch_pool{quantity="scale_ups"}', 'retouch_pool{quantity="scale_downs"}'):
            assert float(metrics.split(line)[1].split()[0]) >= 2  # up twice, down twice
        assert float(metrics.split('retouch_pool{quantity="startup_s_p50"}')[1].split()[0]) > 0


def test_per_model_pools_scale_apart_and_share_the_devices(tmp_path: Path, examples: Path) -> None:
    """Two functions on two models, each ``max_executors = 1``, two CPU slots: invoking one
    starts one executor for its model only; invoking the other starts a second for the
    other model; each function is answered only by its model's executor; idle, both model
    pools go back to zero, their executors asleep. An invocation wakes its model's sleeper
    (the same process); one whose sleeper dies while it is woken is answered by the
    executor started again."""
    sd_model, flux_model = "retouch:tiny-sd", "retouch:tiny-flux"
    scaling = dataclasses.replace(SCALING, max_executors=1)
    sd, sd_images = read_spec_file(examples / "tiny-sd.toml")
    sd = dataclasses.replace(sd, name="sd-pool", steps=4, scaling=scaling, slo_ms=None)
    flux, flux_images = read_spec_file(examples / "tiny-flux.toml")
    flux = dataclasses.replace(flux, name="flux-pool", steps=4, scaling=scaling, slo_ms=None)
    mask = np.zeros((128, 128), bool)
    mask[16:80, 24:88] = True

    def invoke_sd(client: Client, seed: int) -> object:
        return client.invoke("sd-pool", "street", mask, "a red door", seed=seed, format="raw")

    def invoke_flux(client: Client, seed: int) -> object:
        return client.invoke("flux-pool", "shirt", mask, "a red shirt", seed=seed, format="raw")

    def models(client: Client) -> dict[str, str | None]:
        """The awake executors and their models (sleepers are no pool's capacity)."""
        rows = client.executors()["executors"]
        return {e["name"]: e["model"] for e in rows if e["phase"] != "sleeping"}

    def phase(name: str) -> str | None:
        rows = {e["name"]: e["phase"] for e in client.executors()["executors"]}
        return rows.get(name)

    def sleepers(client: Client) -> dict[str, int]:
        """Sleeping executors and their processes (None: its state did not answer)."""
        rows = client.executors()["executors"]
        return {
            e["name"]: e["state"] and e["state"]["pid"] for e in rows if e["phase"] == "sleeping"
        }

    server = ServerProcess(tmp_path / "data", executors=2, extra_args=ARGS)
    with server, Client(server.url) as client:
        client.deploy(sd, sd_images)
        client.deploy(flux, flux_images)
        assert models(client) == {}

        first = invoke_sd(client, 0)  # held while an executor for tiny-sd starts
        assert first.executor == "exec-0"
        assert models(client) == {"exec-0": sd_model}  # exactly one, and not for flux
        pools = client.executors()["autoscaler"]["models"]
        assert pools[sd_model]["executors"] == ["exec-0"]
        assert pools[flux_model]["executors"] == [] and pools[flux_model]["desired"] == 0
        assert pools[flux_model]["config"]["max_executors"] == 1

        # A steady client keeps tiny-sd's pool busy (the policy sees work at every tick, so
        # it does not go idle) while flux's pool starts on the other device.
        with Load(server.url, invoke_sd, clients=1) as trickle:
            second = invoke_flux(client, 1)
            assert second.executor == "exec-1"
            assert models(client) == {"exec-0": sd_model, "exec-1": flux_model}
            again = invoke_flux(client, 2)
            assert again.executor == "exec-1"
        assert not trickle.errors, trickle.errors[:3]
        assert trickle.results and {r.executor for r in trickle.results} == {"exec-0"}

        wait_for("both model pools back to zero", lambda: models(client) == {})
        pools = client.executors()["autoscaler"]["models"]
        for model in (sd_model, flux_model):
            changes = [e["change"] for e in pools[model]["events"] if e["applied"]]
            assert changes and max(changes) == 1 and min(changes) < 0, pools[model]["events"]
            assert pools[model]["no_device"] == 0  # two devices, one each: never short
        metrics = httpx.get(server.metrics_url).text
        for model in (sd_model, flux_model):
            line = f'retouch_model_pool{{model="{model}",quantity="scale_ups"}}'
            assert float(metrics.split(line)[1].split()[0]) == 1, pools
        assert float(metrics.split('retouch_pool{quantity="scale_ups"}')[1].split()[0]) == 2

        # Both asleep: an invocation of tiny-sd wakes exec-0, the same process.
        def both_asleep() -> dict[str, int] | None:
            asleep = sleepers(client)
            return asleep if len(asleep) == 2 and all(asleep.values()) else None

        asleep = wait_for("both executors asleep", both_asleep)
        # While tiny-sd's pool sleeps, a function is added to it and another deleted: the
        # wake pushes the one and drops the other.
        client.deploy(dataclasses.replace(sd, name="sd-late"), sd_images)
        client.delete("sd-pool")
        woken = client.invoke("sd-late", "street", mask, "a red door", seed=3, format="raw")
        assert woken.executor == "exec-0"
        rows = {e["name"]: e for e in client.executors()["executors"]}
        assert rows["exec-0"]["state"]["pid"] == asleep["exec-0"]  # woken, not started again
        assert rows["exec-0"]["state"]["sleep"]["wakes"] == 1

        def held() -> list[str]:
            rows = {e["name"]: e for e in client.executors()["executors"]}
            return rows["exec-0"]["state"]["functions"]

        wait_for("the deleted function dropped from the woken executor",
                 lambda: held() == ["sd-late"], detail=held)  # fmt: skip
        assert _pool_metric(server, "wakes") == 1
        wake_s, cold_s = _pool_metric(server, "wake_s_max"), _pool_metric(server, "startup_s_max")
        assert 0 < wake_s < cold_s / 5, (wake_s, cold_s)

        # The flux sleeper dies while it is woken: frozen (SIGSTOP), so that its wake hangs,
        # and SIGKILLed once the gateway says it is waking. The invocation that woke it
        # waits in the gateway queue; the monitor starts the executor again, which answers.
        frozen = asleep["exec-1"]
        os.kill(frozen, signal.SIGSTOP)
        with ThreadPoolExecutor(1) as threads, Client(server.url) as other:
            pending = threads.submit(invoke_flux, other, 4)
            wait_for("the flux sleeper waking", lambda: phase("exec-1") == "waking")
            os.kill(frozen, signal.SIGKILL)
            revived = pending.result(timeout=2 * WAIT_S)
        assert revived.executor == "exec-1" and models(client)["exec-1"] == flux_model
        rows = {e["name"]: e for e in client.executors()["executors"]}
        # a new process: restarted by the monitor, or stopped and started cold, whichever
        # saw the death first
        assert rows["exec-1"]["state"]["pid"] != frozen
