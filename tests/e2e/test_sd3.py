"""An SD3 function end to end: deploy the example spec, invoke it, get a mask-aware edit."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np
from PIL import Image

from retouch.platform.bench.load import wait_baked
from retouch.platform.client import Client, read_spec_file


def test_deploy_and_invoke_an_sd3_function(admin: Client, examples: Path) -> None:
    spec, images = read_spec_file(examples / "tiny-sd3.toml")
    assert spec.family == "sd3-inpaint"
    spec = dataclasses.replace(spec, steps=2)  # the suite's time
    assert admin.deploy(spec, images)["status"] == "ready"
    template = np.asarray(Image.open(io.BytesIO(images["mug"])).convert("RGB"))
    mask = np.zeros((128, 128), bool)
    mask[32:80, 40:96] = True

    first = admin.invoke("tiny-sd3", "mug", mask, "a red mug", seed=4, format="raw")
    assert first.path in ("stock", "maskaware") and first.mask_ratio > 0
    assert not np.array_equal(np.frombuffer(first.image, np.uint8).reshape(128, 128, 3), template)

    wait_baked(admin, "tiny-sd3", timeout=300)  # templates are baked in the background
    edit = admin.invoke("tiny-sd3", "mug", mask, "a red mug", seed=4, format="raw")
    assert edit.path == "maskaware"
    assert (edit.width, edit.height) == (128, 128)
    assert not np.array_equal(np.frombuffer(edit.image, np.uint8).reshape(128, 128, 3), template)
