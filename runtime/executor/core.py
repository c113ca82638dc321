"""The executor's core: functions, models, templates and the engine, without HTTP.

Threads and locks (documented in docs/architecture.md): the event loop thread (the app)
only does cheap work — it checks an invocation (:mod:`.admission`) and submits it to the
engine; deploys run on a thread-pool thread; the engine thread runs denoising steps and
bakes (:mod:`.bakes`); pre/post worker dispatch threads belong to the worker pool
(:mod:`.stages`). The function registry (:mod:`.registry`), the editors (:mod:`.editors`)
and the invocation table (:mod:`.invocations`) each guard their tables with their own
lock, never held across a model load, a profile or any I/O: a slow build is a
per-(model, scheduler) future that others wait on outside the lock.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from retouch.functions.imaging import encode_image, mask_ratio
from retouch.functions.spec import FunctionSpec
from retouch.functions.wire.executor import (
    BakeState,
    CacheInfo,
    ChangeKind,
    DeviceMemory,
    EngineStats,
    ExecutorState,
)
from retouch.functions.wire.invoke import (
    CacheRead,
    ExecutorInvoke,
    InvokePath,
    InvokeResult,
    RunStats,
    Timings,
)
from retouch.runtime.engine import Engine
from retouch.runtime.executor.adapterhost import AdapterHost
from retouch.runtime.executor.admission import InvocationAdmission
from retouch.runtime.executor.bakes import BakeQueue
from retouch.runtime.executor.changes import ChangeFeed
from retouch.runtime.executor.editors import EditorOptions, Editors, encodes_elsewhere
from retouch.runtime.executor.invocations import Invocations
from retouch.runtime.executor.options import ADAPTER_BUDGET_BYTES, BUILD_SHARE, room
from retouch.runtime.executor.registry import FunctionEntry, FunctionRegistry
from retouch.runtime.executor.sleep import ExecutorSleep
from retouch.runtime.executor.stages import WorkerStages
from retouch.runtime.fingerprint import weights_fingerprint
from retouch.runtime.models import ModelCache
from retouch.runtime.pathchoice import PathChoice
from retouch.runtime.reproducibility import in_effect as deterministic_mode
from retouch.runtime.templates import Template, TemplateCache
from retouch.runtime.work import OnStep, Output, Work
from retouch.runtime.worker_server import POST, PRE


class ExecutorCore:
    """Functions, models, templates and the engine of one executor; owns their lifecycle."""

    def __init__(
        self,
        name: str,
        models: ModelCache,
        templates: TemplateCache,
        engine: Engine,
        stages: WorkerStages | None = None,
        *,
        maskaware: bool = True,
        data_dir: Path = Path("."),
        profile_in_background: bool = True,
        cuda_graphs: bool = False,
        graph_budget_bytes: int | None = None,
        path_choice: str = "auto",
        adapter_bytes: int = ADAPTER_BUDGET_BYTES,
        adapter_build_share: float = BUILD_SHARE,
    ) -> None:
        self.name = name
        self.models = models
        self.templates = templates
        self.changes = ChangeFeed()  # what the gateway's cluster view follows
        templates.on_change = self.changes.publish
        self.engine = engine
        self.stages = stages  # None: pre/post on the engine thread
        self.maskaware = maskaware  # False: every token computed, no cache (comparisons)
        self.adapters = AdapterHost(
            models,
            adapter_bytes,
            adapter_build_share,
            on_change=lambda: self.changes.publish(ChangeKind.ADAPTERS),
            encodes_here=lambda: not encodes_elsewhere(stages, models),
        )
        self.registry = FunctionRegistry(name, templates)
        options = EditorOptions(data_dir, profile_in_background, cuda_graphs, graph_budget_bytes)
        self.editors = Editors(models, templates, engine, stages, self.adapters, options)
        self.bakes = BakeQueue(self.registry, templates, self.editors, self.adapters, engine)
        self.admission = InvocationAdmission(
            self.registry,
            templates,
            self.editors,
            self.adapters,
            self.bakes,
            engine.config,
            maskaware=maskaware,
            path_choice=path_choice,
        )
        self.invocations = Invocations(name)
        self.sleep = ExecutorSleep(models, self.editors, self._in_hand)
        self._closed = False

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self.engine.start()

    def close(self) -> None:
        """Stop the engine (failing what it had not finished), the workers and the store."""
        if self._closed:
            return
        self._closed = True
        self.engine.stop()
        self.adapters.close()
        self.editors.keep_step_records()
        if self.stages is not None:
            self.stages.pool.close()
        self.templates.store.close()

    @property
    def healthy(self) -> bool:
        return self.engine.alive

    def _in_hand(self) -> int:
        """Invocations accepted and not answered, bakes claimed and not finished (waiting
        for adapter files or an encode, queued or running on the engine), other background
        work and models being loaded: what a sleep must not strand."""
        bakes = sum(
            status.state in (BakeState.QUEUED, BakeState.BAKING)
            for templates in self.templates.states().values()
            for status in templates.values()
        )
        load = self.engine.load()
        loads = len(self.models.loading())
        return self.invocations.stats.queued + bakes + load["background"] + loads

    # ---- deploys (a deploy thread) ----------------------------------------------------
    def deploy(self, spec: FunctionSpec, images: dict[str, Image.Image], generation: int) -> None:
        """Load the function's model (shared with other functions), register its templates
        and queue the bake of every template the store does not hold yet.

        ``generation`` orders the control operations on one name (the gateway numbers
        them): a deploy overtaken by a later deploy or delete of the same name is dropped
        (:class:`~retouch.runtime.executor.registry.Superseded`) instead of resurrecting
        an older version."""
        self.registry.check_generation(spec.name, generation)
        with self.sleep.kept_awake():  # loads, profiles, captures: not while it sleeps
            self._deploy(spec, images, generation)

    def _deploy(self, spec: FunctionSpec, images: dict[str, Image.Image], generation: int) -> None:
        loaded = self.models.get(spec.source.key, spec.family)
        self.adapters.deploy(spec, loaded)
        if self.stages is not None:  # load it in the workers now, not on the first request
            for future in self.stages.pool.load(spec.source.key, spec.family, spec.adapters):
                future.result()
        editor = self.editors.get(spec)
        for other in spec.schedulers:  # the ones requests may choose: built now, not on one
            self.editors.get(spec, other)
        sched_config = dict(editor.impl.pipe.scheduler.config)
        fingerprint = weights_fingerprint(loaded.fingerprint, spec.adapters)
        entry = FunctionEntry(spec, images, fingerprint, sched_config)
        registered = self.registry.register(entry, generation)
        if self.maskaware:
            for template in registered:
                self.bakes.queue(template)

    def deploy_async(
        self, spec: FunctionSpec, images: dict[str, Image.Image], generation: int
    ) -> Future[None]:
        """:meth:`deploy` on its own thread (a deploy waits on loads and on the profiling
        child; it never holds a lock others need meanwhile)."""
        done: Future[None] = Future()

        def run() -> None:
            try:
                self.deploy(spec, images, generation)
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)

        threading.Thread(target=run, name=f"deploy-{spec.name}", daemon=True).start()
        return done

    def remove(self, name: str, generation: int) -> bool:
        """Forget a function (unless a later deploy of the name already replaced it)."""
        return self.registry.remove(name, generation)

    # ---- invocations (the event loop: cheap checks, then the engine) --------------------
    async def invoke(self, inv: ExecutorInvoke, on_step: OnStep | None = None) -> InvokeResult:
        return await self.begin(inv, on_step)

    def cancel(self, invocation_id: str) -> bool:
        """Cancel the invocation the gateway numbered ``invocation_id``. One that has not
        arrived yet is refused when it does (the gateway may bind and cancel in the same
        moment). False when it is unknown or already finished."""
        work = self.invocations.find(invocation_id)
        return work is not None and self.engine.cancel(work)

    def begin(self, inv: ExecutorInvoke, on_step: OnStep | None = None) -> Awaitable[InvokeResult]:
        """Check and submit an invocation (raises at once on bad input, a dead engine or a
        cancel that came first); the returned awaitable is its result. ``on_step`` hears
        each denoising step on the engine thread. Beyond the executor's room (several
        gateways may send here) it refuses with 429 ``executor_full``."""
        self.invocations.check_room(room(self.engine.config.max_batch))
        self.invocations.refuse_if_canceled(inv.id)
        edit = self.admission.check(inv)
        with self.sleep.awake():  # a sleep's busy check sees this invocation, or it waits
            if edit.empty:  # nothing to edit: the template, without running the model
                return asyncio.to_thread(self._template_result, edit.template, inv, edit.arrived)
            admitted = self.admission.admit(edit, on_step)
            work = admitted.work
            adapters = work.adapters
            assert adapters is not None  # pinned by admission: released when the work ends
            try:
                future = self.engine.submit(work)  # raises EngineUnavailable when dead
            except BaseException:
                adapters.release()
                raise
            future.add_done_callback(lambda _: adapters.release())
            self.invocations.add(inv.id, work)
        return self._finish(inv, work, future, edit.mask, admitted.choice)

    async def _finish(
        self, inv: ExecutorInvoke, work: Work, future: Future, mask: Any, choice: PathChoice
    ) -> InvokeResult:
        ok: bool | None = None
        try:
            report = await asyncio.wrap_future(future)
            ok = True
            self.models.startup.since_birth("first_edit")
        except Exception:
            ok = False
            raise
        finally:
            self.invocations.finish(inv.id, ok)
        output: Output = report["output"]
        path = InvokePath(report["path"])
        reason = choice.reason
        if path is not choice.path:  # chosen, but its activations were not there at join
            reason = (
                "the template's activations were not readable when it joined (not baked "
                "yet, or being baked again): every token computed"
            )
        return InvokeResult(
            image=output.image,
            format=inv.format,
            width=output.width,
            height=output.height,
            mask_ratio=mask_ratio(mask),
            executor=self.name,
            path=path,
            path_reason=reason,
            timings=Timings(**report["timings"]),
            cache=CacheRead.from_wire(report["cache"]),
            engine=RunStats.from_wire(report["engine"]),
            template=inv.template,
        )

    def _template_result(
        self, template: Template, inv: ExecutorInvoke, arrived: float
    ) -> InvokeResult:
        encoded = encode_image(template.image, inv.format)
        return InvokeResult(
            image=encoded,
            format=inv.format,
            width=template.image.width,
            height=template.image.height,
            mask_ratio=0.0,
            executor=self.name,
            path=InvokePath.TEMPLATE,
            timings=Timings(run_ms=(time.perf_counter() - arrived) * 1e3),
            template=inv.template,
        )

    # ---- state (cheap: counters and tables, no disk scan, no waiting on a load) ---------
    def state(self) -> ExecutorState:
        functions, generations = self.registry.snapshot()
        cache = self.templates.store.live_stats()
        if self.templates.device_tier is not None:
            cache = {**cache, **self.templates.device_tier.usage()}
        resident, adapter_figures = self.adapters.report()
        stats = self.invocations.stats
        return ExecutorState(
            name=self.name,
            pid=os.getpid(),
            device=str(self.models.device),
            maskaware=self.maskaware,
            deterministic=deterministic_mode(),
            mixed_adapters=self.engine.config.mixed_adapters,
            models=tuple(self.models.loaded()),
            loading=tuple(self.models.loading()),
            functions=functions,
            generations=generations,
            queued=stats.queued,
            completed=stats.completed,
            failed=stats.failed,
            engine=self._engine_stats(),
            templates=self.templates.states(),
            cost_models=self.editors.cost_models(),
            cache=CacheInfo.from_wire(cache),
            workers={}
            if self.stages is None
            else {n: p for n, p in self.stages.pool.pids().items() if p is not None},
            gpu_memory=device_memory(self.models.device),
            adapters=resident,
            adapter_stats=adapter_figures,
            startup_ms=self.models.startup.executor_ms(),
            model_startup_ms=self.models.startup.models_ms(),
            sleep=self.sleep.info(),
        )

    def _engine_stats(self) -> EngineStats:
        summary = self.engine.counters.summary()
        plan = summary.pop("last_plan", None) or {}
        config = self.engine.config
        pool = None if self.stages is None else self.stages.pool
        return EngineStats(
            mode=config.mode.value,
            max_batch=config.max_batch,
            disaggregated=config.disaggregated,
            alive=self.engine.alive,
            error=self.engine.error,
            **self.engine.load(),
            **summary,
            plan_sparse_blocks=plan.get("sparse"),
            plan_blocks=plan.get("blocks"),
            pre_workers=0 if pool is None else pool.workers(PRE),
            post_workers=0 if pool is None else pool.workers(POST),
            **self.editors.graph_stats(),
        )


def device_memory(device: torch.device) -> DeviceMemory:
    """GPU memory as ``/v1/executors`` reports it (zeros on a CPU)."""
    if device.type != "cuda":
        return DeviceMemory()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(
        total=total,
        free=free,
        allocated=torch.cuda.memory_allocated(device),
        reserved=torch.cuda.memory_reserved(device),
    )
