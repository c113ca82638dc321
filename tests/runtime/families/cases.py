"""What the family tests share: the acceptance bound, a CPU flop rule for SDPA, and one
family's masks, requests, exact bakes and the checks every family passes alike (batch vs
solo, the worker pipeline, counted vs analytic FLOPs) at a test size; each family module
names its :class:`Case` and keeps its own checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from retouch.functions.adapters import AdapterSpec
from retouch.functions.demo.images import template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.runtime.adapters import AdapterResidency
from retouch.runtime.families import family
from retouch.runtime.families.stepflops import pipeline_step_flops
from retouch.runtime.maskaware.context import Mode
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.loader import LoadMode, RowLoader, attach
from retouch.runtime.maskaware.quality import psnr
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.models import load_pipeline
from tests.lorafiles import write_lora

EQUAL_DB = 60.0  # the acceptance bound, mask-aware vs stock
CPU = torch.device("cpu")
CPU_ATTENTION = {  # torch's flop counter knows SDPA's CUDA kernels, not the CPU one
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: (
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)
    )
}


def close(a: np.ndarray, b: np.ndarray) -> None:
    assert psnr(a, b) >= EQUAL_DB and np.abs(a - b).max() <= 1e-4


@dataclass(frozen=True)
class Case:
    """One family's test inputs: template 7 at ``size``, ``steps`` steps, ``guidance``."""

    family: str
    guidance: float = 4.0
    size: int = 128
    steps: int = 2

    def rect(self, top: int, left: int, height: int, width: int) -> np.ndarray:
        mask = np.zeros((self.size, self.size), dtype=bool)
        mask[top : top + height, left : left + width] = True
        return mask

    def request(
        self, mask: np.ndarray, prompt: str, seed: int, template: tuple[str, int]
    ) -> EditRequest:
        image = template_image((self.size, self.size), 7)
        return EditRequest(image, mask, prompt, seed, self.steps, self.guidance, *template)

    def fixtures(self, model: str) -> tuple[Any, Any, Any]:
        """Module-scoped fixtures ``folder`` (built-in ``model``'s), ``pipe`` (loaded on the
        CPU) and ``baked`` (:meth:`baked`), for a test module to bind under those names."""

        @pytest.fixture(scope="module")
        def folder(models_dir: Path) -> Path:
            return ensure_demo_model(model, models_dir)

        @pytest.fixture(scope="module")
        def pipe(folder: Path) -> DiffusionPipeline:
            return load_pipeline(folder, self.family, CPU)

        @pytest.fixture(scope="module")
        def baked(pipe: DiffusionPipeline) -> MemoryActivations:
            return self.baked(MaskAwareEditor(pipe, self.family, CPU))

        return folder, pipe, baked

    def assert_exact_cache_gives_the_stock_edit(
        self, pipe: DiffusionPipeline, mask: np.ndarray
    ) -> None:
        """Baked with the edit's own mask, prompt and seed, the mask-aware edit is the stock
        pipeline's with the same composed noise: max |Δ| ≤ 1e-5 (fp32)."""
        editor = MaskAwareEditor(pipe, self.family, CPU)
        request, store = self.exact(editor, mask)
        ours, stock = editor.edit(request, store, "np"), editor.stock_edit(request, "np")
        close(ours, stock)
        assert np.abs(ours - stock).max() <= 1e-5  # the acceptance bound, fp32

    def assert_uncached_edit_gives_the_stock_edit(self, pipe: DiffusionPipeline) -> None:
        """A template not baked yet (every token computed), the request's seed not the
        template's: the edit is the stock pipeline's with the same composed noise (the
        template's outside the mask, the request's inside), max |Δ| ≤ 1e-5."""
        editor = MaskAwareEditor(pipe, self.family, CPU)
        request = self.request(self.rect(12, 20, 40, 50), "a red door", 5, ("a quiet street", 3))
        state = editor.prepare(request, None)
        while not state.done:
            editor.step([state])
        ours = editor.finish(state, "np")
        assert np.abs(ours - editor.stock_edit(request, "np")).max() <= 1e-5

    def baked(self, editor: MaskAwareEditor) -> MemoryActivations:
        """Template 7 baked with its own prompt and seed (``"a quiet street"``, 3), nothing
        masked: what the requests of ``request(..., ("a quiet street", 3))`` read."""
        store = MemoryActivations()
        image = template_image((self.size, self.size), 7)
        editor.bake(image, "a quiet street", 3, self.steps, self.guidance, store)
        return store

    def exact(
        self, editor: MaskAwareEditor, mask: np.ndarray
    ) -> tuple[EditRequest, MemoryActivations]:
        """A request and a cache baked with its own mask, prompt and seed."""
        request = self.request(mask, "a red door", 11, ("a red door", 11))
        store = MemoryActivations()
        editor.bake(request.image, "a red door", 11, self.steps, self.guidance, store, mask=mask)
        return request, store

    def assert_plans_and_the_loader_change_nothing(
        self,
        editor: MaskAwareEditor,
        request: EditRequest,
        store: MemoryActivations,
        plans: list[dict[str, Mode]],
    ) -> None:
        """Each of ``plans`` (a mode per block) gives the all-sparse edit (within 1e-5), and
        the overlapped row loader gives it to the bit."""
        reference = editor.edit(request, store, "np")
        for modes in plans:
            editor.set_planner(lambda states, blocks, modes=modes: modes)
            assert np.abs(editor.edit(request, store, "np") - reference).max() <= 1e-5
        editor.set_planner(lambda states, blocks: dict.fromkeys(blocks, Mode.SPARSE))
        attach(editor, RowLoader.for_editor(editor, LoadMode.OVERLAPPED))
        try:
            assert np.array_equal(editor.edit(request, store, "np"), reference)
        finally:
            attach(editor, None)

    def assert_batch_gives_solo(self, editor: MaskAwareEditor, store: MemoryActivations) -> None:
        """Two requests stepped in one batch end where each ends alone."""
        requests = [
            self.request(self.rect(12, 20, 40, 50), "a red door", 5, ("a quiet street", 3)),
            self.request(self.rect(60, 60, 20, 30), "a blue car", 6, ("a quiet street", 3)),
        ]
        solo = [editor.edit(r, store, "np") for r in requests]
        states = [editor.prepare(r, store) for r in requests]
        while not states[0].done:
            editor.step(states)
        for state, alone in zip(states, solo, strict=True):
            assert np.abs(editor.finish(state, "np") - alone).max() <= 1e-4

    def assert_worker_encodes_and_decodes_alike(
        self, pipe: DiffusionPipeline, folder: Path, latents: torch.Tensor
    ) -> set[str]:
        """A pre/post worker's pipeline (no denoiser) encodes a request and decodes
        ``latents`` exactly as the whole pipeline does; returns the encoded tensors' names."""
        editor = MaskAwareEditor(pipe, self.family, CPU)
        light = load_pipeline(folder, self.family, CPU, without=family(self.family).denoisers)
        worker = MaskAwareEditor(light, self.family, CPU)
        assert not worker.has_denoiser
        request = self.request(self.rect(12, 20, 40, 50), "a red door", 5, ("a quiet street", 3))
        ours, theirs = editor.encode(request).tensors, worker.encode(request).tensors
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
        assert np.array_equal(
            editor.decode(latents, request, "np"), worker.decode(latents, request, "np")
        )
        return set(ours)

    def counted_flops_ratio(
        self, pipe: DiffusionPipeline, requests: list[EditRequest], store: MemoryActivations
    ) -> float:
        """One step of ``requests`` (one mask) counts exactly the analytic FLOPs, mask-aware
        and with every block full (``stepflops``); returns the analytic ratio of the two."""
        ratio = float(requests[0].mask.mean())
        analytic = pipeline_step_flops(
            pipe, self.family, self.size, self.size, ratio, batch=len(requests)
        )

        def counted(editor: MaskAwareEditor) -> int:
            states = [editor.prepare(r, store) for r in requests]
            with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
                editor.step(states)
            return counter.get_total_flops()

        def every_block_full(step: object, blocks: list[str]) -> dict[str, Mode]:
            return dict.fromkeys(blocks, Mode.FULL)

        full_plan = MaskAwareEditor(pipe, self.family, CPU, plan=every_block_full)
        assert counted(MaskAwareEditor(pipe, self.family, CPU)) == pytest.approx(
            analytic.maskaware.total, rel=1e-9
        )
        assert counted(full_plan) == pytest.approx(analytic.full.total, rel=1e-9)
        return analytic.ratio

    def assert_counted_flops_at_the_padded_text(
        self, pipe: DiffusionPipeline, store: MemoryActivations, mask: np.ndarray
    ) -> float:
        """One step of two requests with ``mask`` (of ratio ``mask.mean()``, aligned to the
        tokens) counts the family's formula at their text length (prompts vary in length:
        the formula takes the padded one), mask-aware and with every block full; returns
        the counted ratio of the two (the Qwen families' text varies with the prompt)."""
        requests = [self.request(mask, "xyz", 2 + i, ("a quiet street", 3)) for i in range(2)]
        model = family(self.family)
        latent = model.model.latent_grid(pipe, self.size, self.size)
        config = pipe.transformer.config

        def counted(editor: MaskAwareEditor) -> tuple[int, int]:
            states = [editor.prepare(r, store) for r in requests]
            with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
                editor.step(states)
            text = max(s.inputs.prompt_embeds.shape[1] for s in states)
            return counter.get_total_flops(), text

        def every_block_full(step: object, blocks: list[str]) -> dict[str, Mode]:
            return dict.fromkeys(blocks, Mode.FULL)

        rows = model.rows_per_request * len(requests)
        sparse, text_len = counted(MaskAwareEditor(pipe, self.family, CPU))
        full, _ = counted(MaskAwareEditor(pipe, self.family, CPU, plan=every_block_full))
        ratio = float(mask.mean())
        analytic = model.step_flops(config, latent, text_len, ratio).total * rows
        assert sparse == pytest.approx(analytic, rel=1e-9)
        analytic_full = model.step_flops(config, latent, text_len, 1.0).total * rows
        assert full == pytest.approx(analytic_full, rel=1e-9)
        return sparse / full

    def lora_edit_and_stock(
        self, model: str, folder: Path, models_dir: Path, tmp_path: Path, std: float = 0.3
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A LoRA of the transformer's attention (diffusers' layout, ``write_lora``, weights
        drawn with ``std``) attached as an executor attaches adapters: the mask-aware edit
        after a bake under it (exact cache), the stock pipeline's edit with
        ``load_lora_weights``, and the edit without the LoRA."""
        lora = write_lora(model, models_dir, tmp_path, family=self.family, std=std)
        pipe = load_pipeline(folder, self.family, CPU)
        editor = MaskAwareEditor(pipe, self.family, CPU)
        door = self.rect(12, 20, 40, 50)
        bare = editor.stock_edit(self.exact(editor, door)[0], "np")
        residency = AdapterResidency(pipe, 1 << 30)
        use = residency.use(residency.register((AdapterSpec(str(lora), 0.8, "style"),)))
        use.read.result(timeout=60)
        use.activate()
        use.release()
        request, store = self.exact(editor, door)
        ours = editor.edit(request, store, "np")
        reference = load_pipeline(folder, self.family, CPU)
        reference.load_lora_weights(str(lora), adapter_name="style")
        reference.set_adapters(["style"], [0.8])
        stock = MaskAwareEditor(reference, self.family, CPU).stock_edit(request, "np")
        return ours, stock, bare
