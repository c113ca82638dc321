"""The one way in: every accepted request becomes a job through here.

The synchronous invoke, an asynchronous job, an OpenAI-style edit and an edit of an
uploaded image all take the same path, in this order:

1. :meth:`FrontDoor.servable`: the function exists and did not fail to deploy;
2. :meth:`FrontDoor.arrival`: before the body is read (or decoded), 429 when the queue is
   full or when even the function's cheapest invocation would miss its SLO; every 429
   decided from here on is timed (``/v1/executors``'s ``refusal_ms``);
3. :meth:`FrontDoor.accept`: the request is decoded into one
   :class:`~retouch.platform.jobs.store.PreparedInvocation` (template checked, mask decoded, a
   large one off the event loop, the input framed for the function's resolution
   (``platform/jobs/reframe.py``: resized, or cropped around the mask), an uploaded image or a
   crop content-addressed), admitted again (the queue may have filled meanwhile; this
   invocation's own SLO), and submitted as a job;
4. the job store runs it through the dispatcher (:meth:`FrontDoor._execute`), the edit of a
   resized or cropped input is pasted back into it, and a synchronous caller waits for it
   with :meth:`FrontDoor.answers`.

A job resumed from the journal after a restart is prepared again on its way to the
dispatcher: framing is a pure function of the request, so its crop and paste-back are the
same.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from retouch.functions.errors import BadRequest, Canceled, NotFound, Overloaded, Unavailable
from retouch.functions.families import check_edit, check_reference
from retouch.functions.imaging import decode_mask, encode_image
from retouch.functions.wire.codec import RawArray
from retouch.functions.wire.executor import DeployStatus
from retouch.functions.wire.invoke import ExecutorInvoke, InvokeRequest, InvokeResult
from retouch.functions.wire.jobs import JobRequest
from retouch.platform.api import uploads
from retouch.platform.api.imagegate import Declared, ImageGate
from retouch.platform.api.metrics import GatewayMetrics
from retouch.platform.control.cluster import PlacementRequest
from retouch.platform.fleet.deployed import DeployedFunction
from retouch.platform.fleet.dispatch import Dispatcher
from retouch.platform.jobs.job import Job, PreparedInvocation, new_job_id
from retouch.platform.jobs.links import LinkSigner
from retouch.platform.jobs.reframe import Frame, Size, resize_mask, resize_pixels
from retouch.platform.jobs.retention import RetentionLimits, payload_bytes
from retouch.platform.jobs.source import JobSource
from retouch.platform.jobs.store import JobStore, OnProgress, OnStart
from retouch.runtime.prediction import MaskFootprint

WEBP_MAX_SIDE = 16383  # libwebp's limit: a larger result could not be encoded

if TYPE_CHECKING:
    from retouch.platform.jobs.store import Notify


class FrontDoor:
    """Admission and preparation of every request, and the job store that runs them."""

    def __init__(
        self,
        functions: Mapping[str, DeployedFunction],
        dispatcher: Dispatcher,
        metrics: GatewayMetrics,
        source: JobSource,
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
            source,
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
        request: JobRequest,
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

    async def accept_images(
        self,
        fn: DeployedFunction,
        request: InvokeRequest,
        *,
        durable: bool,
        owner: str,
        upload: uploads.Upload | None = None,
    ) -> list[Job]:
        """``request``'s ``num_images_per_prompt`` images accepted as one job each (image i
        with seed ``seed + i``), in order. If one is refused, those already accepted run on
        and are forgotten (nobody waits for them) and the refusal is raised."""
        jobs: list[Job] = []
        try:
            for one in request.images():
                jobs.append(
                    await self.accept(
                        fn, JobRequest(invoke=one), durable=durable, owner=owner, upload=upload
                    )
                )
        except BaseException:
            self.forget(jobs)
            raise
        return jobs

    # ---- answers -------------------------------------------------------------------------
    async def answers(self, jobs: list[Job]) -> list[InvokeResult]:
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
    async def upload(self, fn: DeployedFunction, data: bytes) -> uploads.Upload:
        """An uploaded image for ``fn``, checked from its header (the pixel limit, before a
        pixel is decoded), then decoded within the decode budget, at the size it was sent."""
        declared = self.images.declare(data, "image")
        uploads.check_upload(fn.spec)
        return await self.images.decode(declared, uploads.decode_upload, data)

    async def decode_mask(self, data: bytes, size: Size) -> np.ndarray:
        """A mask as a boolean array of ``size`` (its image's): decoded at the size it was
        sent, its header checked against the pixel limit first, and resized when other;
        within the decode budget (for the larger of the two sizes): a small one inline, a
        large one on a worker thread, so the event loop serves other invocations meanwhile."""
        declared = self.images.declare(data, "mask")
        cost = max(declared, Declared(*size), key=lambda d: d.pixels)
        return await self.images.decode(cost, _decode_mask, data, size)

    async def _prepare(
        self,
        fn: DeployedFunction,
        req: InvokeRequest,
        invocation_id: str,
        owner: str,
        upload: uploads.Upload | None = None,
    ) -> PreparedInvocation:
        """Check the template, decode the mask, frame the input for the function's
        resolution and build what the executor gets. An uploaded ``image`` (decoded here
        unless given decoded) or a crop of a template is an ad-hoc template, named by the
        pixels the executor gets within its owner's uploads (``UploadNames.id``). What the
        function's family cannot do, and a scheduler the function does not allow, are
        refused first (:func:`check_edit`, ``FunctionSpec.request_scheduler``)."""
        spec = fn.spec
        steps = req.steps or spec.steps
        negative = req.negative_prompt or ""
        steps_run = check_edit(spec.family, steps, req.strength, negative)
        scheduler = spec.request_scheduler(req.scheduler)
        declared_reference = None
        if req.image_reference is not None:
            check_reference(spec.family)
            declared_reference = self.images.declare(req.image_reference, "image_reference")
        size = upload.size if upload is not None else self._input_size(fn, req)
        hold = _larger(size, self.images.declare(req.mask, "mask"))
        if declared_reference is not None:
            hold = max(hold, declared_reference.pixels)
        reference = None
        async with self.images.holding(hold):
            if req.image is not None:
                upload = upload or await self.upload(fn, req.image)
            mask = await self.decode_mask(req.mask, size)
            if declared_reference is not None:
                edited = (spec.width, spec.height)
                pixels = await self.images.decode(
                    declared_reference, _decode_reference, req.image_reference, edited
                )
                reference = RawArray.of(pixels)
            canvas_size = (spec.width, spec.height)
            output = self._output_size(req.size)
            frame = Frame.plan(mask, canvas_size, req.padding_mask_crop, output)
            if req.format == "webp" and max(frame.output) > WEBP_MAX_SIDE:  # before any work
                raise BadRequest(
                    f"a WebP image is at most {WEBP_MAX_SIDE} pixels a side; this result would "
                    f"be {frame.output[0]}x{frame.output[1]}: use png",
                    field="size" if req.size is not None else "format",
                    code="invalid_field",
                )
            if req.image is None and frame.reshapes:  # a crop of a template: ad-hoc template
                uploads.check_upload(spec, "padding_mask_crop")
            canvas = await self.images.work(
                mask.size, self._canvas, fn, req.template or "", upload, frame, mask, owner
            )
        inv = ExecutorInvoke(
            function=spec.name,
            template=canvas.template,
            image=canvas.image,
            mask=RawArray.of(canvas.mask.astype("uint8")),
            prompt=req.prompt,
            seed=req.seed,
            steps=steps,
            guidance=spec.guidance if req.guidance is None else float(req.guidance),
            format=req.format if canvas.frame is None else "raw",  # pasted back, then encoded here
            id=invocation_id,
            negative_prompt=negative,
            strength=req.strength,
            scheduler=scheduler,
            image_reference=reference,
        )
        # Placed by the steps it runs (a strength < 1 skips some) and by the template as the
        # executors bake and report it for that trajectory (a variant, when it has a bake:
        # the steps it skips and a scheduler other than the function's own key it)
        variant = canvas.template  # other settings run stock: no variant is baked
        if steps == spec.steps and inv.guidance == spec.guidance:  # the executor's covers
            variant = spec.template_variant(canvas.template, req.strength, scheduler)
        placement = PlacementRequest(
            spec.name,
            variant,
            canvas.footprint.ratio,
            spec.model,
            steps_run,
            canvas.footprint,
            None if spec.slo_ms is None else spec.slo_ms / 1e3,
            copy=spec.source.key,
            adapter_set=spec.adapter_set,
            adapter_bytes=fn.adapter_bytes,
            full=reference is not None,  # its own reference: every token, no row read
        )
        return PreparedInvocation(inv, placement, frame=canvas.frame)

    def _input_size(self, fn: DeployedFunction, req: InvokeRequest) -> Size:
        """The size of the image ``req`` edits, checked before a pixel is decoded: an
        upload's header (the pixel limit; uploads allowed) or the template's."""
        if req.image is not None:
            declared = self.images.declare(req.image, "image")
            uploads.check_upload(fn.spec)
            return declared.size
        size = fn.sizes.get(req.template or "")
        if size is None:
            raise NotFound(
                f"function {fn.spec.name!r} has no template {req.template!r}",
                field="template",
                code="template_not_found",
            )
        return size

    def _output_size(self, size: Size | None) -> Size | None:
        """The result's size asked for, within the pixel limit (its memory and encoding
        cost an input's)."""
        if size is not None and size[0] * size[1] > self.images.max_pixels:
            raise BadRequest(
                f"size {size[0]}x{size[1]} is above {self.images.max_pixels} pixels",
                field="size",
                code="image_too_large",
            )
        return size

    def _canvas(
        self,
        fn: DeployedFunction,
        template: str,
        upload: uploads.Upload | None,
        frame: Frame,
        mask: np.ndarray,
        owner: str,
    ) -> Canvas:
        """What the executor edits of an input framed by ``frame`` (work for a worker
        thread when large): a deployed template as it is, else an ad-hoc template (an
        uploaded image, or a crop of a template) named by the pixels the executor gets."""
        halo = fn.spec.halo or 0
        if upload is not None:
            source = upload.pixels
        elif frame.identity:  # the template itself, and its edit is the answer
            return Canvas(template, None, mask, MaskFootprint.of(mask, halo), None)
        else:
            source = fn.template_pixels(template)
        pasted = None if frame.identity else frame
        if upload is None and not frame.reshapes:  # the template itself, its edit resized
            return Canvas(template, None, mask, MaskFootprint.of(mask, halo), pasted)
        pixels, canvas_mask = frame.to_canvas(source, mask)
        return Canvas(
            self.names.id(pixels, owner),
            RawArray.of(pixels),
            canvas_mask,
            MaskFootprint.of(canvas_mask, halo),
            pasted,
        )

    async def _execute(self, job: Job, on_start: OnStart, on_progress: OnProgress) -> InvokeResult:
        """Run a job's invocation through the dispatcher (the job store calls this); the
        edit of a resized or cropped input is pasted back into it."""
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
        result = result.model_copy(update={"seed": prepared.invocation.seed})
        if prepared.frame is not None:
            fn = self.servable(job.function)
            result = await self._paste(prepared.frame, result, fn, job.request.invoke)
        result.timings.total_ms = (time.time() - job.created_at) * 1e3
        fn = self.functions.get(job.function)
        slo_ms = fn.spec.slo_ms if fn is not None else None
        self.metrics.observe(job.function, result, prepared.placement.mask_ratio, slo_ms)
        return result

    async def _paste(
        self,
        frame: Frame,
        result: InvokeResult,
        fn: DeployedFunction,
        req: InvokeRequest,
    ) -> InvokeResult:
        """The executor's edit (raw RGB8 of the function's resolution) pasted back into
        the input, decoded again from the request (with its mask), at the size asked for,
        encoded as asked (a large one on a worker thread), all within one hold."""
        width, height = frame.output
        size = self._input_size(fn, req)
        mask_size = self.images.declare(req.mask, "mask")
        async with self.images.holding(max(_larger(size, mask_size), width * height)):
            if req.image is not None:
                source = (await self.upload(fn, req.image)).pixels
            else:
                source = fn.template_pixels(req.template or "")
            mask = await self.decode_mask(req.mask, size)

            def encoded() -> bytes:
                edited = np.frombuffer(result.image, np.uint8)
                edited = edited.reshape(result.height, result.width, 3)
                pasted = frame.paste(edited, source, mask)
                return encode_image(Image.fromarray(pasted, "RGB"), req.format)

            image = await self.images.work(width * height, encoded)
        return result.model_copy(
            update={"image": image, "format": req.format, "width": width, "height": height}
        )


@dataclass(frozen=True)
class Canvas:
    """What the executor edits of one input: a template id (an ad-hoc one's with its
    pixels), the mask at the function's resolution and its footprint, and what the
    paste-back needs (None: the executor's result is the answer)."""

    template: str
    image: RawArray | None
    mask: np.ndarray
    footprint: MaskFootprint
    frame: Frame | None


def _larger(size: Size, declared: Declared) -> int:
    """The pixels of the larger of an image's ``size`` and its mask's declared size: what a
    run of work on both holds room for (a mask is decoded at its size, then resized)."""
    return max(size[0] * size[1], declared.pixels)


def _decode_reference(data: bytes, size: Size) -> np.ndarray:
    """A reference image as RGB8 at ``size`` (the edited image's, which the pipeline reads
    it at): decoded at the size it was sent (``undecodable_image`` otherwise), resized when
    other."""
    return resize_pixels(uploads.decode_upload(data, "image_reference").pixels, size)


def _decode_mask(data: bytes, size: Size) -> np.ndarray:
    """A mask decoded at the size it was sent, resized to ``size`` when other."""
    return resize_mask(decode_mask(data), size)
