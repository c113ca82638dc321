"""The executor's LoRA adapters: per loaded model copy, the denoiser's residency
(``runtime/adapters.py``) and, where this process encodes prompts, the text encoders'
adapters (``runtime/textadapters.py``); the deploy's checks of a function's files.

Functions of one model copy share both: a bare function's steps must switch the copy's
adapters off, and its prompts must be encoded with none active. The lock guards the two
tables; nothing slow runs under it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from retouch.functions.adaptercheck import check_adapters
from retouch.functions.errors import InvalidSpec
from retouch.functions.modelcheck import ModelFiles, ModelKind
from retouch.functions.spec import FunctionSpec
from retouch.functions.wire.executor import AdapterStats
from retouch.runtime.adapters import (
    AdapterReadError,
    AdapterResidency,
    adapter_stats,
    resident_sets,
)
from retouch.runtime.maskaware.editor import EditRequest, Encoded, MaskAwareEditor
from retouch.runtime.models import LoadedModel, ModelCache
from retouch.runtime.textadapters import TextAdapters


class AdapterHost:
    """Adapter residencies and text adapters of an executor's model copies."""

    def __init__(
        self,
        models: ModelCache,
        budget_bytes: int,
        build_share: float,
        on_change: Callable[[], None],
        encodes_here: Callable[[], bool],
    ) -> None:
        self.models = models
        self.budget_bytes = budget_bytes  # LoRA weights kept in each model copy's denoiser
        self.build_share = build_share  # the LoRA builder's duty cycle
        self.on_change = on_change  # a set became resident or was evicted
        self.encodes_here = encodes_here  # whether this process encodes prompts (no workers)
        self._lock = threading.Lock()
        self._residencies: dict[str, AdapterResidency] = {}  # per loaded copy (source key)
        self._text: dict[str, TextAdapters] = {}  # per loaded copy: in-process prompt LoRAs

    def residency(self, spec: FunctionSpec) -> AdapterResidency:
        """The denoiser adapters of the model copy ``spec`` runs on (made with the copy's
        first function, bare or not)."""
        loaded = self.models.get(spec.source.key, spec.family)
        with self._lock:
            residency = self._residencies.get(spec.source.key)
            if residency is None:
                residency = AdapterResidency(
                    loaded.pipe,
                    self.budget_bytes,
                    build_share=self.build_share,
                    on_change=self.on_change,
                )
                self._residencies[spec.source.key] = residency
        return residency

    def text(self, spec: FunctionSpec) -> TextAdapters:
        """The text-encoder adapters of ``spec``'s model in this process (its own encodes:
        no pre workers, or ``--inline-prepost``)."""
        loaded = self.models.get(spec.source.key, spec.family)
        with self._lock:
            text = self._text.get(spec.source.key)
            if text is None:
                text = self._text[spec.source.key] = TextAdapters(loaded.pipe)
        return text

    def deploy(self, spec: FunctionSpec, loaded: LoadedModel) -> None:
        """A deploy's checks, before the function serves: the files' headers against the
        model as loaded here (a built-in model's folder exists only now), their
        text-encoder part loaded where this process encodes, then their denoiser layers
        read and built (the deploy waits): a file that does not fit (a kohya file, a
        single-file model: what the header check cannot see) fails the deploy naming its
        entry, not every invocation."""
        if spec.adapters:
            files = ModelFiles(ModelKind.FOLDER, spec.family, folder=loaded.folder)
            check_adapters(spec.adapters, spec.family, spec.model, files, spec.source.variant)
            if self.encodes_here():
                self.text(spec).load(spec.adapters)
        residency = self.residency(spec)
        use = residency.use(residency.register(spec.adapters))
        try:
            use.read.result()
        except AdapterReadError as exc:
            index = next(i for i, a in enumerate(spec.adapters) if a.path == exc.path)
            raise InvalidSpec(
                f"{exc}: it does not fit this model's denoiser (a LoRA for another base model?)",
                field=f"adapters[{index}].path",
            ) from exc
        finally:
            use.release()

    def inline_encoder(
        self, spec: FunctionSpec, editor: MaskAwareEditor
    ) -> Callable[[EditRequest], Encoded] | None:
        """How the engine thread encodes ``spec``'s invocations when this process encodes
        them: with the function's text-encoder LoRAs active (a bare function's with none,
        under the same lock as a deploy's load); None where the editor's own encode is
        right (no LoRA on the model's encoders, or pre workers encode)."""
        if not self.encodes_here():
            return None
        if spec.adapters:
            text = self.text(spec)
        else:  # a bare function of a model whose encoders hold others' LoRAs: none active
            with self._lock:
                text = self._text.get(spec.source.key)
            if text is None:
                return None

        def encode(request: EditRequest) -> Encoded:
            with text.encoding(spec.adapters):
                return editor.encode(request)

        return encode

    def report(self) -> tuple[tuple[str, ...], AdapterStats]:
        """The resident sets (least recently used first) and the summed counters."""
        with self._lock:
            residencies = list(self._residencies.values())
        return resident_sets(residencies), adapter_stats(residencies)

    def close(self) -> None:
        with self._lock:
            residencies = list(self._residencies.values())
        for residency in residencies:
            residency.close()
