"""The one model check: folders as the hub ships them, cached hub ids, single files, and
a structured error naming the file for everything missing or inconsistent."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from retouch.functions.errors import InvalidSpec
from retouch.functions.modelcheck import ModelKind, check_model, model_family
from retouch.functions.modelsource import ModelSource, from_key
from retouch.functions.spec import parse_spec
from retouch.runtime.models import load_pipeline
from tests.modelfolders import COMMIT, build_sd_folder, into_hub_cache
from tests.singlefile import ldm_checkpoint

FAMILY = "sd-inpaint"
REPO_ID = "retouch-tests/sd-inpaint-hub"


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Path:
    return build_sd_folder(tmp_path_factory.mktemp("hub") / "sd", models_dir)


@pytest.fixture(scope="module")
def checkpoint(hub_folder: Path) -> Path:
    """The folder's weights as an original-layout single-file checkpoint."""
    pipe = load_pipeline(hub_folder, FAMILY, torch.device("cpu"), variant="fp16")
    path = hub_folder.parent / "sd-inpainting.safetensors"
    save_file(ldm_checkpoint(pipe), str(path))
    return path


@pytest.fixture
def cache(tmp_path: Path, hub_folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    into_hub_cache(hub_folder, tmp_path / "hub", REPO_ID)
    return tmp_path / "hub"


def test_hub_layout_folder_is_servable_by_path(hub_folder: Path) -> None:
    files = check_model(ModelSource(str(hub_folder), variant="fp16"), FAMILY)
    assert files.kind is ModelKind.FOLDER and files.folder == hub_folder.resolve()
    assert files.pipeline == "StableDiffusionInpaintPipeline"
    assert model_family(str(hub_folder)) == FAMILY


def test_hub_id_resolves_from_the_local_cache(cache: Path) -> None:
    snapshot = cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    for revision in (None, "main", COMMIT):
        files = check_model(ModelSource(REPO_ID, variant="fp16", revision=revision), FAMILY)
        assert files.folder == snapshot
    assert model_family(REPO_ID) == FAMILY
    with pytest.raises(InvalidSpec, match="revision 'v2'") as missing:
        check_model(ModelSource(REPO_ID, variant="fp16", revision="v2"), FAMILY)
    assert missing.value.field == "revision"
    with pytest.raises(InvalidSpec, match="not in the local Hugging Face cache") as absent:
        check_model(ModelSource("retouch-tests/absent"), FAMILY)
    assert absent.value.field == "model" and absent.value.status == 422


def test_variant_weights_without_a_variant_name_the_file_and_the_fix(hub_folder: Path) -> None:
    with pytest.raises(InvalidSpec) as err:
        check_model(ModelSource(str(hub_folder)), FAMILY)
    assert "text_encoder/model.safetensors" in err.value.message
    assert "model.fp16.safetensors" in err.value.message and "variant" in err.value.message


def _remove(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).unlink()


def _truncate(name: str) -> Callable[[Path], None]:
    def cut(folder: Path) -> None:
        path = folder / name
        path.write_bytes(path.read_bytes()[:-100])

    return cut


SHARD = "unet/diffusion_pytorch_model.fp16-00002-of-00008.safetensors"
BROKEN = [
    (_remove("tokenizer/merges.txt"), "tokenizer/merges.txt"),
    (_remove("tokenizer/vocab.json"), "tokenizer/vocab.json"),
    (_remove("unet/config.json"), "unet/config.json"),
    (_remove(SHARD), SHARD.split("/")[1]),
    (_truncate(SHARD), SHARD.split("/")[1]),
    (_remove("unet/diffusion_pytorch_model.safetensors.index.fp16.json"), "unet/"),
    (_remove("vae/diffusion_pytorch_model.fp16.safetensors"), "vae/diffusion_pytorch_model"),
    (_remove("scheduler/scheduler_config.json"), "scheduler/scheduler_config.json"),
    (_remove("feature_extractor/preprocessor_config.json"), "preprocessor_config.json"),
    (lambda f: shutil.rmtree(f / "text_encoder"), "text_encoder/"),
    (_remove("model_index.json"), "model_index.json"),
]


@pytest.mark.parametrize(("damage", "named"), BROKEN)
def test_each_missing_or_broken_file_is_named(
    hub_folder: Path, tmp_path: Path, damage: Callable[[Path], None], named: str
) -> None:
    folder = Path(shutil.copytree(hub_folder, tmp_path / "copy"))
    damage(folder)
    with pytest.raises(InvalidSpec) as err:
        check_model(ModelSource(str(folder), variant="fp16"), FAMILY)
    assert named in err.value.message and err.value.field == "model"
    assert err.value.status == 422


def test_a_shard_without_the_tensors_its_index_places_there(
    hub_folder: Path, tmp_path: Path
) -> None:
    folder = Path(shutil.copytree(hub_folder, tmp_path / "copy"))
    save_file({"other": torch.zeros(2)}, str(folder / SHARD))
    with pytest.raises(InvalidSpec, match=r"00002-of-00008\.safetensors lacks"):
        check_model(ModelSource(str(folder), variant="fp16"), FAMILY)


def test_single_file_needs_its_config(checkpoint: Path, hub_folder: Path, cache: Path) -> None:
    files = check_model(ModelSource(str(checkpoint), config=str(hub_folder)), FAMILY)
    assert files.kind is ModelKind.SINGLE_FILE and files.checkpoint == checkpoint
    assert files.folder == hub_folder.resolve()
    by_id = check_model(ModelSource(str(checkpoint), config=REPO_ID), FAMILY)
    assert by_id.folder is not None and by_id.folder.parent.name == "snapshots"
    with pytest.raises(InvalidSpec, match="config must name") as err:
        check_model(ModelSource(str(checkpoint)), FAMILY)
    assert err.value.field == "config"
    with pytest.raises(InvalidSpec, match="variant names files") as variant:
        check_model(ModelSource(str(checkpoint), variant="fp16", config=str(hub_folder)), FAMILY)
    assert variant.value.field == "variant"
    with pytest.raises(InvalidSpec, match="no such checkpoint") as gone:
        check_model(ModelSource(str(checkpoint.with_name("x.safetensors")), config=REPO_ID), FAMILY)
    assert gone.value.field == "model"


def test_builtin_models_take_a_dtype_only() -> None:
    assert check_model(ModelSource("retouch:tiny-sd", "bf16"), FAMILY).kind is ModelKind.BUILTIN
    with pytest.raises(InvalidSpec) as err:
        check_model(ModelSource("retouch:tiny-sd", variant="fp16"), FAMILY)
    assert err.value.field == "variant"
    with pytest.raises(InvalidSpec) as wrong:
        check_model(ModelSource("retouch:tiny-flux"), FAMILY)
    assert wrong.value.field == "family"


def test_spec_loading_options_round_trip() -> None:
    doc = {
        "name": "f",
        "model": "org/name",
        "family": FAMILY,
        "resolution": 128,
        "templates": {"t": {}},
    }
    plain = parse_spec(doc)
    assert plain.dtype == "auto" and plain.source.key == "org/name"
    spec = parse_spec({**doc, "dtype": "bf16", "variant": "fp16", "revision": "main"})
    assert parse_spec(spec.to_dict()) == spec and spec.to_dict()["dtype"] == "bf16"
    assert from_key(spec.source.key) == spec.source != plain.source
    for field, value in (("dtype", "int8"), ("variant", "a b"), ("revision", 3), ("config", "")):
        with pytest.raises(InvalidSpec) as err:
            parse_spec({**doc, field: value})
        assert err.value.field == field
