"""Jobs without processes: the store (run, progress throttling, events, cancel, retention,
journal resume), the journal's atomic records, Prefer parsing, SSE framing, webhook
signatures and allow-list, the queue's tags, and the job request's validation."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from pathlib import Path

import numpy as np
import pytest

from retouch.functions.errors import BadRequest, Canceled, Conflict, NotFound, RetouchError
from retouch.functions.wire.codec import RawArray, pack
from retouch.functions.wire.executor import (
    FrameReader,
    StepProgress,
    error_frame,
    progress_frame,
    result_frame,
)
from retouch.functions.wire.invoke import ExecutorInvoke, InvokePath, InvokeResult
from retouch.functions.wire.jobs import JobEvent, JobEventKind, JobRequest, JobStatus, WebhookEvent
from retouch.platform.api.httpapi import parse_prefer_wait
from retouch.platform.control.placement import LeastRequests, PlacementRequest
from retouch.platform.control.queue import InvocationQueue, QueueLimits
from retouch.platform.jobs import sse, webhooks
from retouch.platform.jobs.allowlist import AllowList
from retouch.platform.jobs.job import RUN_SEQ_SPAN, Job, PreparedInvocation
from retouch.platform.jobs.journal import JobJournal
from retouch.platform.jobs.resolver import Resolver
from retouch.platform.jobs.source import JobSource, JournaledJobs, MemoryJobs
from retouch.platform.jobs.store import JobStore
from retouch.platform.state.auth import OPEN, Principal


def sync(test: Callable[..., Coroutine]) -> Callable[..., None]:
    @functools.wraps(test)
    def run(*args, **kwargs) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


def request(seed: int = 1, **extra) -> JobRequest:
    return JobRequest.from_wire(
        {"template": "t", "mask": b"png", "prompt": "p", "seed": seed, **extra}
    )


def prepared(job_id: str = "") -> PreparedInvocation:
    mask = RawArray.of(np.ones((2, 2), np.uint8))
    inv = ExecutorInvoke(
        function="f",
        template="t",
        mask=mask,
        prompt="p",
        seed=1,
        steps=3,
        guidance=7.5,
        format="raw",
        id=job_id,
    )
    return PreparedInvocation(inv, PlacementRequest("f", "t", 1.0))


def result() -> InvokeResult:
    return InvokeResult(
        image=b"img",
        format="raw",
        width=2,
        height=2,
        mask_ratio=1.0,
        executor="exec-0",
        path=InvokePath.STOCK,
    )


class FakeRun:
    """An executor stand-in: starts, reports ``steps`` steps, then answers (or waits for
    a cancel when ``hold`` is set)."""

    def __init__(self, steps: int = 3, hold: bool = False, gated: bool = False) -> None:
        self.steps, self.hold = steps, hold
        self.canceled: set[str] = set()
        self.release = asyncio.Event()  # a gated run starts once it is set
        if not gated:
            self.release.set()

    async def execute(self, job: Job, on_start, on_progress) -> InvokeResult:
        await self.release.wait()
        on_start("exec-0", 1)
        for step in range(1, self.steps + 1):
            await asyncio.sleep(0)
            if job.id in self.canceled:
                raise Canceled("canceled")
            on_progress(StepProgress(step=step, total=self.steps))
        if self.hold:
            while job.id not in self.canceled:
                await asyncio.sleep(0.01)
            raise Conflict("canceled on the executor", code="canceled")
        return result()

    async def cancel(self, job_id: str) -> bool:
        self.canceled.add(job_id)
        return True


def store(
    run: FakeRun, journal: JobJournal | None = None, source: JobSource | None = None, **kw
) -> JobStore:
    """A job store of one gateway, journaled in ``journal`` if given (``source`` for
    several gateways)."""
    if source is None:
        source = MemoryJobs() if journal is None else JournaledJobs(journal)
    return JobStore(run.execute, dict, run.cancel, source, **kw)


async def stream(jobs: JobStore, job: Job, after: int = 0) -> list[JobEvent]:
    """A reader's events until the job's end."""
    return [e async for e in jobs.events(job, after) if e is not None]


@sync
async def test_a_job_runs_and_its_events_come_in_order() -> None:
    jobs = store(FakeRun(steps=4), progress_interval_s=0)
    await jobs.start()
    job = await jobs.submit("f", request(), prepared())
    events = await stream(jobs, job)  # a reader from the start, live until the end
    assert job.status is JobStatus.SUCCEEDED and job.result is not None
    kinds = [e.kind for e in events]
    assert kinds == [JobEventKind.QUEUED, JobEventKind.STARTED] + [JobEventKind.PROGRESS] * 4 + [
        JobEventKind.SUCCEEDED
    ]
    assert [e.seq for e in events] == list(range(1, 8))
    # with no stream reading it, a finished job keeps its last progress and terminal events
    assert job.events == events[-2:] and job.events[0].kind is JobEventKind.PROGRESS
    late = await stream(jobs, job, after=5)  # Last-Event-ID: 5
    assert [e.seq for e in late] == [6, 7]
    assert "image" not in job.events[-1].data["result"]
    doc = job.describe()
    assert doc["status"] == "succeeded" and doc["result"]["image"] == b"img"
    await jobs.close()


@sync
async def test_progress_events_are_throttled_but_the_last_step_always_comes() -> None:
    jobs = store(FakeRun(steps=50), progress_interval_s=60)
    await jobs.start()
    job = await jobs.submit("f", request(), prepared())
    events = await stream(jobs, job)
    steps = [e.data["step"] for e in events if e.kind is JobEventKind.PROGRESS]
    assert steps == [1, 50]
    await jobs.close()


@sync
async def test_cancel_is_idempotent_and_refused_once_finished() -> None:
    run = FakeRun(steps=1, hold=True)
    jobs = store(run)
    await jobs.start()
    job = await jobs.submit("f", request(), prepared())
    while job.status is JobStatus.QUEUED:
        await asyncio.sleep(0.01)
    assert (await jobs.cancel(job)).status is JobStatus.CANCELED
    assert (await jobs.cancel(job)).status is JobStatus.CANCELED
    assert job.events[-1].kind is JobEventKind.CANCELED
    done = await jobs.submit("f", request(), prepared())
    run.hold = False
    await jobs.wait(done, 5)
    with pytest.raises(Conflict) as err:
        await jobs.cancel(done)
    assert err.value.code == "job_finished" and err.value.field == "id"
    await jobs.close()


@sync
async def test_lookup_errors_name_the_id() -> None:
    jobs = store(FakeRun())
    with pytest.raises(BadRequest) as bad:
        await jobs.get("nope", OPEN)
    assert bad.value.field == "id"
    with pytest.raises(NotFound) as missing:
        await jobs.get("0" * 32, OPEN)
    assert missing.value.code == "job_not_found"


@sync
async def test_retention_removes_finished_jobs_and_their_records(tmp_path: Path) -> None:
    now = [1000.0]
    journal = JobJournal(tmp_path)
    jobs = store(FakeRun(), journal, retention_s=10, clock=lambda: now[0])
    await jobs.start()
    job = await jobs.submit("f", request(), prepared())
    await jobs.wait(job, 5)
    assert (tmp_path / f"{job.id}.job").exists()
    assert job.result is not None and job.result.image == b""  # kept on disk, not in memory
    assert (await jobs.document(job))["result"]["image"] == b"img"
    now[0] += 9
    assert await jobs.purge() == 0
    now[0] += 2
    assert await jobs.purge() == 1
    assert job.id not in jobs.jobs and not (tmp_path / f"{job.id}.job").exists()
    await jobs.close()


@sync
async def test_the_journal_resumes_unfinished_jobs_once(tmp_path: Path) -> None:
    journal = JobJournal(tmp_path)
    run = FakeRun(hold=True)
    jobs = store(run, journal)
    await jobs.start()
    finished = await jobs.submit("f", request(1), prepared())
    run.canceled.add(finished.id)
    await jobs.wait(finished, 5)
    pending = await jobs.submit("f", request(2, webhook="http://127.0.0.1:9/x"), prepared())
    await asyncio.sleep(0.05)
    assert pending.status is JobStatus.RUNNING
    terminal, last_seen = finished.events[-1], pending.events[-1].seq
    await jobs.close()  # a stopping gateway ends nothing

    gated = FakeRun(gated=True)
    again = store(gated, JobJournal(tmp_path))
    await again.start()
    resumed = again.jobs[pending.id]
    assert resumed.request.webhook == "http://127.0.0.1:9/x" and resumed.prepared is None
    # a reader resuming from its last id before the new run goes on
    reader = asyncio.create_task(stream(again, resumed, after=last_seen))
    await asyncio.sleep(0)
    gated.release.set()
    await again.wait(resumed, 5)
    assert resumed.status is JobStatus.SUCCEEDED
    assert again.jobs[finished.id].status is JobStatus.CANCELED
    # no waiting: well before the wait's own 30 s
    ended = await asyncio.wait_for(again.wait(again.jobs[finished.id], 30), 5)
    assert [e async for e in again.events(ended) if e is not None] == [terminal]  # same id
    # the resumed run's ids are above every id of the run before: a reader resuming from
    # its last id gets the whole new run, ending with the terminal event
    after = await reader
    assert after[-1] == resumed.events[-1] and after[0].seq > RUN_SEQ_SPAN
    assert [e.seq for e in after] == sorted({e.seq for e in after})
    assert [after[0].kind, after[-1].kind] == [JobEventKind.QUEUED, JobEventKind.SUCCEEDED]
    # an id the job never gave: the stream still ends with the terminal event
    beyond = [e async for e in again.events(ended, after=10**9) if e is not None]
    assert beyond == [terminal]
    await again.close()
    assert JobJournal(tmp_path).read(resumed.id)["run"] == 1


@sync
async def test_a_job_is_its_owners_and_outlives_a_restart_as_such(tmp_path: Path) -> None:
    """Another tenant's job is as unknown as a missing one; an admin sees every tenant's,
    and the owner is kept in the journal (a resumed job stays its owner's)."""
    alice, bob = Principal("alice", "invoke"), Principal("bob", "invoke")
    admin = Principal("ops", "admin")
    jobs = store(FakeRun(hold=True), JobJournal(tmp_path))
    await jobs.start()
    job = await jobs.submit("f", request(), prepared(), owner="alice")
    assert await jobs.get(job.id, alice) is job and await jobs.get(job.id, admin) is job
    with pytest.raises(NotFound) as hidden:
        await jobs.get(job.id, bob)
    with pytest.raises(NotFound) as missing:
        await jobs.get("0" * 32, bob)
    assert hidden.value.to_wire()["error"]["code"] == missing.value.to_wire()["error"]["code"]
    assert [j.id for j in await jobs.list(alice)] == [job.id] and await jobs.list(bob) == []
    assert [j.id for j in await jobs.list(admin, tenant="alice")] == [job.id]
    assert await jobs.list(admin, tenant="bob") == []
    await jobs.close()
    again = store(FakeRun(), JobJournal(tmp_path))
    await again.start()
    assert (await again.get(job.id, alice)).owner == "alice"
    with pytest.raises(NotFound):
        await again.get(job.id, bob)
    await again.close()


def test_a_webhook_url_stays_out_of_events_and_of_others_documents() -> None:
    job = Job("e" * 32, "f", request(webhook="http://127.0.0.1:9/x?key=s3cret"), 1.0)
    assert job.describe()["webhook"] == "http://127.0.0.1:9/x?key=s3cret"
    assert "webhook" not in job.describe(with_webhook=False)


def test_a_corrupt_record_is_set_aside(tmp_path: Path) -> None:
    journal = JobJournal(tmp_path)
    good = Job("a" * 32, "f", request(), 1.0)
    journal.write(good.to_record())
    (tmp_path / f"{'b' * 32}.job").write_bytes(b"\xc1garbage")
    (tmp_path / f".{'c' * 32}.job.tmp").write_bytes(b"half")
    assert [r["id"] for r in journal.load()] == ["a" * 32]
    assert (tmp_path / f"{'b' * 32}.corrupt").exists()
    assert not list(tmp_path.glob(".*.tmp"))


def test_job_record_round_trip_keeps_the_error() -> None:
    job = Job("d" * 32, "f", request(), 5.0, status=JobStatus.FAILED, completed_at=6.0)
    job.error = RetouchError("boom", code="executor_error")
    back = Job.from_record(job.to_record())
    assert back.status is JobStatus.FAILED and back.error is not None
    assert (back.error.code, back.error.status) == ("executor_error", 500)


def test_prefer_wait() -> None:
    assert parse_prefer_wait(None) is None
    assert parse_prefer_wait("respond-async, wait=5") == 5.0
    assert parse_prefer_wait("return=minimal") is None
    for bad in ("wait=-1", "wait=61", "wait=soon"):
        with pytest.raises(BadRequest) as err:
            parse_prefer_wait(bad)
        assert err.value.field == "Prefer"


def test_sse_frames_parse_back() -> None:
    events = [
        JobEvent(1, JobEventKind.QUEUED, {"position": 3}),
        JobEvent(2, JobEventKind.PROGRESS, {"step": 1, "total": 2}),
    ]
    text = (b"".join(sse.frame(e) for e in events) + sse.KEEPALIVE).decode()
    assert list(sse.parse(text.split("\n"))) == events
    parser = sse.Parser()
    got = [e for line in text.split("\n") for e in parser.feed(line)]
    assert got == events


def test_webhook_signature_and_allow_list() -> None:
    header = webhooks.sign(b"k", b"{}", 1000)
    assert webhooks.verify(b"k", b"{}", header, now=1010)
    assert not webhooks.verify(b"k", b"{ }", header, now=1010)  # body changed
    assert not webhooks.verify(b"k", b"{}", header, now=2000)  # replayed late
    assert not webhooks.verify(b"k", b"{}", "garbage", now=1000)

    resolver = Resolver()

    async def check(allow: AllowList, url: str) -> bool:
        try:
            await allow.check(url, resolver, "t")
        except BadRequest as exc:
            assert exc.field == "webhook" and exc.code == "webhook_not_allowed"
            return False
        return True

    default = AllowList()
    wide = AllowList.parse(["10.0.0.0/8", "hooks.example"])

    async def run() -> None:
        assert await check(default, "http://127.0.0.1:8080/x")
        assert await check(default, "http://[::1]/x")
        assert await check(default, "http://localhost/x")
        assert not await check(default, "http://10.0.0.5/x")
        assert not await check(default, "https://169.254.169.254/latest/meta-data")
        assert not await check(default, "http://no-such-host.invalid/x")
        assert await check(wide, "http://10.9.8.7/x") and await check(wide, "https://hooks.example")
        assert not await check(wide, "http://127.0.0.1/x")

    try:
        asyncio.run(run())
    finally:
        resolver.close()


def test_job_request_validation() -> None:
    req = request(webhook="https://127.0.0.1/h", webhook_events=["started", "completed"])
    assert req.webhook_events == (WebhookEvent.STARTED, WebhookEvent.COMPLETED)
    assert JobRequest.from_wire(req.to_wire()) == req
    assert request().webhook_events == (WebhookEvent.COMPLETED,)
    for extra, field in (
        ({"webhook": "file:///etc/passwd"}, "webhook"),
        ({"webhook": "http://"}, "webhook"),
        ({"webhook": "http://h:99999/"}, "webhook"),
        ({"webhook": "http://h/" + "x" * 3000}, "webhook"),
        ({"webhook": "http://example.invalid\n@127.0.0.1:8/"}, "webhook"),  # hosts disagree
        ({"webhook": "http://user:pw@127.0.0.1/"}, "webhook"),
        ({"webhook": "http://127.0.0.1/a b"}, "webhook"),  # does not read back the same
        ({"webhook": "HTTP://127.0.0.1/"}, "webhook"),
        ({"webhook_events": "started"}, "webhook_events"),
        ({"webhook_events": ["done"]}, "webhook_events"),
        ({"seed": "1"}, "seed"),
    ):
        with pytest.raises(BadRequest) as err:
            request(**extra)
        assert err.value.field == field, extra


def test_frames_of_the_executor_stream() -> None:
    reader = FrameReader()
    data = (
        pack(progress_frame(StepProgress(step=1, total=2)))
        + pack(error_frame(Canceled("gone")))
        + pack(result_frame(result()))
    )
    frames = [f for i in range(0, len(data), 7) for f in reader.feed(data[i : i + 7])]
    assert frames[0] == StepProgress(step=1, total=2)
    assert isinstance(frames[1], RetouchError) and frames[1].code == "canceled"
    assert isinstance(frames[2], InvokeResult) and frames[2].image == b"img"


@sync
async def test_queue_positions_and_cancel_by_tag() -> None:
    class Busy:
        name, inflight, slots = "e", 1, 1

    executor = Busy()
    queue = InvocationQueue(QueueLimits(), LeastRequests(), lambda fn: [executor])
    loop = asyncio.get_running_loop()
    waits = [
        asyncio.create_task(
            queue.acquire(PlacementRequest("f", "t", 0.5), loop.time() + 60, tag=tag)
        )
        for tag in ("a", "b", "c")
    ]
    await asyncio.sleep(0.01)
    assert queue.positions() == {"a": 0, "b": 1, "c": 2}
    assert queue.cancel("b") and not queue.cancel("b")
    with pytest.raises(Canceled):
        await waits[1]
    assert queue.positions() == {"a": 0, "c": 1} and queue.stats.canceled == 1
    queue.release(executor)  # a slot frees: "a" is bound, "c" moves up
    assert await waits[0] is executor
    assert queue.positions() == {"c": 0}
    waits[2].cancel()
