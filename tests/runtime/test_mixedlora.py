"""Mixed-adapter steps (``runtime/mixedlora``): a batch whose requests run different LoRA
sets — one file, another file, two files at their own scales, the first file at another
scale, and the bare model — gives every request the pixels it gets alone under its set
(peft's ``set_adapters``), on the stock path (every token) and the mask-aware path (each
set's own bake), for a UNet (tiny-sd, two model rows per request) and a DiT (tiny-flux);
and the engine forms one batch of them instead of taking turns."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from retouch.functions.adapters import AdapterSpec
from retouch.functions.demo.models import ensure_demo_model
from retouch.runtime.adapters import AdapterResidency
from retouch.runtime.engine import Engine, EngineConfig, Work
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.quality import psnr
from retouch.runtime.maskaware.request import RequestState
from retouch.runtime.maskaware.store import MemoryActivations
from retouch.runtime.mixedlora import drop_stacks, rows_with
from retouch.runtime.models import load_pipeline
from tests.lorafiles import write_lora
from tests.runtime.families.cases import CPU
from tests.runtime.families.test_strength import SIZE, _request

MODELS = {"sd-inpaint": "retouch:tiny-sd", "flux-inpaint": "retouch:tiny-flux"}
TOLERANCE = 1e-5  # max abs, fp32 images in [0, 1]: other GEMM shapes, same arithmetic
STEPS = 2


def _sets(files: list[str]) -> list[tuple[AdapterSpec, ...]]:
    """Four different sets and the bare model."""
    return [
        (AdapterSpec(files[0], 0.8, "a"),),
        (AdapterSpec(files[1], 0.8, "b"),),
        (AdapterSpec(files[2], 0.5, "c"), AdapterSpec(files[3], 0.7, "d")),
        (AdapterSpec(files[0], 0.3, "a"),),
        (),
    ]


@pytest.fixture(scope="module", params=sorted(MODELS))
def served(request, models_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    family = request.param
    model = MODELS[family]
    root = tmp_path_factory.mktemp(f"loras-{family}")
    files = [
        str(write_lora(model, models_dir, root / f"l{i}", family=family, seed=i, std=0.3))
        for i in range(4)
    ]
    pipe = load_pipeline(ensure_demo_model(model, models_dir), family, CPU)
    residency = AdapterResidency(pipe, 1 << 30)
    ids = []
    for adapters in _sets(files):
        set_id = residency.register(adapters)
        residency.use(set_id).read.result(timeout=120)
        ids.append(set_id)
    return MaskAwareEditor(pipe, family, CPU), residency, ids


def _requests(editor: MaskAwareEditor, n: int) -> list[EditRequest]:
    """Masks of different sizes: a packed batch's rows hold different token counts."""
    requests = []
    for i in range(n):
        mask = np.zeros((SIZE, SIZE), bool)
        mask[8 : 24 + 6 * i, 12 : 30 + 4 * i] = True
        requests.append(_request(editor, mask, seed=5 + i, strength=1.0, steps=STEPS))
    return requests


def _alone(editor, residency, set_id, request, reader) -> np.ndarray:
    residency.activate(set_id)
    state = editor.prepare(request, reader)
    while not state.done:
        editor.step([state])
    return editor.finish(state, "np")


def _mixed(editor, residency, ids, requests, readers, packed=False) -> list[np.ndarray]:
    states: list[RequestState] = [
        editor.prepare(r, reader) for r, reader in zip(requests, readers, strict=True)
    ]
    per = editor.impl.rows_per_request
    while not states[0].done:
        plan = residency.rows(ids, per, editor.device)
        with rows_with(residency.denoiser, plan):
            editor.step(states, packed=packed)
    return [editor.finish(s, "np") for s in states]


def _bakes(editor, residency, ids, requests) -> list[MemoryActivations]:
    """Each set's template bake (its own activations: a LoRA changes them)."""
    stores = []
    for set_id, request in zip(ids, requests, strict=True):
        residency.activate(set_id)
        store = MemoryActivations()
        template = (request.image, request.template_prompt, request.template_seed)
        editor.bake(*template, STEPS, request.guidance, store)
        stores.append(store)
    return stores


@pytest.fixture(scope="module")
def stock_alone(served) -> tuple[list[EditRequest], list[np.ndarray]]:
    """Each request's stock edit alone under its set (peft's ``set_adapters``)."""
    editor, residency, ids = served
    requests = _requests(editor, len(ids))
    alone = [_alone(editor, residency, i, r, None) for i, r in zip(ids, requests, strict=True)]
    assert min(psnr(alone[0], other) for other in alone[1:]) < 40  # the sets differ
    return requests, alone


def _check_mixed(served, requests, alone, readers, packed=False) -> None:
    """The five sets in one batch (a row with two files: the general path), then the four
    whose rows have one file or none (the dense path)."""
    editor, residency, ids = served
    for keep in (range(len(ids)), (0, 1, 3, 4)):
        together = _mixed(
            editor, residency, [ids[i] for i in keep], [requests[i] for i in keep],
            [readers[i] for i in keep], packed,
        )  # fmt: skip
        for i, mine in zip(keep, together, strict=True):
            assert np.abs(mine - alone[i]).max() <= TOLERANCE, (list(keep), ids[i], packed)


def test_a_mixed_stock_batch_gives_each_request_its_lone_pixels(served, stock_alone) -> None:
    requests, alone = stock_alone
    _check_mixed(served, requests, alone, [None] * len(requests))


def test_stacks_dropped_as_a_sleep_drops_them_are_built_again(served, stock_alone) -> None:
    """A sleep frees the mixed stacks with the weights (they are device tensors outside the
    parameters, ``drop_stacks``); the next mixed step builds them again, same pixels."""
    residency = served[1]
    requests, alone = stock_alone
    _check_mixed(served, requests, alone, [None] * len(requests))
    layers = list(residency.denoiser.modules())
    assert any(getattr(m, "_retouch_stack", None) is not None for m in layers)
    drop_stacks(residency.denoiser)
    assert all(getattr(m, "_retouch_stack", None) is None for m in layers)
    _check_mixed(served, requests, alone, [None] * len(requests))


def test_a_mixed_maskaware_batch_gives_each_request_its_lone_pixels(served) -> None:
    """Each request reads its own set's template bake; padded, and packed where the
    family's layers take it (the UNet: the engine's mixed steps run packed there)."""
    editor, residency, ids = served
    requests = _requests(editor, len(ids))
    readers = _bakes(editor, residency, ids, requests)
    alone = [
        _alone(editor, residency, i, r, reader)
        for i, r, reader in zip(ids, requests, readers, strict=True)
    ]
    for packed in sorted({False, editor.impl.mixes_packed}):
        _check_mixed(served, requests, alone, readers, packed)


def _work(editor: MaskAwareEditor, request: EditRequest, use) -> Work:
    return Work(
        key="one model",  # mixed adapters: the executor's key omits the set
        model="m",
        family=editor.family,
        scheduler="default",
        editor=editor,
        request=request,
        fmt="png",
        acquire=lambda: (None, {}),
        adapters=use,
    )


def test_the_engine_steps_every_set_in_one_batch(served, stock_alone) -> None:
    editor, residency, ids = served
    requests, alone = stock_alone
    engine = Engine(EngineConfig(disaggregated=False, mixed_adapters=True), stages=None)
    swaps, mixed = residency.counters.swaps, residency.counters.mixed_steps
    engine.start()
    try:
        futures = [
            engine.submit(_work(editor, r, residency.use(i)))
            for i, r in zip(ids, requests, strict=True)
        ]
        answers = [f.result(timeout=300) for f in futures]
    finally:
        engine.stop()
    assert residency.counters.swaps == swaps  # no turns
    assert residency.counters.mixed_steps > mixed
    assert max(max(a["engine"]["batch_sizes"]) for a in answers) >= 2
    for answer, lone in zip(answers, alone, strict=True):
        image = answer["output"].image
        pixels = np.asarray(Image.open(io.BytesIO(image))).astype(np.float32) / 255
        assert psnr(pixels, lone) >= 45  # its own image, up to 8-bit rounding


def test_a_set_that_fails_to_go_in_fails_only_its_own_requests(
    served, stock_alone, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A set injected for a mixed step that cannot be (its file gone or broken since its
    read) fails its requests only: the batch's other rows, other functions', step on."""
    editor, residency, ids = served
    requests, alone = stock_alone
    broken = ids[1]
    with residency._lock:
        residency._sets[broken].resident = False  # to be injected by the mixed step
    inject = residency._inject

    def failing(entry, deadline):
        if entry.id == broken:
            raise OSError("the LoRA file is gone")
        return inject(entry, deadline)

    monkeypatch.setattr(residency, "_inject", failing)
    engine = Engine(EngineConfig(disaggregated=False, mixed_adapters=True), stages=None)
    engine.start()
    try:  # the broken set's request first: it joins with the others at the first step
        order = [1, 0, 2, 3]
        futures = {
            i: engine.submit(_work(editor, requests[i], residency.use(ids[i]))) for i in order
        }
        with pytest.raises(OSError, match="gone"):
            futures[1].result(timeout=300)
        answers = {i: futures[i].result(timeout=300) for i in (0, 2, 3)}
    finally:
        engine.stop()
        monkeypatch.undo()
    for i, answer in answers.items():
        pixels = np.asarray(Image.open(io.BytesIO(answer["output"].image))).astype(np.float32)
        assert psnr(pixels / 255, alone[i]) >= 45
