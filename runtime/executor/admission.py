"""Admission: an executor invocation checked and turned into the engine's :class:`Work`.

Runs on the event loop thread, so it only does cheap work: look the function and template
up (an uploaded image becomes an ad-hoc template), check the mask and the family's limits
(a 4xx naming the field), choose the mask-aware or the stock path, and pin the adapter
set the edit runs with. Nothing here waits on a load, a bake or a step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from retouch.functions.errors import BadRequest, NotFound
from retouch.functions.families import check_edit, check_reference
from retouch.functions.imaging import mask_ratio
from retouch.functions.spec import FunctionSpec
from retouch.functions.wire.codec import RawArray
from retouch.functions.wire.invoke import CacheTier, ExecutorInvoke, InvokePath
from retouch.runtime.engineconfig import EngineConfig
from retouch.runtime.executor.adapterhost import AdapterHost
from retouch.runtime.executor.bakes import BakeQueue
from retouch.runtime.executor.editors import Editors
from retouch.runtime.executor.registry import FunctionEntry, FunctionRegistry
from retouch.runtime.maskaware.editor import MaskAwareEditor
from retouch.runtime.maskaware.request import EditRequest
from retouch.runtime.pathchoice import PathChoice, choose_path
from retouch.runtime.prediction import MaskFootprint
from retouch.runtime.templates import BakeState, Template, TemplateCache
from retouch.runtime.work import OnStep, Work


@dataclass(frozen=True)
class Edit:
    """A checked invocation: its function, template (the one it edits, before a variant
    is chosen) and mask."""

    inv: ExecutorInvoke
    entry: FunctionEntry
    template: Template
    mask: np.ndarray  # bool, the template's size
    scheduler: str  # the one the edit runs with
    arrived: float  # perf_counter when it was checked

    @property
    def spec(self) -> FunctionSpec:
        return self.entry.spec

    @property
    def empty(self) -> bool:
        """Nothing to edit: answered with the template, without running the model."""
        return not self.mask.any()

    def request(self, template: Template, reference: Image.Image | None) -> EditRequest:
        """The editor's request: ``template``'s image, prompt and seed (the variant whose
        activations it reuses), this invocation's mask, prompt and settings."""
        inv, spec = self.inv, self.entry.spec
        return EditRequest(
            image=template.image,
            mask=self.mask,
            prompt=inv.prompt,
            seed=inv.seed,
            steps=inv.steps,
            guidance=inv.guidance,
            template_prompt=template.prompt,
            template_seed=template.seed,
            full_steps=spec.full_steps,
            halo=spec.halo,
            negative_prompt=inv.negative_prompt,
            strength=inv.strength,
            reference=reference,
        )


@dataclass(frozen=True)
class Admitted:
    """What admission made of an edit: the engine's work, and the path it chose (and why:
    ``path_reason`` in the answer)."""

    work: Work
    choice: PathChoice


class InvocationAdmission:
    """Checks invocations and makes the engine's work of them."""

    def __init__(
        self,
        registry: FunctionRegistry,
        templates: TemplateCache,
        editors: Editors,
        adapters: AdapterHost,
        bakes: BakeQueue,
        engine: EngineConfig,
        *,
        maskaware: bool = True,
        path_choice: str = "auto",
    ) -> None:
        self.registry = registry
        self.templates = templates
        self.editors = editors
        self.adapters = adapters
        self.bakes = bakes
        self.engine = engine
        self.maskaware = maskaware  # False: every token computed, no cache (comparisons)
        self.path_choice = path_choice  # "auto" or "maskaware" (--path-choice)

    def check(self, inv: ExecutorInvoke) -> Edit:
        """The invocation checked (raises a 4xx naming the field on bad input)."""
        entry = self.registry.entry(inv.function)
        if inv.image is not None:
            template = self._upload(entry, inv)
        else:
            template = self.templates.get(inv.function, inv.template)
        if template is None:
            raise NotFound(
                f"unknown template {inv.template!r}", field="template", code="template_not_found"
            )
        mask = inv.mask.to_numpy().astype(bool)
        if mask.shape != (template.image.height, template.image.width):
            raise BadRequest(
                "mask does not match the template size", field="mask", code="mask_size_mismatch"
            )
        spec = entry.spec
        check_edit(spec.family, inv.steps, inv.strength, inv.negative_prompt)
        scheduler = spec.request_scheduler(inv.scheduler or None)
        return Edit(inv, entry, template, mask, scheduler, time.perf_counter())

    def admit(self, edit: Edit, on_step: OnStep | None = None) -> Admitted:
        """The engine's work for a non-empty edit, its adapter set pinned (the caller
        submits it, and releases the set if the submit fails)."""
        inv, spec, template = edit.inv, edit.spec, edit.template
        covered = self.maskaware and template.covers(inv.steps, inv.guidance)
        found = CacheTier.NONE
        editor = self.editors.get(spec, edit.scheduler)  # built at deploy, before registered
        choice = self._path_choice(spec, template, inv, edit.mask)
        covered = covered and choice.path is InvokePath.MASKAWARE
        if covered:  # at strength < 1 or another scheduler its variant: that trajectory's bake
            config = dict(editor.impl.pipe.scheduler.config)
            template = self.templates.variant(
                spec, template, inv.strength, edit.scheduler, edit.entry.fingerprint, config
            )
            found = self.templates.tier(template)  # where placement found it
            self.templates.prefetch(template)  # disk -> host while the invocation queues
        request = edit.request(template, self._reference(spec, inv, template.image.size))
        encode_inline = self.adapters.inline_encoder(spec, editor)
        apart = self._apart(spec, editor, covered)
        # pinned from here: nothing that can fail comes between this and the submit's try
        adapters = self.adapters.residency(spec).use(spec.adapter_set)  # read now if not in memory
        work = Work(
            key=(spec.source.key, edit.scheduler, spec.width, spec.height, *apart),
            model=spec.source.key,
            family=spec.family,
            scheduler=edit.scheduler,
            editor=editor,
            request=request,
            fmt=inv.format,
            acquire=lambda: self._acquire(template, covered, found),
            arrived=edit.arrived,
            on_step=on_step,
            feather_px=spec.feather_px if spec.composite else None,
            adapters=adapters,
            text_adapters=spec.adapters,
            encode_inline=encode_inline,
        )
        return Admitted(work, choice)

    def _apart(self, spec: FunctionSpec, editor: MaskAwareEditor, covered: bool) -> tuple[Any, ...]:
        """What keeps an edit's step apart from others of its model, size and scheduler."""
        # Bucketed steps pad every row to the batch's largest mask: a stock edit (every
        # token) would pad its batch-mates to full, so with buckets the paths batch apart.
        apart: tuple[Any, ...] = (covered,) if editor.buckets is not None else ()
        # Adapter sets batch together in mixed steps; a CUDA graph holds one set's weights
        # (and pads batches by repeating a row), so with graphs sets batch apart.
        if not self.engine.mixed_adapters or editor.buckets is not None:
            apart = (spec.adapter_set, *apart)
        return apart

    def _path_choice(
        self, spec: FunctionSpec, template: Template, inv: ExecutorInvoke, mask: Any
    ) -> PathChoice:
        """Mask-aware or stock for this edit, and why (``path_reason`` in the answer)."""
        if not self.maskaware:
            return PathChoice(InvokePath.STOCK, "mask-aware steps are off on this executor")
        if inv.image_reference is not None:
            return PathChoice(
                InvokePath.STOCK,
                "another reference image than the template: every token computed (the "
                "bake's reference tokens are the template's)",
            )
        if not template.covers(inv.steps, inv.guidance):
            return PathChoice(
                InvokePath.STOCK,
                f"the template is baked for {template.steps} steps at guidance "
                f"{template.guidance:g}, not {inv.steps} at {inv.guidance:g}: every token computed",
            )
        if self.path_choice == "maskaware":
            return PathChoice(InvokePath.MASKAWARE, "mask-aware: --path-choice maskaware")
        times, cost_model = self.editors.lookup(spec.source.key)
        grids = cost_model.extra.get("grids") if cost_model is not None else None
        if not grids:
            return choose_path(times, mask_ratio(mask))
        footprint = MaskFootprint.of(np.asarray(mask, dtype=bool), spec.halo)
        px = round(math.sqrt(mask.size / grids[0]))  # the finest grid's token, in pixels
        return choose_path(times, footprint.masked.get(px, mask.sum() / px**2) / grids[0])

    @staticmethod
    def _reference(
        spec: FunctionSpec, inv: ExecutorInvoke, size: tuple[int, int]
    ) -> Image.Image | None:
        """The edit's own reference image (the gateway decoded it at the edited image's
        ``size``), for the families that read one; None: the template is the reference."""
        if inv.image_reference is None:
            return None
        check_reference(spec.family)
        return _rgb8(inv.image_reference, size, "image_reference")

    def _upload(self, entry: FunctionEntry, inv: ExecutorInvoke) -> Template:
        """The ad-hoc template of an uploaded image (the gateway decoded and checked it)."""
        spec = entry.spec
        assert inv.image is not None
        image = _rgb8(inv.image, (spec.width, spec.height), "image")
        if spec.uploads.max_images == 0:
            raise BadRequest(
                f"function {spec.name!r} does not accept uploaded images",
                field="image",
                code="uploads_disabled",
            )
        return self.templates.upload(
            spec, inv.template, image, entry.fingerprint, entry.scheduler_config
        )

    def _acquire(
        self, template: Template, covered: bool, found: CacheTier
    ) -> tuple[Any, dict[str, Any]]:
        """At join (engine thread): the template's host-resident activations when it is
        baked for these settings; otherwise no reader (every token computed, i.e. the stock
        result) and the template is queued for baking (insert on miss). ``found``: its tier
        when the invocation arrived, reported beside the tier the read found."""
        if covered and template.state is BakeState.BAKED:
            got = self.templates.acquire(template)
            if got.handle is not None:
                return got.handle, {"tier": got.tier, "wait_ms": got.wait_ms, "found": found.value}
        if covered:
            self.bakes.queue(template)
        return None, {"tier": CacheTier.NONE.value, "wait_ms": 0.0, "found": found.value}


def _rgb8(array: RawArray, size: tuple[int, int], field: str) -> Image.Image:
    """An image the gateway decoded (RGB8 ``[H, W, 3]``) of ``size``, else a 400 naming
    ``field``."""
    pixels = array.to_numpy()
    if pixels.dtype != "uint8" or pixels.shape != (size[1], size[0], 3):
        raise BadRequest(
            f"{field} must be RGB8 of {size[0]}x{size[1]}, got {array.dtype} {list(pixels.shape)}",
            field=field,
            code="image_size_mismatch",
        )
    return Image.fromarray(np.ascontiguousarray(pixels), "RGB")
