"""LoRA adapters in the engine (``runtime/adapters``) on the tiny SD model.

The served path (every token computed, mask 1.0) with a LoRA at 0.8 equals diffusers'
pipeline with ``load_lora_weights`` + ``set_adapters(..., 0.8)`` called directly; a bake
under the LoRA makes mask-aware edits match its stock edits as closely as the bare model's;
a file is injected once for every set that uses it; sets beyond the byte budget are evicted
least recently used first, never a pinned one; the engine lets an invocation whose adapter
files are still being read wait while other batches step, and swaps sets between groups.
A load attached a layer at a time between another batch's steps equals diffusers' one-piece
``load_lora_adapter`` exactly and changes nothing the running batch computes.
"""

from __future__ import annotations

import dataclasses
import io
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
from peft.tuners.lora import LoraLayer
from PIL import Image

from retouch.functions.adapters import AdapterSpec, adapter_set_id
from retouch.functions.demo.models import ensure_demo_model
from retouch.runtime.adapters import (
    BARE,
    AdapterResidency,
    AdapterUse,
    read_lora,
    resident_sets,
)
from retouch.runtime.engine import Engine, EngineConfig, Work
from retouch.runtime.fingerprint import weights_fingerprint
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.quality import psnr
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.mixedlora import _stack
from retouch.runtime.models import load_pipeline
from tests.lorafiles import write_lora
from tests.runtime.families.cases import CPU, close
from tests.runtime.families.test_strength import SIZE, _diffusers, _request, _served

MODEL, FAMILY, SCALE = "retouch:tiny-sd", "sd-inpaint", 0.8
BUDGET = 1 << 30
STD = 0.3  # LoRA weights that change the tiny model's image clearly


@pytest.fixture(scope="module")
def loras(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Four denoiser-only LoRAs of the tiny SD model."""
    root = tmp_path_factory.mktemp("loras")
    return [str(write_lora(MODEL, models_dir, root / f"l{i}", seed=i, std=STD)) for i in range(4)]


def _pipe(models_dir: Path):
    return load_pipeline(ensure_demo_model(MODEL, models_dir), FAMILY, CPU)


@pytest.fixture(scope="module")
def served(models_dir: Path) -> tuple[MaskAwareEditor, AdapterResidency]:
    pipe = _pipe(models_dir)
    return MaskAwareEditor(pipe, FAMILY, CPU), AdapterResidency(pipe, BUDGET)


def _activate(residency: AdapterResidency, adapters: tuple[AdapterSpec, ...]) -> str:
    set_id = residency.register(adapters)
    use = residency.use(set_id)
    use.read.result(timeout=60)
    use.activate()
    use.release()
    return set_id


def _whole(editor: MaskAwareEditor, **changes) -> EditRequest:
    return _request(editor, np.ones((SIZE, SIZE), bool), seed=21, strength=1.0, **changes)


def test_the_stock_path_with_a_lora_equals_diffusers_load_lora_weights(
    served, loras: list[str], models_dir: Path
) -> None:
    editor, residency = served
    _activate(residency, (AdapterSpec(loras[0], SCALE, "style"),))
    request = _whole(editor)
    with_lora = _served(editor, request)

    reference = _pipe(models_dir)
    reference.load_lora_weights(loras[0], adapter_name="style")
    reference.set_adapters(["style"], [SCALE])
    close(with_lora, _diffusers(MaskAwareEditor(reference, FAMILY, CPU), request))

    _activate(residency, ())  # the bare model again: its own image, not the LoRA's
    bare = _served(editor, request)
    assert psnr(bare, with_lora) < 40
    reference.disable_lora()
    close(bare, _diffusers(MaskAwareEditor(reference, FAMILY, CPU), request))


def _maskaware_vs_stock(editor: MaskAwareEditor, exact: bool, store=None) -> np.ndarray:
    """A mask-aware edit after a bake and its stock edit; ``exact``: the bake had the
    edit's mask, prompt and seed (the mask-aware edit is then the stock one exactly).
    ``store``: read that bake instead of making one."""
    mask = np.zeros((SIZE, SIZE), bool)
    mask[8:40, 12:44] = True
    changes = {"prompt": "a quiet street", "seed": 3} if exact else {}
    request = _request(editor, mask, strength=1.0, negative_prompt="", **{"seed": 5, **changes})
    if store is None:
        store = MemoryActivations()
        template = (request.image, request.template_prompt, request.template_seed, 4, 4.0)
        editor.bake(*template, store, mask=mask if exact else None)
    return editor.edit(request, store, "np"), editor.stock_edit(request, "np"), store


def test_maskaware_edits_after_a_bake_match_as_closely_as_the_bare_models(
    served, loras: list[str]
) -> None:
    """Exact bakes reproduce the stock edit with and without the LoRA; a template bake
    gives a LoRA edit about the bare model's fidelity, and only when baked under the LoRA."""
    editor, residency = served
    lora = (AdapterSpec(loras[1], SCALE, "style"),)
    figures, exact_bakes = {}, {}
    for name, adapters in (("bare", ()), ("lora", lora)):
        _activate(residency, adapters)
        edit, stock, exact_bakes[name] = _maskaware_vs_stock(editor, exact=True)
        close(edit, stock)
        figures[name] = psnr(*_maskaware_vs_stock(editor, exact=False)[:2])
    assert figures["lora"] >= figures["bare"] - 6.0, figures  # random LoRAs: a rougher model
    edit, stock, _ = _maskaware_vs_stock(editor, exact=True, store=exact_bakes["bare"])
    assert psnr(edit, stock) < 40  # the bare model's bake does not serve the LoRA's edits


def test_a_file_is_injected_once_and_sets_evict_least_recently_used(
    loras: list[str], models_dir: Path
) -> None:
    pipe = _pipe(models_dir)
    probe = AdapterResidency(pipe, BUDGET)
    _activate(probe, (AdapterSpec(loras[0], 1.0),))
    one_file = probe.counters.loads and sum(f.nbytes for f in probe._files.values())

    changes: list[tuple[str, ...]] = []  # what the executor's change feed is told
    residency = AdapterResidency(
        _pipe(models_dir),
        budget_bytes=2 * one_file,
        on_change=lambda: changes.append(resident_sets([residency])),
    )
    a = (AdapterSpec(loras[0], 0.5),)
    a_strong = (AdapterSpec(loras[0], 1.5),)  # the same file at another scale
    b, c = (AdapterSpec(loras[1], 1.0),), (AdapterSpec(loras[2], 1.0),)
    ids = [_activate(residency, s) for s in (a, a_strong, b)]
    assert residency.counters.loads == 2  # l0 once for both of its sets, l1
    assert residency.counters.swaps == 3
    assert resident_sets([residency]) == tuple(ids)  # least recently used first
    assert changes[-1] == tuple(ids) and len(changes) == 3  # each set as it became resident

    pinned = residency.use(ids[0])  # an invocation of a holds it
    _activate(residency, c)  # three files over a budget of two: evict, but not a
    assert residency.counters.evictions == 1
    assert adapter_set_id(b) not in changes[-1]  # the eviction was told too
    assert set(resident_sets([residency])) == {ids[0], ids[1], adapter_set_id(c)}
    pinned.release()
    key = residency.weights_key()
    _activate(residency, b)  # b's file again: a new injection, another weights key
    assert residency.counters.loads == 4
    _activate(residency, c)
    assert residency.weights_key() != key


def test_the_fingerprint_follows_the_adapter_files_and_scales(loras: list[str]) -> None:
    bare = weights_fingerprint("m", ())
    one = weights_fingerprint("m", (AdapterSpec(loras[0], 0.8, "x"),))
    assert bare == "m"
    assert one != weights_fingerprint("m", (AdapterSpec(loras[0], 0.7, "x"),))
    assert one != weights_fingerprint("m", (AdapterSpec(loras[1], 0.8, "x"),))
    assert one == weights_fingerprint("m", (AdapterSpec(loras[0], 0.8, "renamed"),))


def _work(editor: MaskAwareEditor, request: EditRequest, use: AdapterUse) -> Work:
    return Work(
        key=("m", use.set_id),
        model="m",
        family=FAMILY,
        scheduler="pndm",
        editor=editor,
        request=request,
        fmt="png",
        acquire=lambda: (None, {}),
        adapters=use,
    )


def test_the_engine_steps_other_batches_while_an_adapter_is_read(served, loras: list[str]):
    """A LoRA invocation waits outside the batch until its file is read; the bare batch
    keeps stepping meanwhile; each gets the image it gets alone (no bleed)."""
    editor, residency = served
    lora = (AdapterSpec(loras[2], SCALE, "style"),)
    set_id = residency.register(lora)
    residency.use(set_id).read.result(timeout=60)
    long = dataclasses.replace(_whole(editor), steps=40)
    short = _whole(editor)
    alone = {}
    for name, adapters, request in (("bare", (), long), ("lora", lora, short)):
        _activate(residency, adapters)
        state = editor.prepare(request, None)  # its whole edit, on its own
        while not state.done:
            editor.step([state])
        alone[name] = editor.finish(state, "np")

    engine = Engine(EngineConfig(disaggregated=False), stages=None).start()
    try:
        swaps = residency.counters.swaps
        bare = engine.submit(_work(editor, long, residency.use(BARE)))
        gate: Future[None] = Future()  # the LoRA's read, held back by the test
        waiting = _work(editor, short, AdapterUse(residency, set_id, gate))
        lora_future = engine.submit(waiting)
        time.sleep(0.5)
        steps = engine.counters.steps
        assert engine.load()["adapter_waits"] == 1
        time.sleep(0.5)
        assert engine.counters.steps > steps  # the bare batch did not wait for it
        gate.set_result(None)
        lora_out = lora_future.result(timeout=120)["output"]
        bare_out = bare.result(timeout=300)["output"]
    finally:
        engine.stop()
    assert residency.counters.swaps > swaps
    for name, out in (("bare", bare_out), ("lora", lora_out)):
        pixels = np.asarray(Image.open(io.BytesIO(out.image))).astype(np.float32) / 255
        assert psnr(pixels, alone[name]) >= 45, name  # its own image, up to 8-bit rounding


def _run(editor: MaskAwareEditor, request: EditRequest, between=None) -> np.ndarray:
    """A whole edit on its own, ``between()`` called before each of its steps."""
    state = editor.prepare(request, None)
    while not state.done:
        if between is not None:
            between()
        editor.step([state])
    return editor.finish(state, "np")


def test_a_load_in_slices_between_steps_equals_a_one_piece_load(
    loras: list[str], models_dir: Path
) -> None:
    """A file attached a few layers at a time between the steps of a bare edit (into new wrappers, then into
    wrappers another file made) leaves that edit exactly the bare one, and its sets give
    exactly what diffusers' ``load_lora_adapter`` (one piece) gives."""
    pipe = _pipe(models_dir)
    editor, residency = MaskAwareEditor(pipe, FAMILY, CPU), AdapterResidency(pipe, BUDGET)
    reference = _pipe(models_dir)
    for i, path in enumerate(loras[:2]):
        weights, alphas = read_lora(type(reference), path)
        reference.unet.load_lora_adapter(
            weights, prefix="unet", network_alphas=alphas, adapter_name=f"l{i}"
        )
    reference_editor = MaskAwareEditor(reference, FAMILY, CPU)
    request = _whole(editor)
    reference.unet.disable_lora()
    bare = _run(reference_editor, request)

    sets = [
        (AdapterSpec(loras[0], SCALE),),
        (AdapterSpec(loras[0], 0.5), AdapterSpec(loras[1], 1.2)),
    ]
    uses = [residency.use(residency.register(s)) for s in sets]
    for use in uses:
        use.read.result(timeout=60)
    for use in uses:  # l0 alone into new wrappers, then l1 into l0's wrappers
        slices = []

        def some_layers(use=use, slices=slices) -> None:
            for _ in range(16):  # a layer a slice: its ~56 layers in the edit's 4 steps
                if not use.resident:
                    slices.append(use.load_step(0.0))

        assert np.array_equal(_run(editor, request, some_layers), bare)
        assert len(slices) > 1 and slices[-1], "loaded in more than one slice"
    assert residency.counters.loads == 2

    for use, names in zip(uses, (["l0"], ["l0", "l1"]), strict=True):
        use.activate()
        reference.unet.enable_lora()
        reference.unet.set_adapters(names, list(residency._sets[use.set_id].scales.values()))
        assert np.array_equal(_run(editor, request), _run(reference_editor, request))
        use.release()


def test_a_running_batch_steps_while_a_read_adapter_is_attached(served, loras: list[str]) -> None:
    """An invocation whose set is read but not in the denoiser waits in the ready queue
    while the bare batch steps and its layers attach between those steps (one layer an
    iteration here); then it joins, and each gets its own image."""
    editor, residency = served
    lora = (AdapterSpec(loras[3], SCALE, "late"),)
    set_id = residency.register(lora)
    residency.use(set_id).read.result(timeout=60)
    long = dataclasses.replace(_whole(editor), steps=40)
    short = _whole(editor)
    _activate(residency, ())
    bare_alone = _run(editor, long)
    loads = residency.counters.loads

    engine = Engine(EngineConfig(disaggregated=False, adapter_load_share=0.0), stages=None)
    engine.start()
    stepped: list[float] = []
    try:
        bare_work = _work(editor, long, residency.use(BARE))
        bare_work.on_step = lambda done, total: stepped.append(time.perf_counter())
        bare = engine.submit(bare_work)
        while len(stepped) < 2:
            time.sleep(0.01)
        waiting = _work(editor, short, residency.use(set_id))
        submitted = time.perf_counter()
        lora_out = engine.submit(waiting).result(timeout=120)["output"]
        bare_out = bare.result(timeout=300)["output"]
    finally:
        engine.stop()
    assert residency.counters.loads == loads + 1
    assert sum(submitted < t < waiting.joined for t in stepped) >= 2  # it waited, they stepped
    lora_alone = _run(editor, short)  # its set is active now
    for name, out, alone in (("bare", bare_out, bare_alone), ("lora", lora_out, lora_alone)):
        pixels = np.asarray(Image.open(io.BytesIO(out.image))).astype(np.float32) / 255
        assert psnr(pixels, alone) >= 45, name  # its own image, up to 8-bit rounding


def test_built_layers_count_in_the_budget_before_they_are_attached(
    loras: list[str], models_dir: Path
) -> None:
    """Layers built in the background already hold memory (beside the base layers, on the
    device): sets read at deploy and never used are dropped beyond the budget, by the reader
    itself, least recently used first, never a pinned one."""
    probe = AdapterResidency(_pipe(models_dir), BUDGET)
    _activate(probe, (AdapterSpec(loras[0], 1.0),))
    one_file = sum(f.nbytes for f in probe._files.values())
    residency = AdapterResidency(_pipe(models_dir), budget_bytes=2 * one_file)
    pinned = residency.use(residency.register((AdapterSpec(loras[0], 1.0),)))
    for path in loras[1:3]:
        residency.use(residency.register((AdapterSpec(path, 1.0),))).release()
    residency.use(residency.register((AdapterSpec(loras[3], 1.0),))).read.result(timeout=60)
    kept = set(residency._files)
    assert len(kept) == 2 and loras[0] in kept and loras[3] in kept  # pinned, and the newest
    assert residency.counters.evictions == 2 and residency.counters.loads == 0
    pinned.release()


def test_mixed_steps_stacks_count_in_the_budget(loras: list[str], models_dir: Path) -> None:
    """A mixed step's per-layer stacks are a second copy of its files' weights: they count
    in the byte budget, so a step that builds them evicts an unpinned set the files alone
    left room for; the count is the bytes the stacks take when built."""
    probe = AdapterResidency(_pipe(models_dir), BUDGET)
    _activate(probe, (AdapterSpec(loras[0], 1.0),))
    one_file = sum(f.nbytes for f in probe._files.values())
    residency = AdapterResidency(_pipe(models_dir), budget_bytes=int(3.5 * one_file))
    a, b, c = ((AdapterSpec(loras[i], 1.0),) for i in range(3))
    ids = [_activate(residency, s) for s in (c, a, b)]  # c the least recently used
    assert residency.counters.evictions == 0  # three files fit
    uses = [residency.use(i) for i in ids[1:]]
    try:
        plan = residency.rows(ids[1:], 1, CPU)
        assert residency.counters.evictions == 1
        assert set(resident_sets([residency])) == set(ids[1:])
        layers = [
            m
            for m in residency.denoiser.modules()
            if isinstance(m, LoraLayer) and any(n in m.lora_A for n in plan.slots if n)
        ]
        built = sum(s.a.nbytes + s.b.nbytes for s in (_stack(m, plan) for m in layers))
        assert residency._stacked == built > 0
    finally:
        for use in uses:
            use.release()
