"""The model catalogue and ``retouch models``: a catalogue entry is the deploy check's own
reading of a folder (with its fingerprint), a gateway checks a catalogued model against it
without the files, and an init container's ``retouch models verify`` exits 1 with one line
when the copied folder is not the model it should be."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from retouch.functions.demo.models import ensure_demo_model
from retouch.functions.errors import InvalidSpec
from retouch.functions.modelcheck import ModelKind
from retouch.functions.modelsource import ModelSource
from retouch.platform.state.catalogue import ModelCatalogue, catalogue_entry
from retouch.runtime.fingerprint import model_fingerprint
from tests.support import CliRun, run_cli


@pytest.fixture(scope="module")
def weights(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the built tiny-sd folder, as an operator's /models/<name> would be."""
    folder = tmp_path_factory.mktemp("weights") / "tiny-sd"
    shutil.copytree(ensure_demo_model("retouch:tiny-sd", models_dir), folder)
    return folder


def test_entry_records_what_the_check_read(weights: Path) -> None:
    entry = catalogue_entry(str(weights))
    assert entry.model == str(weights) and entry.name == "tiny-sd"
    assert entry.family == "sd-inpaint"
    assert entry.pipeline == "StableDiffusionInpaintPipeline"
    assert entry.components["unet"] == "UNet2DConditionModel"
    assert "safety_checker" not in entry.components
    assert entry.bytes == sum(p.stat().st_size for p in weights.rglob("*") if p.is_file())
    assert entry.fingerprint == model_fingerprint(weights.resolve())
    assert entry.dtype == "float32"


def test_gateway_checks_catalogued_models_without_their_files(
    weights: Path, tmp_path: Path
) -> None:
    served = tmp_path / "served"
    shutil.copytree(weights, served)
    path = tmp_path / "catalogue.json"
    path.write_text(ModelCatalogue({str(served): catalogue_entry(str(served))}).dumps())
    shutil.rmtree(served)  # this machine has the catalogue, not the weights
    catalogue = ModelCatalogue.load(path)
    files = catalogue.check(ModelSource(str(served)), "sd-inpaint")
    assert files.kind is ModelKind.CATALOGUED and files.folder is None
    with pytest.raises(InvalidSpec) as family:
        catalogue.check(ModelSource(str(served)), "flux-inpaint")
    assert family.value.field == "family"
    with pytest.raises(InvalidSpec) as variant:
        catalogue.check(ModelSource(str(served), variant="fp16"), "sd-inpaint")
    assert variant.value.field == "variant"
    with pytest.raises(InvalidSpec) as unknown:
        catalogue.check(ModelSource(str(tmp_path / "nowhere")), "sd-inpaint")
    assert unknown.value.field == "model" and str(path) in unknown.value.message
    # not catalogued but on this disk: the local check, as on one machine
    assert catalogue.check(ModelSource(str(weights)), "sd-inpaint").kind is ModelKind.FOLDER


def test_a_broken_catalogue_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "catalogue.json"
    path.write_text(json.dumps({"format": 1, "models": [{"model": "/m"}]}))
    with pytest.raises(ValueError, match=r"catalogue\.json"):
        ModelCatalogue.load(path)
    path.write_text("{")
    with pytest.raises(ValueError, match=r"catalogue\.json"):
        ModelCatalogue.load(path)


def test_fingerprint_verify_and_catalogue_commands(
    weights: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def _retouch(*args: str) -> CliRun:
        return run_cli(capsys, *args)

    printed = _retouch("models", "fingerprint", str(weights))
    assert printed.returncode == 0, printed.stderr
    fingerprint = printed.stdout.strip()
    assert fingerprint == model_fingerprint(weights.resolve())
    ok = _retouch("models", "verify", str(weights), "--fingerprint", fingerprint)
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "", "")

    out = tmp_path / "catalogue.json"
    written = _retouch("models", "catalogue", str(weights), "-o", str(out))
    assert written.returncode == 0, written.stderr
    (entry,) = json.loads(out.read_text())["models"]
    assert entry["fingerprint"] == fingerprint and entry["model"] == str(weights)

    copy = tmp_path / "copy"
    shutil.copytree(weights, copy)
    config = copy / "unet" / "config.json"
    config.write_text(config.read_text().replace("{", '{"_changed": 1, ', 1))
    bad = _retouch("models", "verify", str(copy), "--fingerprint", fingerprint)
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "differs from the expected" in bad.stderr
    assert "Traceback" not in bad.stderr
    missing = _retouch("models", "verify", str(tmp_path / "absent"), "--fingerprint", fingerprint)
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1
    malformed = _retouch("models", "verify", str(weights), "--fingerprint", "xyz")
    assert malformed.returncode == 2 and "64 hex digits" in malformed.stderr
