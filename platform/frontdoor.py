"""The one way in: every accepted request becomes a job through here.

The synchronous invoke, an asynchronous job, an OpenAI-style edit and an edit of an
uploaded image all take the same path, in this order:

1. :meth:`FrontDoor.servable`: the function exists and did not fail to deploy;
2. :meth:`FrontDoor.arrival`: before the body is read (or decoded), 429 when the queue is
   full or when even the function's cheapest invocation would miss its SLO; every 429
   decided from here on is timed (``/v1/executors``'s ``refusal_ms``);
3. :meth:`FrontDoor.accept`: the request is decoded into one
   :class:`~retouch.platform.jobs.PreparedInvocation` (template checked, mask decoded, a
   large one off the event loop, an uploaded image content-addressed), admitted again (the
   queue may have filled meanwhile; this invocation's own SLO), and submitted as a job;
4. the job store runs it through the dispatcher (:meth:`FrontDoor._execute`), and a synchronous
   caller waits for it with :meth:`FrontDoor.answers`.

A job resumed from the journal after a restart is prepared again on its way to the dispatcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np

from retouch.functions import wire
from retouch.functions.errors import Canceled, NotFound, Overloaded, Unavailable
from retouch.functions.families import check_edit, family_spec
from retouch.functions.imaging import decode_mask
from retouch.functions.wire import DeployStatus
from retouch.platform import uploads
from retouch.platform.control.cluster import PlacementRequest
from retouch.platform.deployed import DeployedFunction
from retouch.platform.dispatch import Dispatcher
from retouch.platform.imagegate import ImageGate
from retouch.platform.job import Job, PreparedInvocation, new_job_id
from retouch.platform.jobs import JobStore, OnProgress, OnStart
from retouch.platform.journal import JobJournal
from retouch.platform.links import LinkSigner
from retouch.platform.metrics import GatewayMetrics
from retouch.platform.retention import RetentionLimits, payload_bytes
from retouch.runtime.prediction import MaskFootprint

if TYPE_CHECKING:
    from retouch.platform.jobs import Notify


class FrontDoor:
    """Admission and preparation of every request, and the job store that runs them."""

    def __init__(
        self,
        functions: Mapping[str, DeployedFunction],
        dispatcher: Dispatcher,
        metrics: GatewayMetrics,
        journal: JobJournal | None,
        images: ImageGate,
        *,
        names: uploads.UploadNames,
        retention_s: float,
        progress_interval_s: float,
        notify: Notify | None = None,
        limits: RetentionLimits | None = None,
        links: LinkSigner | None = None,
    ) -> None:
        self.functions = functions  # the gateway's, kept current by its deploys and deletes
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.images = images  # header checks and the decode budget of every image
        self.names = names  # the ids of uploaded images
        self.jobs = JobStore(
            self._execute,
            dispatcher.queue_positions,
            dispatcher.cancel,
            journal,
            retention_s=retention_s,
            progress_interval_s=progress_interval_s,
            notify=notify,
            limits=limits,
            links=links,
        )

    # ---- lookup --------------------------------------------------------------------------
    def function(self, name: str) -> DeployedFunction:
        fn = self.functions.get(name)
        if fn is None:
            raise NotFound(f"no function named {name!r}", field="name", code="function_not_found")
        return fn

    def servable(self, name: str) -> DeployedFunction:
        """A function that may take invocations: deployed, or still deploying (they wait)."""
        fn = self.function(name)
        if fn.status is DeployStatus.FAILED:
            raise Unavailable(
                f"function {fn.spec.name!r} failed to deploy: {fn.error}",
                code="function_not_ready",
            )
        return fn

    # ---- admission -----------------------------------------------------------------------
    @contextlib.contextmanager
    def arrival(self, fn: DeployedFunction, received: float) -> Iterator[None]:
        """Admission on arrival, before any body is read: a full queue, or an SLO that not
        even an empty mask on a host-resident template could meet, is a 429 at once.
        ``received``: ``time.perf_counter()`` when the request's headers arrived; a 429
        raised inside is timed from then (admission should answer in milliseconds)."""
        try:
            self.dispatcher.check(fn.spec.name)
            self.dispatcher.admit_slo(fn.cheapest, early=True)
            yield
        except Overloaded:
            self.dispatcher.stats.refusal_s.append(time.perf_counter() - received)
            raise

    async def accept(
        self,
        fn: DeployedFunction,
        request: wire.JobRequest,
        *,
        durable: bool,
        owner: str,
        upload: uploads.Upload | None = None,
    ) -> Job:
        """Prepare ``request``, admit it (queue room again, held for it until it waits
        in the queue; and its own SLO: its demand counts towards autoscaling either way) and
        submit it as a job ``owner`` owns. A durable job over the retention caps is refused
        before anything is decoded. ``upload``: the request's ``image`` as :meth:`upload`
        decoded it already (one decode for several jobs of one image)."""
        if durable:
            self.jobs.admit(owner, payload_bytes(request))
        job_id = new_job_id()
        prepared = await self._prepare(fn, request.invoke, job_id, owner, upload)
        seat = self.dispatcher.admit(fn.spec.name)  # others may have filled the queue meanwhile
        try:
            self.dispatcher.admit_slo(prepared.placement)
            job = await self.jobs.submit(
                fn.spec.name,
                request,
                dataclasses.replace(prepared, seat=seat),
                durable=durable,
                job_id=job_id,
                owner=owner,
            )
        except BaseException:
            self.dispatcher.unseat(seat)
            raise
        if job.task is not None:  # however the job ends, its place is not held past it
            job.task.add_done_callback(lambda _: self.dispatcher.unseat(seat))
        return job

    # ---- answers -------------------------------------------------------------------------
    async def answers(self, jobs: list[Job]) -> list[wire.InvokeResult]:
        """Wait for jobs run on a caller's behalf and give their results in order (the first
        error is raised); jobs that are not kept (not durable) are forgotten."""
        try:
            await asyncio.gather(*(asyncio.shield(j.task) for j in jobs if j.task is not None))
        finally:
            self.forget(jobs)
        results = []
        for job in jobs:
            if job.error is not None:
                raise job.error
            if job.result is None:
                raise Canceled(f"invocation {job.id} was canceled")
            results.append(job.result)
        return results

    def forget(self, jobs: list[Job]) -> None:
        """Drop the jobs that are not kept (their caller has its answer, or gave up)."""
        for job in jobs:
            if not job.durable:
                self.jobs.forget(job)

    # ---- preparation and execution -------------------------------------------------------
    async def upload(self, fn: DeployedFunction, data: bytes, owner: str) -> uploads.Upload:
        """An uploaded image of ``owner`` for ``fn``, checked from its header (before a
        pixel is decoded), then decoded within the decode budget and named."""
        declared = self.images.declare(data, "image")
        uploads.check_upload(fn.spec, declared.size)
        return await self.images.decode(declared, self.names.decode, fn.spec, data, owner)

    async def decode_mask(
        self, data: bytes, size: tuple[int, int], halo: int = 0
    ) -> tuple[np.ndarray, MaskFootprint]:
        """A mask of ``size`` (checked from its header, as the pixel limit), decoded within
        the decode budget: a small one inline, a large one on a worker thread, so the event
        loop serves other invocations meanwhile."""
        declared = self.images.declare(data, "mask")
        return await self.images.decode(declared, _decode_mask, data, size, halo, size=size)

    async def _prepare(
        self,
        fn: DeployedFunction,
        req: wire.InvokeRequest,
        invocation_id: str,
        owner: str,
        upload: uploads.Upload | None = None,
    ) -> PreparedInvocation:
        """Check the template, decode the mask (a large one on a thread) and build what the
        executor gets; an uploaded ``image`` is decoded and content-addressed here (unless
        given decoded), within its owner's uploads (``UploadNames.id``). What the function's
        family cannot do is refused first (:func:`check_edit`)."""
        steps = req.steps or fn.spec.steps
        negative = req.negative_prompt or ""
        steps_run = check_edit(fn.spec.family, steps, req.strength, negative)
        image = None
        if req.image is not None:
            if upload is None:
                upload = await self.upload(fn, req.image, owner)
            template, image, size = upload.id, upload.pixels, upload.size
        else:
            template, size = req.template or "", fn.sizes.get(req.template or "")
        if size is None:
            raise NotFound(
                f"function {fn.spec.name!r} has no template {req.template!r}",
                field="template",
                code="template_not_found",
            )
        mask, footprint = await self.decode_mask(req.mask, size, fn.spec.halo or 0)
        inv = wire.ExecutorInvoke(
            function=fn.spec.name,
            template=template,
            image=image,
            mask=wire.RawArray.of(mask.astype("uint8")),
            prompt=req.prompt,
            seed=req.seed,
            steps=steps,
            guidance=fn.spec.guidance if req.guidance is None else float(req.guidance),
            format=req.format,
            id=invocation_id,
            negative_prompt=negative,
            strength=req.strength,
        )
        # Placed by the steps it runs (a strength < 1 skips some) and by the template as the
        # executors bake and report it for that trajectory (a variant, when it has a bake)
        skipped = family_spec(fn.spec.family).skipped_steps(steps, req.strength)
        placement = PlacementRequest(
            fn.spec.name,
            wire.strength_variant(template, skipped if steps == fn.spec.steps else 0),
            footprint.ratio,
            fn.spec.model,
            steps_run,
            footprint,
            None if fn.spec.slo_ms is None else fn.spec.slo_ms / 1e3,
            copy=fn.spec.source.key,
        )
        return PreparedInvocation(inv, placement)

    async def _execute(
        self, job: Job, on_start: OnStart, on_progress: OnProgress
    ) -> wire.InvokeResult:
        """Run a job's invocation through the dispatcher (the job store calls this)."""
        if job.prepared is None:  # resumed from the journal after a restart
            job.prepared = await self._prepare(
                self.servable(job.function), job.request.invoke, job.id, job.owner
            )
        prepared = job.prepared
        if job.cancel_requested:  # canceled while its mask was decoded
            raise Canceled(f"job {job.id} was canceled", field="id")
        result = await self.dispatcher.invoke(
            prepared.invocation, prepared.placement, on_start, on_progress, prepared.seat
        )
        result.timings.total_ms = (time.time() - job.created_at) * 1e3
        fn = self.functions.get(job.function)
        slo_ms = fn.spec.slo_ms if fn is not None else None
        self.metrics.observe(job.function, result, prepared.placement.mask_ratio, slo_ms)
        return result


def _decode_mask(
    data: bytes, size: tuple[int, int], halo: int = 0
) -> tuple[np.ndarray, MaskFootprint]:
    """Decode a mask and summarise it for prediction."""
    mask = decode_mask(data, size)
    return mask, MaskFootprint.of(mask, halo)
