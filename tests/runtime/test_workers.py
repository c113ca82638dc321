"""Pre/post workers: encode and decode in other processes give the in-process edit, a dead
worker fails its job by name and comes back, and no shared-memory block outlives a job."""

from __future__ import annotations

import functools
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxInpaintPipeline, StableDiffusionInpaintPipeline
from PIL import Image

from retouch.functions.demo.images import mask_of_ratio, template_image
from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.errors import RetouchError
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.store import TEMPLATE_STEP, MemoryActivations
from retouch.runtime.workers import PoolClosed, PrePostPool, WorkerDied

SHM = Path("/dev/shm")
SIZE = 128
STEPS = 3
LATENTS = 1e-4
MODELS = {
    "sd-inpaint": ("retouch:tiny-sd", StableDiffusionInpaintPipeline, "ddim"),
    "flux-inpaint": ("retouch:tiny-flux", FluxInpaintPipeline, "flow-euler"),
}
WAIT = 120  # seconds a job may take here, worker (re)start included, on a busy machine


def _blocks(prefix: str) -> list[str]:
    return sorted(p.name for p in SHM.iterdir() if p.name.startswith(prefix))


@pytest.fixture(scope="module")
def pool(models_dir: Path):
    for model, _, _ in MODELS.values():
        ensure_demo_model(model, models_dir)  # built once, before workers would race for it
    pool = PrePostPool(models_dir, "cpu", threads=1)
    yield pool
    pool.close()
    assert not any(pid and _alive(pid) for pid in pool.pids().values())
    assert _blocks(pool.block_prefix) == []


@pytest.fixture(scope="module", params=list(MODELS))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@functools.cache
def _editor(family: str, models_dir: Path) -> MaskAwareEditor:
    torch.set_num_threads(1)
    model, loader, _ = MODELS[family]
    pipe = loader.from_pretrained(ensure_demo_model(model, models_dir))
    pipe.set_progress_bar_config(disable=True)
    return MaskAwareEditor(pipe, family, "cpu")


@pytest.fixture(scope="module")
def editor(family: str, models_dir: Path) -> MaskAwareEditor:
    return _editor(family, models_dir)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _steps(editor: MaskAwareEditor, state) -> torch.Tensor:
    while not state.done:
        editor.step([state])
    return editor.final_latents(state)


def _rgb(data: bytes, width: int, height: int) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).reshape(height, width, 3).astype(int)


def test_encode_and_decode_in_workers_equal_the_in_process_edit(
    pool: PrePostPool, editor: MaskAwareEditor, family: str
) -> None:
    model, _, scheduler = MODELS[family]
    image = template_image((SIZE, SIZE), 21)
    store = MemoryActivations()
    editor.bake(image, "a wall", 5, STEPS, 4.0, store)
    mask = mask_of_ratio((SIZE, SIZE), 0.2, "ellipse", seed=3)
    request = EditRequest(image, mask, "a window", 6, STEPS, 4.0, "a wall", 5)

    encoded = pool.encode(model, family, scheduler, request).result(WAIT)
    latents = _steps(editor, editor.assemble(request, encoded, store))
    reference = _steps(editor, editor.prepare(request, store))
    assert torch.allclose(latents, reference, atol=LATENTS)

    data, width, height = pool.decode(model, family, latents, SIZE, SIZE, "raw").result(WAIT)
    assert (width, height) == (SIZE, SIZE)
    expected = np.asarray(editor.edit(request, store)).astype(int)
    assert np.abs(_rgb(data, width, height) - expected).max() <= 1  # uint8 rounding

    png, _, _ = pool.decode(model, family, latents, SIZE, SIZE, "png").result(WAIT)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), _rgb(data, SIZE, SIZE))


def test_a_readerless_request_through_workers_equals_stock(
    pool: PrePostPool, editor: MaskAwareEditor, family: str
) -> None:
    model, _, scheduler = MODELS[family]
    image = template_image((SIZE, SIZE), 22)
    request = EditRequest(
        image, mask_of_ratio((SIZE, SIZE), 0.3, "blob", seed=4), "a cat", 7, STEPS, 4.0, "t", 8
    )
    encoded = pool.encode(model, family, scheduler, request).result(WAIT)
    latents = _steps(editor, editor.assemble(request, encoded, None))
    data, width, height = pool.decode(model, family, latents, SIZE, SIZE, "raw").result(WAIT)
    stock = np.asarray(editor.stock_edit(request)).astype(int)
    assert np.abs(_rgb(data, width, height) - stock).max() <= 1


def test_flux_template_latents_given_to_the_worker_are_used(
    pool: PrePostPool, models_dir: Path
) -> None:
    family = "flux-inpaint"
    editor = _editor(family, models_dir)
    model, _, scheduler = MODELS[family]
    image = template_image((SIZE, SIZE), 23)
    store = MemoryActivations()
    editor.bake(image, "p", 3, 1, 4.0, store)
    cached = store.get(TEMPLATE_STEP, "template", "image_latents")
    request = EditRequest(image, mask_of_ratio((SIZE, SIZE), 0.2), "q", 4, 1, 4.0, "p", 3)
    given = pool.encode(model, family, scheduler, request, cached * 0 + 7).result(WAIT)
    assert torch.equal(given.tensors["image_latents"], torch.full_like(cached, 7))
    computed = pool.encode(model, family, scheduler, request).result(WAIT)
    assert torch.allclose(computed.tensors["image_latents"].float(), cached, atol=1e-5)


def test_an_editor_without_text_encoders_bakes_and_edits_through_a_pre_worker(
    pool: PrePostPool, editor: MaskAwareEditor, family: str, models_dir: Path
) -> None:
    """An executor with pre workers loads its model without the text encoders (each on the
    device once): its bakes and edits encode in a pre worker and record the same
    activations and latents as an editor that has them."""
    from retouch.runtime.models import ModelCache

    model, _, scheduler = MODELS[family]
    loaded = ModelCache(models_dir, torch.device("cpu"), without=("text_encoders",)).get(
        model, family
    )
    lean = MaskAwareEditor(loaded.pipeline_for(scheduler), family, "cpu")
    assert loaded.pipe.text_encoder is None and loaded.pipe.tokenizer is not None
    image = template_image((SIZE, SIZE), 23)
    blank = np.zeros((SIZE, SIZE), dtype=bool)
    with pytest.raises(AttributeError, match="NoneType"):  # no text encoder in this process
        lean.encode(EditRequest(image, blank, "a wall", 5, STEPS, 4.0, "a wall", 5))

    lean.set_encoder(lambda r, t: pool.encode(model, family, scheduler, r, t).result(WAIT))
    baked, reference = MemoryActivations(), MemoryActivations()
    lean.bake(image, "a wall", 5, STEPS, 4.0, baked)
    editor.bake(image, "a wall", 5, STEPS, 4.0, reference)
    assert baked.tensors.keys() == reference.tensors.keys()
    for key, tensor in reference.tensors.items():
        assert torch.allclose(baked.tensors[key], tensor, atol=LATENTS), key
    mask = mask_of_ratio((SIZE, SIZE), 0.2, "ellipse", seed=3)
    request = EditRequest(image, mask, "a window", 6, STEPS, 4.0, "a wall", 5)
    latents = _steps(lean, lean.prepare(request, baked))
    assert torch.allclose(latents, _steps(editor, editor.prepare(request, reference)), atol=LATENTS)


def test_echo_round_trip_and_transport_stats(pool: PrePostPool) -> None:
    items = {
        "half": torch.randn(2, 77, 64).half(),
        "mask": np.ones((SIZE, SIZE), bool),
        "png": b"\x89PNG" * 100,
    }
    for role in ("pre", "post"):
        out = pool.echo(items, role).result(WAIT)
        assert torch.equal(out["half"], items["half"]) and out["png"] == items["png"]
        assert np.array_equal(out["mask"], items["mask"])
    stats = pool.stats()["echo"]
    assert stats["jobs"] >= 2 and 0 <= stats["mean_overhead_ms"] <= stats["mean_ms"]
    assert stats["mean_payload_kib"] > 0


def test_a_failing_job_fails_alone(pool: PrePostPool) -> None:
    pid = pool.pids()["pre worker 0"]
    request = EditRequest(
        template_image((SIZE, SIZE), 1), np.ones((SIZE, SIZE), bool), "x", 1, 1, 4.0, "y", 2
    )
    # A structured refusal reaches the caller as the error it is (status, code, field).
    with pytest.raises(RetouchError, match="no-such-model") as failed:
        pool.encode("retouch:no-such-model", "sd-inpaint", "ddim", request).result(WAIT)
    assert failed.value.status == 422 and failed.value.code == "invalid_spec"
    assert pool.echo({"x": torch.ones(3)}).result(WAIT)["x"].sum() == 3
    assert pool.pids()["pre worker 0"] == pid
    assert _blocks(pool.block_prefix) == []


def test_a_killed_worker_fails_its_job_by_name_and_is_restarted(pool: PrePostPool) -> None:
    assert pool.wait_ready(WAIT)
    pid = pool.pids()["post worker 0"]
    os.kill(pid, signal.SIGSTOP)  # the job's request block is written, never taken
    try:
        future = pool.echo({"x": torch.ones(1000)}, "post")
        deadline = time.monotonic() + 30
        while not _blocks(pool.block_prefix) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _blocks(pool.block_prefix), "the request block was never written"
    finally:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"post worker 0 \(pid {pid}\) died") as died:
        future.result(WAIT)
    assert isinstance(died.value, WorkerDied)
    assert _blocks(pool.block_prefix) == []
    assert pool.echo({"y": torch.arange(4)}, "post").result(WAIT)["y"].tolist() == [0, 1, 2, 3]
    assert pool.pids()["post worker 0"] != pid and not _alive(pid)


def test_a_closed_pool_refuses_jobs_and_leaves_no_process(models_dir: Path) -> None:
    closed = PrePostPool(models_dir, "cpu", threads=1)
    closed.close()  # while the workers still start: they are killed, not awaited
    with pytest.raises(PoolClosed):
        closed.echo({"x": torch.ones(1)})
    pids = [pid for pid in closed.pids().values() if pid is not None]  # those that started
    assert not any(_alive(pid) for pid in pids)
    closed.close()  # idempotent


@pytest.mark.slow
def test_interpreter_exit_closes_the_pool(models_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "exit_without_close.py"
    script.write_text(
        "import torch\n"
        "from retouch.runtime import forkserver\n"
        "from retouch.runtime.workers import PrePostPool\n"
        "if __name__ == '__main__':\n"
        "    forkserver.fork_from_here()  # as an executor starts its CPU workers\n"
        f"    pool = PrePostPool({str(models_dir)!r}, 'cpu', threads=1)\n"
        "    assert pool.echo({'x': torch.ones(8)}).result(120)['x'].sum() == 8\n"
        "    pool.wait_ready()  # every worker started (a loaded machine starts them late)\n"
        "    print(pool.block_prefix, *pool.pids().values())\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=WAIT, check=True
    )
    prefix, *pids = done.stdout.split()
    assert not any(_alive(int(pid)) for pid in pids)
    assert _blocks(prefix) == []
    assert "leaked" not in done.stderr
