"""Two functions on one base model with different LoRA adapters, served by one executor
(real processes): invoked interleaved, each gets its own adapter's image (the one it gets
alone, batched together in mixed steps), the executor reports both sets resident and counts
its loads, swaps and mixed steps, and the gateway's ``/metrics`` exports them as counters."""

from __future__ import annotations

import concurrent.futures
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from retouch.functions.adapters import adapter_set_id, parse_adapters
from retouch.functions.demo.images import template_image
from retouch.functions.imaging import encode_image
from retouch.functions.spec import parse_spec
from retouch.platform.api.client import Client
from retouch.platform.api.server import ServerProcess
from retouch.platform.lab.bench.load import wait_baked
from retouch.runtime.maskaware.quality import psnr
from tests.e2e.conftest import TOKENS
from tests.lorafiles import write_lora

pytestmark = pytest.mark.slow

MODEL, SIZE = "retouch:tiny-sd", 64


@pytest.fixture(scope="module")
def server(data_dir: Path) -> Iterator[ServerProcess]:
    """Deterministic mode: every mask-aware block runs sparse, so an edit batched with
    others gives the pixels it gets alone, whatever plan the profile (measured on a busy
    machine or a quiet one) would choose; and every baked edit mask-aware, whatever the
    profile says of stock (docs/maskaware.md, "Exactness and reproducibility")."""
    args = ["--deterministic", "--path-choice", "maskaware"]
    with ServerProcess(data_dir, env=TOKENS, extra_args=args) as proc:
        yield proc


def _spec(name: str, lora: Path):
    doc = {
        "name": name,
        "model": MODEL,
        "family": "sd-inpaint",
        "resolution": SIZE,
        "steps": 4,
        "templates": {"street": {"prompt": "a quiet street", "seed": 3}},
        "adapters": [{"path": str(lora), "scale": 0.8, "name": "style"}],
    }
    return parse_spec(doc), {"street": encode_image(template_image((SIZE, SIZE), 7), "png")}


def _pixels(image: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(image))).astype(np.float32) / 255


def test_interleaved_functions_get_their_own_adapters(
    server: ServerProcess, admin: Client, tmp_path: Path, models_dir: Path
) -> None:
    """On the session's one-executor server (its counters start at this test's loads)."""
    loras = [write_lora(MODEL, models_dir, tmp_path / f"l{i}", seed=i, std=0.3) for i in (1, 2)]
    mask = np.zeros((SIZE, SIZE), bool)
    mask[8:40, 12:44] = True

    before = admin.executors()["executors"][0]["state"]["adapter_stats"]
    for name, lora in zip(("warm", "cool"), loras, strict=True):
        admin.deploy(*_spec(name, lora))
        wait_baked(admin, name)

    def invoke(name: str) -> np.ndarray:
        result = admin.invoke(name, "street", mask, "a red door", seed=5)
        assert result.path.value == "maskaware"
        return _pixels(result.image)

    alone = {name: invoke(name) for name in ("warm", "cool")}
    assert psnr(alone["warm"], alone["cool"]) < 40  # the adapters change the image
    names = ["warm", "cool"] * 2
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        together = list(pool.map(invoke, names))
    for name, image in zip(names, together, strict=True):
        assert psnr(image, alone[name]) >= 45, name  # no bleed between the batches

    state = admin.executors()["executors"][0]["state"]  # its own report
    sets = {adapter_set_id(parse_adapters([{"path": str(p), "scale": 0.8}])) for p in loras}
    assert sets <= set(state["adapters"])
    stats = state["adapter_stats"]
    assert stats["loads"] - before["loads"] == 2  # each file once
    assert stats["reads"] - before["reads"] == 2
    assert stats["swaps"] - before["swaps"] >= 1  # alone, one function after the other
    assert stats["mixed_steps"] - before["mixed_steps"] >= 1  # together: one batch
    assert state["mixed_adapters"]
    metrics = httpx.get(server.metrics_url).text
    for event in ("swap", "mixed_step"):
        assert f'retouch_adapter_events_total{{event="{event}",executor="exec-0"}}' in metrics
