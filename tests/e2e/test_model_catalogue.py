"""A gateway without the weights on its disk (the KubeRay head, a gateway Deployment),
started with ``--model-catalogue``: a deploy of a catalogued model is accepted, a model in
neither the catalogue nor its disk is refused with a 422 naming the field ``model``."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.errors import RetouchError
from retouch.functions.spec import ScalingSpec
from retouch.platform.api.client import Client, read_spec_file
from retouch.platform.api.server import ServerProcess
from tests.support import run_cli

# From zero executors: nothing on this machine reads the (removed) folder at deploy.
ARGS = ["--autoscale", "--threads", "1"]


def test_deploys_are_checked_against_the_catalogue(
    tmp_path: Path, models_dir: Path, examples: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = tmp_path / "models" / "tiny-sd"  # where the GPU nodes mount the weights
    shutil.copytree(ensure_demo_model("retouch:tiny-sd", models_dir), weights)
    catalogue = tmp_path / "catalogue.json"
    made = run_cli(capsys, "models", "catalogue", str(weights), "-o", str(catalogue))
    assert made.returncode == 0, made.stderr
    assert json.loads(catalogue.read_text())["models"][0]["model"] == str(weights)
    shutil.rmtree(tmp_path / "models")  # the gateway's machine has no weights

    spec, images = read_spec_file(examples / "tiny-sd.toml")
    scaling = ScalingSpec(min_executors=0, max_executors=1)
    spec = dataclasses.replace(spec, name="catalogued", model=str(weights), scaling=scaling)
    server = ServerProcess(
        tmp_path / "data", extra_args=[*ARGS, "--model-catalogue", str(catalogue)]
    )
    with server, Client(server.url) as client:
        assert client.deploy(spec, images)["status"] == "ready"
        assert [f["name"] for f in client.list()] == ["catalogued"]

        unknown = dataclasses.replace(spec, name="unknown", model=str(tmp_path / "other"))
        with pytest.raises(RetouchError) as refused:
            client.deploy(unknown, images)
        assert (refused.value.status, refused.value.field) == (422, "model")
        assert "not in the model catalogue" in refused.value.message

        assert [f["name"] for f in client.list()] == ["catalogued"]
