"""``retouch plan-capacity``: a spec's plan is what the store really holds once the
function's template is baked, and the production shapes' figures scale as a sizing says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retouch.cachestore.store import ActivationStore, StoreConfig
from retouch.functions.demo.images import template_image
from retouch.functions.spec import load_spec_file
from retouch.platform.lab.capacity import spec_editor
from retouch.runtime.maskaware.rowformat import RowFormat
from retouch.runtime.maskaware.storedrows import EncodingWriter
from tests.support import EXAMPLES, CliRun, run_cli


@pytest.fixture
def plan(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """``retouch plan-capacity ARGS`` in this process (``tests.support.run_cli``)."""

    def run(*args: str, data_dir: Path | None = None) -> CliRun:
        if data_dir is not None:
            monkeypatch.setenv("RETOUCH_DATA_DIR", str(data_dir))
        return run_cli(capsys, "plan-capacity", *args)

    return run


def test_a_spec_plan_is_what_the_store_holds_after_the_bake(
    plan, models_dir: Path, tmp_path: Path
) -> None:
    """fp8 rows: codes and scales, and host buffers aligned per tensor, all as planned."""
    spec_file, storage = EXAMPLES / "tiny-sd.toml", "fp8"
    done = plan(str(spec_file), "--storage", storage, "--json", data_dir=models_dir.parent)
    assert done.returncode == 0, done.stderr
    (planned,) = json.loads(done.stdout)
    spec, _ = load_spec_file(spec_file)
    assert (planned["width"], planned["steps"], planned["storage"]) == (128, spec.steps, storage)

    editor = spec_editor(spec, models_dir)
    with ActivationStore(StoreConfig(path=tmp_path / "cache")) as store:
        with store.bake("street", {}) as writer:
            image = template_image((spec.width, spec.height), seed=1)
            rows = EncodingWriter(writer, RowFormat(storage))
            editor.bake(image, "a quiet street", 11, spec.steps, spec.guidance, rows)
        assert store.nbytes("street") == planned["template"]["disk"]
        store.evict("street")
        store.acquire("street").release()
        assert store.stats()["host_bytes"] == planned["template"]["host"]


def test_production_shapes_under_a_sizing(plan) -> None:
    done = plan(
        "--shape", "sd2-inpaint,flux-dev", "--resolution", "512,1024", "--templates", "20",
        "--executors", "8", "--resident", "2", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    plans = {(p["name"], p["width"]): p for p in json.loads(done.stdout)}
    sd2 = plans["sd2-inpaint", 512]
    # a 512² SD2 template at the default 20 steps in bf16 is GBs (the concern)
    assert 2 << 30 < sd2["template"]["disk"] < 3 << 30 and sd2["dtype"] == "bfloat16"
    assert sd2["disk_per_node_bytes"] == 20 * 8 * sd2["template"]["disk"]
    assert sd2["host_per_executor_bytes"] == 2 * sd2["template"]["host"]
    assert sd2["device_per_executor_bytes"] == sd2["weights_bytes"] + 2 * sd2["template"]["device"]
    assert 1.7e9 < sd2["weights_bytes"] < 1.75e9  # the 865 M UNet in bf16
    # tokens grow with the pixels: four times the bytes at twice the side
    flux = plans["flux-dev", 1024]["template"]["disk"]
    assert flux == pytest.approx(4 * plans["flux-dev", 512]["template"]["disk"], rel=0.01)
    fp8 = plan("--shape", "flux-dev", "--storage", "fp8", "--json")
    assert json.loads(fp8.stdout)[0]["template"]["disk"] < 0.51 * flux


def test_usage_errors_are_one_line(plan) -> None:
    for args in ((), ("--shape", "sd9"), (str(EXAMPLES / "tiny-sd.toml"), "--steps", "4")):
        done = plan(*args)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert "Traceback" not in done.stderr
