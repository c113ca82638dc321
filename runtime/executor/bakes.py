"""Template bakes: queued onto the engine thread as background work, never waited for.

A bake records a template's own generation (its prompt and seed, nothing masked) into the
activation store. Its prompt is encoded first: here, with the function's prompt LoRAs, or
in a pre worker where the executor's pipelines lack their text encoders; the engine
thread, which runs the bake, never waits for either its adapter files or a worker's
encode (a failed encode fails the bake, as a failed bake does).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from retouch.functions.spec import FunctionSpec
from retouch.runtime.adapters import AdapterUse
from retouch.runtime.engine import Engine
from retouch.runtime.executor.adapterhost import AdapterHost
from retouch.runtime.executor.editors import Editors, encodes_elsewhere
from retouch.runtime.executor.registry import FunctionRegistry
from retouch.runtime.maskaware.editor import EditRequest, Encoded, MaskAwareEditor
from retouch.runtime.templates import Template, TemplateCache

Recorder = Callable[[Any], None]  # records one generation into the store's writer


@dataclass
class Bake:
    """One template's bake, from its claim to its run on the engine thread."""

    template: Template
    spec: FunctionSpec
    editor: MaskAwareEditor
    adapters: AdapterUse  # the weights it records, held until it ran
    host: AdapterHost
    templates: TemplateCache
    engine: Engine

    @property
    def request(self) -> EditRequest:
        t = self.template
        return MaskAwareEditor.bake_request(
            t.image, t.prompt, t.seed, t.steps, t.guidance, strength=t.strength
        )

    def unwanted(self) -> bool:
        """Asked between its steps: a stopping executor, a deleted or redeployed function."""
        return self.engine.stopping or self.templates.unwanted(self.template)

    def record(self, writer: Any, encoded: Encoded | None = None) -> None:
        """The generation itself, with the function's adapter set active."""
        t = self.template
        self.adapters.activate()
        self.editor.bake(
            t.image,
            t.prompt,
            t.seed,
            t.steps,
            t.guidance,
            writer,
            encoded=encoded,
            cancelled=self.unwanted,
            strength=t.strength,
        )

    def record_here(self, writer: Any) -> None:
        """Encoded on the engine thread, with the function's prompt LoRAs, then recorded."""
        request = self.request
        with self.host.text(self.spec).encoding(self.spec.adapters):
            encoded = self.editor.encode(request)
        self.record(writer, encoded)

    def queue(self, recorder: Recorder) -> None:
        """Onto the engine thread once the adapter files are read (it never waits)."""
        self.adapters.read.add_done_callback(
            lambda _: self.engine.submit_background(self._job(recorder))
        )

    def _job(self, recorder: Recorder) -> Callable[[], None]:
        def job() -> None:
            try:
                self.templates.bake(self.template, recorder)
            finally:
                self.adapters.release()

        return job

    def queue_encoded(self, encoding: Future[Encoded]) -> None:
        """Queued once a pre worker's encode is done; recorded from it."""
        encoding.add_done_callback(
            lambda _: self.queue(lambda writer: self.record(writer, encoding.result()))
        )


class BakeQueue:
    """Queues the bake of each template that needs one, once (the store's claim)."""

    def __init__(
        self,
        registry: FunctionRegistry,
        templates: TemplateCache,
        editors: Editors,
        host: AdapterHost,
        engine: Engine,
    ) -> None:
        self.registry = registry
        self.templates = templates
        self.editors = editors
        self.host = host
        self.engine = engine

    def queue(self, template: Template) -> None:
        """Bake ``template`` in the background unless it is baked or queued already."""
        if not self.templates.claim_bake(template):
            return
        spec = self.registry.spec(template.function)
        bake = Bake(
            template,
            spec,
            self.editors.get(spec, template.scheduler),
            self.host.residency(spec).use(spec.adapter_set),
            self.host,
            self.templates,
            self.engine,
        )
        if not encodes_elsewhere(self.editors.stages, self.editors.models):
            bake.queue(bake.record_here)
            return
        bake.queue_encoded(self.editors.encode_in_worker(spec, bake.request))
