"""Async jobs end to end on real processes: queue positions, engine step progress over SSE,
results equal to the synchronous invoke, cancel of a queued and of a running job, signed
webhooks with retries behind the allow-list, ``Prefer: wait``, the CLI and bad input.

One server for the file: one executor, ``--max-batch 2`` (4 slots: the batch plus its
pre-processing buffer), every step reported (``--progress-interval 0``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import io
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
import replicate
from PIL import Image
from replicate.exceptions import ReplicateError
from replicate.helpers import FileOutput
from replicate.webhook import InvalidSignatureError, Webhooks

from retouch.functions.errors import Canceled, RetouchError
from retouch.functions.imaging import encode_mask
from retouch.functions.wire.invoke import InvokeResult
from retouch.functions.wire.jobs import JobEvent, JobEventKind
from retouch.platform.api.client import AsyncClient, Call, Client, read_spec_file
from retouch.platform.api.server import ServerProcess
from retouch.platform.jobs import webhooks
from retouch.platform.lab.bench.load import wait_baked
from tests.support import CliRun, run_cli, wait_for

from .conftest import ADMIN, INVOKE, TOKENS
from .receiver import Receiver

FUNCTION, TEMPLATE, STEPS = "jobs-sd", "street", 3
BLOCKER_STEPS = 16  # long enough to cancel one mid-run
SECRET = "test-webhook-secret"
MASK = np.zeros((128, 128), bool)
MASK[24:88, 16:80] = True
MAX_PIXEL_DIFF = 3  # a request batched with others differs from its solo run by rounding only


@pytest.fixture(scope="module")
def server(data_dir: Path, examples: Path) -> Iterator[ServerProcess]:
    env = {**TOKENS, "RETOUCH_WEBHOOK_SECRET": SECRET}
    args = ["--max-batch", "2", "--progress-interval", "0", "--fetch-allow", "127.0.0.0/8"]
    with ServerProcess(data_dir, env=env, extra_args=args) as proc:
        spec, images = read_spec_file(examples / "tiny-sd.toml")
        spec = dataclasses.replace(
            spec, name=FUNCTION, steps=STEPS, templates={TEMPLATE: spec.templates[TEMPLATE]}
        )
        with Client(proc.url, ADMIN) as admin:
            assert admin.deploy(spec, {TEMPLATE: images[TEMPLATE]})["status"] == "ready"
            wait_baked(admin, FUNCTION, timeout=300)
        yield proc


def pixels(result: InvokeResult) -> np.ndarray:
    return np.frombuffer(result.image, np.uint8).reshape(result.height, result.width, 3)


def same_image(a: InvokeResult, b: InvokeResult) -> bool:
    diff = np.abs(pixels(a).astype(int) - pixels(b).astype(int)).max()
    return diff <= MAX_PIXEL_DIFF


def submit(client: Client, seed: int, **options):
    return client.submit(FUNCTION, TEMPLATE, MASK, "a red door", seed=seed, format="raw", **options)


def sync_invoke(url: str, seed: int, steps: int | None = None) -> InvokeResult:
    options = {"steps": steps} if steps is not None else {}
    with Client(url, INVOKE) as client:
        return client.invoke(
            FUNCTION, TEMPLATE, MASK, "a red door", seed=seed, format="raw", **options
        )


def collect(url: str, job_id: str) -> list[JobEvent]:
    with Client(url, INVOKE) as client:
        return list(client.job_events(job_id))


def test_queue_positions_progress_results_and_cancel(server: ServerProcess) -> None:
    """4 blockers fill the executor's slots; 6 jobs then wait in the gateway queue. Each
    reports falling positions, steps 1..n in order and the sync invoke's image; a canceled
    queued job and a canceled running job end ``canceled``, the others are unaffected."""
    with Client(server.url, INVOKE) as client, ThreadPoolExecutor(16) as pool:
        blockers = [submit(client, 100 + i, steps=BLOCKER_STEPS) for i in range(4)]
        jobs = [submit(client, i) for i in range(6)]
        streams = {j.id: pool.submit(collect, server.url, j.id) for j in [*blockers, *jobs]}
        queued = jobs[5]
        assert queued.status()["status"] == "queued" and queued.doc["queue_position"] == 5
        assert queued.cancel()["status"] == "canceled"
        assert queued.cancel()["status"] == "canceled"  # idempotent

        running = blockers[0]
        wait_for(
            "the first blocker to take a step",
            lambda: (running.status().get("progress") or {}).get("step", 0) >= 1,
            120,
            0.05,
        )
        assert running.cancel()["status"] == "canceled"

        results = {j.id: j.wait(timeout=300) for j in [*blockers[1:], *jobs[:5]]}
        for job in (queued, running):
            with pytest.raises(Canceled):
                job.wait(timeout=10)
        events = {jid: f.result(timeout=60) for jid, f in streams.items()}
        seeds = {
            j.id: s
            for j, s in zip([*blockers, *jobs], [100, 101, 102, 103, *range(6)], strict=True)
        }
        steps = {j.id: BLOCKER_STEPS for j in blockers}
        compared = [blockers[1].id, *(j.id for j in jobs[:5])]  # the blockers run 16 steps
        references = dict(
            zip(
                compared,
                pool.map(lambda jid: sync_invoke(server.url, seeds[jid], steps.get(jid)), compared),
                strict=True,
            )
        )
        state = client.executors()["executors"][0]["state"]["engine"]

    exact = fell = 0
    for job in jobs[:5]:
        kinds = [e.kind for e in events[job.id]]
        positions = [e.data["position"] for e in events[job.id] if e.kind is JobEventKind.QUEUED]
        positions = [p for p in positions if p is not None]
        assert positions and positions == sorted(positions, reverse=True), positions
        # A job may leave position 1 for the batch between two 250 ms position events (two
        # slots freeing at once): its fall is then the STARTED event. Some job must be seen
        # falling while still queued (checked after the loop).
        fell += positions[-1] < positions[0]
        taken = [e.data["step"] for e in events[job.id] if e.kind is JobEventKind.PROGRESS]
        assert taken == list(range(1, STEPS + 1)), taken
        assert kinds[-1] is JobEventKind.SUCCEEDED
        assert kinds.index(JobEventKind.STARTED) < kinds.index(JobEventKind.PROGRESS)
        assert same_image(results[job.id], references[job.id])
        exact += results[job.id].image == references[job.id].image
    assert fell >= 1, "no queued job was seen moving up the queue"
    # the running batch's other job went on and its image is unchanged
    assert same_image(results[blockers[1].id], references[blockers[1].id])
    running_steps = [e.data["step"] for e in events[running.id] if e.kind is JobEventKind.PROGRESS]
    assert running_steps and running_steps[-1] < BLOCKER_STEPS, running_steps
    assert events[running.id][-1].kind is JobEventKind.CANCELED
    assert [e.kind for e in events[queued.id]][-1] is JobEventKind.CANCELED
    assert JobEventKind.STARTED not in [e.kind for e in events[queued.id]]
    assert state["canceled"] >= 1  # the engine dropped the running one from its batch
    print(f"exact images: {exact}/5; canceled running job after steps {running_steps}")


def test_prefer_wait_and_listing(server: ServerProcess) -> None:
    with Client(server.url, INVOKE) as client:
        job = submit(client, 7)
        t0 = time.monotonic()
        resp = httpx.get(
            f"{server.url}/v1/jobs/{job.id}",
            headers={"authorization": f"Bearer {INVOKE}", "prefer": "wait=60"},
            timeout=90,
        )
        assert resp.status_code == 200 and resp.headers["preference-applied"] == "wait=60"
        doc = resp.json()
        assert doc["status"] == "succeeded", doc
        assert doc["result"]["engine"]["steps"] == STEPS and time.monotonic() - t0 < 60
        assert doc["created_at"] <= doc["started_at"] <= doc["completed_at"]
        listed = client.jobs(status="succeeded", function=FUNCTION)
        assert job.id in [j["id"] for j in listed]
        assert all("image" not in j.get("result", {}) for j in listed)
        # the sync invoke is a job too, but not a kept one
        before = {j["id"] for j in client.jobs(limit=1000)}
        sync_invoke(server.url, 7)
        assert {j["id"] for j in client.jobs(limit=1000)} == before


def flaky_answer(path: str, n: int) -> int:
    """``/flaky`` answers 500 twice, then 200; every other path 200."""
    return 500 if path == "/flaky" and n <= 2 else 200


def test_webhooks_signed_retried_and_allow_listed(server: ServerProcess) -> None:
    with (
        Client(server.url, INVOKE) as client,
        Receiver(client.webhook_secret(), flaky_answer) as receiver,
    ):
        job = submit(
            client, 8, webhook=f"{receiver.url}/ok", webhook_events=["started", "completed"]
        )
        flaky = submit(client, 9, webhook=f"{receiver.url}/flaky")
        job.wait(timeout=120)
        flaky.wait(timeout=120)
        wait_for("two deliveries", lambda: len(receiver.delivered("/ok")) >= 2, 30, 0.05)
        wait_for("the flaky delivery", lambda: receiver.delivered("/flaky"), 30, 0.05)
        ok = receiver.delivered("/ok")
        assert [d["type"] for d in ok] == ["started", "completed"]
        assert ok[1]["job"]["status"] == "succeeded" and ok[1]["job"]["id"] == job.id
        assert receiver.calls("/flaky") == 3
        assert receiver.delivered("/flaky")[0]["job"]["id"] == flaky.id
        # a signature under another secret (the server's own included: deliveries are
        # signed with the tenant's), or a stale timestamp, does not verify
        first = receiver.arrivals[0]
        signature = first.headers["retouch-signature"]
        assert not webhooks.verify(b"other", first.raw, signature)
        assert not webhooks.verify(SECRET.encode(), first.raw, signature)
        assert not webhooks.verify(receiver.secret, first.raw, signature, now=time.time() + 3600)
        for url, code in (
            ("http://10.1.2.3/hook", "webhook_not_allowed"),
            ("http://192.168.0.1:8080/x", "webhook_not_allowed"),
            ("ftp://127.0.0.1/x", "invalid_field"),
            ("not a url", "invalid_field"),
        ):
            with pytest.raises(RetouchError) as err:
                submit(client, 1, webhook=url)
            assert (err.value.status, err.value.code, err.value.field) == (
                400,
                code,
                "webhook",
            ), url
    metrics = httpx.get(server.metrics_url).text
    assert 'retouch_webhook_deliveries{event="completed",outcome="delivered"}' in metrics
    assert 'retouch_webhook_deliveries{event="",outcome="retried"} 2.0' in metrics


def test_bad_input_on_job_endpoints(server: ServerProcess) -> None:
    auth = {"authorization": f"Bearer {INVOKE}"}
    unknown = "0" * 32
    with Client(server.url, INVOKE) as client:
        done = submit(client, 1)
        done.wait(timeout=120)
    cases = [
        ("GET", f"/v1/jobs/{unknown}", {}, 404, "job_not_found", "id"),
        ("GET", "/v1/jobs/not-a-job", {}, 400, "invalid_field", "id"),
        ("GET", f"/v1/jobs/{unknown}/events", {}, 404, "job_not_found", "id"),
        ("GET", "/v1/jobs/XYZ/events", {}, 400, "invalid_field", "id"),
        ("POST", f"/v1/jobs/{unknown}/cancel", {}, 404, "job_not_found", "id"),
        ("POST", f"/v1/jobs/{done.id}/cancel", {}, 409, "job_finished", "id"),
        ("GET", f"/v1/jobs/{done.id}", {"prefer": "wait=abc"}, 400, "invalid_field", "Prefer"),
        ("GET", f"/v1/jobs/{done.id}", {"prefer": "wait=3600"}, 400, "invalid_field", "Prefer"),
        ("GET", f"/v1/jobs/{done.id}/events", {"last-event-id": "x"}, 400, "invalid_field", "Last-Event-ID"),
        ("GET", "/v1/jobs?status=done", {}, 400, "invalid_field", "status"),
        ("GET", "/v1/jobs?limit=0", {}, 400, "invalid_field", "limit"),
        ("GET", "/v1/jobs?limit=x", {}, 400, "invalid_field", "limit"),
    ]  # fmt: skip
    for method, path, headers, status, code, field in cases:
        resp = httpx.request(method, server.url + path, headers={**auth, **headers})
        assert resp.status_code == status, (path, resp.text)
        assert resp.json()["error"]["code"] == code and resp.json()["error"]["field"] == field
    with Client(server.url, INVOKE) as client:
        for body, field in (
            ({"webhook_events": ["finished"]}, "webhook_events"),
            ({"webhook_events": []}, "webhook_events"),
            ({"webhook": 5}, "webhook"),
            ({"template": "nope"}, "template"),
            ({"seed": -1}, "seed"),
        ):
            call_body = {"template": TEMPLATE, "mask": _png(MASK), "prompt": "x", "seed": 1}
            with pytest.raises(RetouchError) as err:
                client.call(Call("POST", f"/v1/functions/{FUNCTION}/jobs", {**call_body, **body}))
            assert err.value.field == field and 400 <= err.value.status < 500
        with pytest.raises(RetouchError) as err:
            client.submit("no-such-fn", TEMPLATE, MASK, "x")
        assert err.value.code == "function_not_found"
    # tokens are checked on every job endpoint
    assert httpx.get(f"{server.url}/v1/jobs").status_code == 401
    assert httpx.get(f"{server.url}/v1/jobs/{done.id}/events").status_code == 401
    assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}


def test_cli_async_watch_ls_cancel(
    server: ServerProcess,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mask = tmp_path / "mask.png"
    mask.write_bytes(_png(MASK))
    monkeypatch.setenv("RETOUCH_URL", server.url)
    monkeypatch.setenv("RETOUCH_TOKEN", INVOKE)

    def cli(*args: str) -> CliRun:
        return run_cli(capsys, *args)

    submitted = cli(
        "invoke", FUNCTION, "--template", TEMPLATE, "--mask", str(mask), "--prompt", "x", "--async"
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split()[0]
    out = tmp_path / "out.png"
    watched = cli("jobs", "watch", job_id, "-o", str(out))
    assert watched.returncode == 0, watched.stderr
    assert "succeeded" in watched.stdout and out.stat().st_size > 0
    assert f"{STEPS}/{STEPS}" in watched.stderr  # the progress bar reached the end
    listed = cli("jobs", "ls")
    assert job_id in listed.stdout and "succeeded" in listed.stdout
    canceled = cli("jobs", "cancel", job_id)
    assert canceled.returncode == 1 and "job_finished" in canceled.stderr

    # diffusers' arguments as flags, and --json on what a script parses
    submitted = cli(
        "invoke", FUNCTION, "--template", TEMPLATE, "--mask", str(mask), "--prompt", "x",
        "--negative-prompt", "blurry", "--num-inference-steps", "2", "--guidance-scale", "3",
        "--strength", "0.5", "--scheduler", "ddim", "--async", "--json",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    doc = json.loads(submitted.stdout)
    assert doc["input"] | {"negative_prompt": "blurry", "num_inference_steps": 2} == doc["input"]
    assert (doc["input"]["guidance_scale"], doc["input"]["strength"]) == (3.0, 0.5)
    assert doc["input"]["scheduler"] == "ddim"  # the function's own, named
    watched = cli("jobs", "watch", doc["id"], "--json")
    assert watched.returncode == 0, watched.stderr
    finished = json.loads(watched.stdout)
    assert finished["status"] == "succeeded" and finished["output"].startswith(server.url)
    assert finished["result"]["engine"]["steps"] == 1  # int(2 * 0.5): strength cuts the schedule
    canceled = cli("jobs", "cancel", doc["id"], "--json")
    assert canceled.returncode == 1 and "job_finished" in canceled.stderr
    bad = cli("invoke", FUNCTION, "--template", TEMPLATE, "--mask", str(mask), "--prompt", "x",
              "--strength", "1.5")  # fmt: skip
    assert bad.returncode == 2 and "(0, 1]" in bad.stderr and "Traceback" not in bad.stderr


def test_cli_deploy_waits_until_templates_are_baked(
    server: ServerProcess,
    examples: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = (examples / "tiny-sd.toml").read_text()
    spec = spec.replace('name = "tiny-sd"', 'name = "baked-sd"').replace("steps = 4", "steps = 2")
    spec = spec.replace('image = "templates/', f'image = "{examples}/templates/')
    path = tmp_path / "baked-sd.toml"
    path.write_text(spec)
    monkeypatch.setenv("RETOUCH_URL", server.url)
    monkeypatch.setenv("RETOUCH_TOKEN", ADMIN)
    out = run_cli(capsys, "deploy", str(path))
    assert out.returncode == 0, out.stderr
    assert "baked-sd: ready, 2/2 templates baked" in out.stdout
    assert "baking templates" in out.stderr and "2/2" in out.stderr
    listing = run_cli(capsys, "ls").stdout
    row = next(line for line in listing.splitlines() if line.startswith("baked-sd"))
    assert row.endswith("street (baked), poster (baked)"), row
    # the same spec again (nothing changes), its document as JSON for a script
    out = run_cli(capsys, "deploy", str(path), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["name"] == "baked-sd" and doc["status"] == "ready"
    assert {t["state"] for t in doc["templates"].values()} == {"baked"}


def _png(mask: np.ndarray) -> bytes:
    return encode_mask(mask)


def test_async_client_job_handle(server: ServerProcess) -> None:
    async def run() -> tuple[list[JobEvent], InvokeResult, dict]:
        async with AsyncClient(server.url, INVOKE) as client:
            job = await client.submit(FUNCTION, TEMPLATE, MASK, "a red door", seed=3, format="raw")
            events = [e async for e in job.events()]
            result = await job.wait(timeout=120)
            return events, result, await job.status()

    events, result, doc = asyncio.run(run())
    assert events[-1].kind is JobEventKind.SUCCEEDED and doc["status"] == "succeeded"
    assert [e.data["step"] for e in events if e.kind is JobEventKind.PROGRESS] == [1, 2, 3]
    assert same_image(result, sync_invoke(server.url, 3))


def curl(*args: str, data: str | None = None) -> tuple[int, bytes]:
    """``curl`` itself (no Python client, no msgpack): the status and the body."""
    out = subprocess.run(
        ["curl", "-sS", "-w", "\\n%{http_code}", *args],
        input=None if data is None else data.encode(),
        capture_output=True,
        check=True,
        timeout=120,
    ).stdout
    body, _, status = out.rpartition(b"\n")
    return int(status), body


@contextlib.contextmanager
def serve_files(folder: Path) -> Iterator[str]:
    """``folder`` over HTTP on loopback (where a user's images would be hosted)."""
    handler = functools.partial(QuietFiles, directory=str(folder))
    files = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{files.server_address[1]}"
    finally:
        files.shutdown()


class QuietFiles(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def test_curl_alone_invokes_submits_follows_fetches_and_cancels(
    server: ServerProcess, tmp_path: Path
) -> None:
    """What a shell user does with curl and JSON: an invoke, a job (its mask a data URI)
    followed over SSE, its ``output`` link fetched without a token, and a cancel."""
    auth = ["-H", f"authorization: Bearer {INVOKE}", "-H", "content-type: application/json"]
    mask = base64.b64encode(encode_mask(MASK)).decode()
    body = {"template": TEMPLATE, "prompt": "a red door", "seed": 5, "mask": mask}
    fn = f"{server.url}/v1/functions/{FUNCTION}"

    status, answer = curl(*auth, "-d", "@-", f"{fn}/invoke", data=json.dumps(body))
    assert status == 200, answer
    invoked = json.loads(answer)
    assert invoked["path"] == "maskaware" and invoked["format"] == "png"
    direct = np.asarray(Image.open(io.BytesIO(base64.b64decode(invoked["image"]))))
    # the mask as a URL (this server fetches from loopback: --fetch-allow): the same edit
    (tmp_path / "mask.png").write_bytes(encode_mask(MASK))
    with serve_files(tmp_path) as files:
        by_url = {**body, "mask": f"{files}/mask.png"}
        status, answer = curl(*auth, "-d", "@-", f"{fn}/invoke", data=json.dumps(by_url))
    assert status == 200 and json.loads(answer)["image"] == invoked["image"], answer

    job_body = {**body, "mask": f"data:image/png;base64,{mask}", "num_inference_steps": STEPS}
    status, answer = curl(*auth, "-d", "@-", f"{fn}/jobs", data=json.dumps(job_body))
    assert status == 202, answer
    job = json.loads(answer)
    assert job["input"]["num_inference_steps"] == STEPS and job["input"]["seed"] == 5
    assert job["input"]["mask"].endswith(" bytes>")  # the echo holds no payload

    status, stream = curl(
        "-N", "-H", f"authorization: Bearer {INVOKE}", server.url + job["urls"]["stream"]
    )
    assert status == 200
    events = [
        line.partition(b": ")[2] for line in stream.splitlines() if line.startswith(b"event:")
    ]
    assert events[-1] == b"succeeded", events
    last = json.loads(stream.split(b"data: ")[-1].splitlines()[0])
    assert "image" not in last["result"]  # events carry the link, not the bytes
    assert last["output"].startswith(f"{server.url}/v1/images/{job['id']}.png?")
    assert last["metrics"]["inference_steps"] == STEPS and "predict_time" in last["metrics"]
    assert "succeeded on" in last["logs"]

    status, png = curl(last["output"])  # no token: the link's signature is the authorization
    assert status == 200
    fetched = np.asarray(Image.open(io.BytesIO(png)))
    assert np.abs(fetched.astype(int) - direct.astype(int)).max() <= MAX_PIXEL_DIFF
    status, answer = curl(last["output"].replace("sig=", "sig=0"))
    assert status == 400 and json.loads(answer)["error"]["field"] == "sig"

    long = {**job_body, "num_inference_steps": 200}
    _, answer = curl(*auth, "-d", "@-", f"{fn}/jobs", data=json.dumps(long))
    cancel_url = server.url + json.loads(answer)["urls"]["cancel"]
    status, answer = curl(*auth, "-X", "POST", cancel_url)
    assert status == 200 and json.loads(answer)["status"] == "canceled", answer
    assert json.loads(answer)["output"] is None


def png_pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)


def test_replicate_client_drives_predictions(server: ServerProcess) -> None:
    """Replicate's own Python client pointed at the gateway: create (by model and by
    version), poll, ``Prefer: wait``, ``replicate.run``, stream, cancel, list, and a webhook
    its ``Webhooks.validate`` accepts with the key of ``/v1/webhooks/default/secret``. A
    prediction is the job of the same id."""
    client = replicate.Client(api_token=INVOKE, base_url=server.url)
    mask = "data:image/png;base64," + base64.b64encode(encode_mask(MASK)).decode()
    inputs = {"template": TEMPLATE, "mask": mask, "prompt": "a red door", "seed": 21}
    with Client(server.url, INVOKE) as native, Receiver(native.webhook_secret()) as receiver:
        created = client.predictions.create(
            model=f"acme/{FUNCTION}",
            input=inputs,
            webhook=f"{receiver.url}/hook",
            webhook_events_filter=["start", "completed"],
        )
        assert created.status in ("starting", "processing") and created.model.endswith(FUNCTION)
        created.wait()  # polls GET /v1/predictions/{id}
        assert created.status == "succeeded" and created.error is None, created.logs
        assert created.output.startswith(f"{server.url}/v1/images/{created.id}.png?")
        assert created.metrics["inference_steps"] == STEPS and "predict_time" in created.metrics
        assert native.job(created.id).status()["output"] == created.output  # the same job

        waited = client.predictions.create(version=FUNCTION, input=inputs, wait=60)
        assert waited.status == "succeeded"  # answered once it ended: Prefer: wait=60

        output = client.run(f"retouch/{FUNCTION}", input=inputs)  # bare Prefer: wait
        # an https output becomes a FileOutput by itself; this server's is http
        image = FileOutput(output, client).read()
        first = FileOutput(created.output, client).read()
        assert np.abs(png_pixels(image) - png_pixels(first)).max() <= MAX_PIXEL_DIFF

        streamed = client.predictions.create(model=f"retouch/{FUNCTION}", input=inputs)
        events = [(e.event.value, str(e.data)) for e in streamed.stream()]
        assert events[-2:] == [("output", events[-2][1]), ("done", "{}")], events
        bars = [d.rsplit(" ", 1)[-1] for k, d in events if k == "logs" and "%|" in d]
        assert bars == [f"{step}/{STEPS}" for step in range(1, STEPS + 1)], events
        streamed.reload()
        assert events[-2][1] == streamed.output

        long = {**inputs, "num_inference_steps": 200}
        doomed = client.predictions.create(model=f"retouch/{FUNCTION}", input=long)
        doomed.cancel()
        assert doomed.status == "canceled" and doomed.output is None

        listed = [p.id for p in client.predictions.list()]
        assert listed.index(doomed.id) < listed.index(streamed.id) < listed.index(created.id)
        first = httpx.get(
            f"{server.url}/v1/predictions?limit=2", headers={"authorization": f"Bearer {INVOKE}"}
        ).json()
        second = client.predictions.list(first["next"])  # the client follows the cursor
        assert [p["id"] for p in first["results"]] == listed[:2]
        assert [p.id for p in second][:2] == listed[2:4]

        secret = client.webhooks.default.secret()
        assert secret.key.startswith("whsec_")
        hooks = wait_for("2 webhooks", lambda: receiver.accepted()[1:] and receiver.accepted(), 60)
        bodies = [a.body for a in hooks]
        assert [b["status"] for b in bodies] == ["processing", "succeeded"], bodies
        assert bodies[1]["output"] == created.output and bodies[1]["id"] == created.id
        for arrival in hooks:
            Webhooks.validate(headers=arrival.headers, body=arrival.raw.decode(), secret=secret)
        with pytest.raises(InvalidSignatureError):
            Webhooks.validate(headers=hooks[0].headers, body="{}", secret=secret)

        with pytest.raises(ReplicateError) as err:
            client.predictions.create(model=f"acme/{FUNCTION}", input={**inputs, "seed": -1})
        assert err.value.status == 400 and "input.seed" in (err.value.detail or "")


def test_bad_input_on_prediction_routes(server: ServerProcess) -> None:
    """Every new route and field: a structured 4xx naming the field, in retouch's error
    object and in the problem-details fields Replicate's client reads."""
    auth = {"authorization": f"Bearer {INVOKE}"}
    mask = base64.b64encode(encode_mask(MASK)).decode()
    good = {"template": TEMPLATE, "mask": mask, "prompt": "x", "seed": 1}
    with Client(server.url, INVOKE) as client:
        done = submit(client, 1)
        done.wait(timeout=120)
    unknown = "0" * 32
    create, by_model = "/v1/predictions", f"/v1/models/acme/{FUNCTION}/predictions"
    cases = [
        ("POST", create, {"input": good}, 400, "missing_field", "version"),
        ("POST", create, {"version": FUNCTION, "model": FUNCTION, "input": good}, 400, "invalid_field", "version"),
        ("POST", create, {"version": "no-such-fn", "input": good}, 404, "function_not_found", "version"),
        ("POST", create, {"model": "a/b/c", "input": good}, 400, "invalid_field", "model"),
        ("POST", create, {"version": FUNCTION}, 400, "missing_field", "input"),
        ("POST", create, {"version": FUNCTION, "input": good, "webhook_completed": "x"}, 400, "unknown_field", "webhook_completed"),
        ("POST", create, {"version": FUNCTION, "input": {**good, "prompt": 5}}, 400, "invalid_field", "input.prompt"),
        ("POST", create, {"version": FUNCTION, "input": {**good, "colour": 1}}, 400, "unknown_field", "input.colour"),
        ("POST", create, {"version": FUNCTION, "input": {**good, "template": "nope"}}, 404, "template_not_found", "input.template"),
        ("POST", create, {"version": FUNCTION, "input": {**good, "mask": "bm90IGEgcG5n"}}, 400, "undecodable_image", "input.mask"),
        ("POST", create, {"version": FUNCTION, "input": good, "stream": "yes"}, 400, "invalid_field", "stream"),
        ("POST", create, {"version": FUNCTION, "input": good, "webhook_events_filter": ["begin"]}, 400, "invalid_field", "webhook_events_filter"),
        ("POST", create, {"version": FUNCTION, "input": good, "webhook": "http://10.1.2.3/h"}, 400, "webhook_not_allowed", "webhook"),
        ("POST", "/v1/models/bad%20owner/x/predictions", {"input": good}, 400, "invalid_field", "owner"),
        ("POST", "/v1/models/acme/no-such-fn/predictions", {"input": good}, 404, "function_not_found", "name"),
        ("POST", by_model, {"version": FUNCTION, "input": good}, 400, "unknown_field", "version"),
        ("GET", "/v1/predictions/not-an-id", None, 400, "invalid_field", "id"),
        ("GET", f"/v1/predictions/{unknown}", None, 404, "job_not_found", "id"),
        ("GET", f"/v1/predictions/{unknown}/stream", None, 404, "job_not_found", "id"),
        ("POST", f"/v1/predictions/{done.id}/cancel", None, 409, "job_finished", "id"),
        ("GET", "/v1/predictions?cursor=zzz", None, 400, "invalid_field", "cursor"),
        ("GET", "/v1/predictions?limit=0", None, 400, "invalid_field", "limit"),
    ]  # fmt: skip
    for method, path, body, status, code, field in cases:
        resp = httpx.request(method, server.url + path, headers=auth, json=body)
        assert resp.status_code == status, (path, body, resp.text)
        doc = resp.json()
        assert (doc["error"]["code"], doc["error"]["field"]) == (code, field), (path, body)
        assert (doc["status"], doc["title"]) == (status, code) and field in doc["detail"]
    resp = httpx.post(server.url + create, headers={**auth, "prefer": "wait=abc"}, json={})
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "Prefer"
    resp = httpx.get(f"{server.url}/v1/webhooks/default/secret")
    assert resp.status_code == 401 and resp.json()["title"] == "missing_token"
