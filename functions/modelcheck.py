"""The one model check: whether a :class:`ModelSource` can be served by a family.

The gateway runs it at deploy (before anything is stored) and an executor runs it before
it loads, so every missing or inconsistent file ends in an :class:`InvalidSpec` (a 4xx)
naming that file, never in an internal error from deep inside ``from_pretrained``. It reads
only small files (``model_index.json``, configs, safetensors headers and shard indexes) and
imports neither torch nor diffusers: the control plane stays light.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retouch.functions import hubcache
from retouch.functions.errors import InvalidSpec
from retouch.functions.families import FAMILY_SPECS, DenoiserFile
from retouch.functions.models import is_builtin, known_builtin
from retouch.functions.modelsource import ModelSource

# Suffixes of single-file checkpoints.
CHECKPOINT_SUFFIXES = (".safetensors", ".ckpt")
# Components every family loads as None (``runtime/families``: ``load_kwargs``).
NEVER_LOADED = ("safety_checker",)
# Weight file names by library: (safetensors stem, pickle file).
WEIGHT_NAMES = {
    "diffusers": ("diffusion_pytorch_model", "diffusion_pytorch_model.bin"),
    "transformers": ("model", "pytorch_model.bin"),
}
# The libraries a component the loader builds by its class name may come from.
LIBRARIES = tuple(WEIGHT_NAMES)
# Files a tokenizer folder needs by tokenizer class prefix when it has no ``tokenizer.json``.
TOKENIZER_FILES = {
    "CLIP": ("vocab.json", "merges.txt"),
    "T5": ("spiece.model",),
    "Qwen2": ("vocab.json", "merges.txt"),  # Z-Image's Qwen3 tokenizer
}
MAX_HEADER = 100 << 20  # a safetensors header larger than this is not one
# Tensors (or key prefixes) by which diffusers finds each component of a whole-pipeline
# single file, by the component's name in ``model_index.json`` (``single_file_utils``:
# ``CHECKPOINT_KEY_NAMES`` for the text encoders: SD's CLIP or SD 2's OpenCLIP, SDXL's CLIP-L
# and OpenCLIP bigG, SD3's CLIP-L, CLIP-G and T5-XXL; ``LDM_VAE_KEYS`` for the VAE). Keyed
# by component, not by kind: an SDXL file may hold its CLIP-L and not its bigG. What a file
# lacks loads from ``config``.
SINGLE_FILE_KEYS = {
    "text_encoder": (
        "cond_stage_model.transformer.text_model.embeddings.position_embedding.weight",
        "cond_stage_model.model.token_embedding.weight",
        "conditioner.embedders.0.transformer.text_model.embeddings.position_embedding.weight",
        "text_encoders.clip_l.transformer.text_model.embeddings.position_embedding.weight",
    ),
    "text_encoder_2": (
        "conditioner.embedders.1.model.positional_embedding",
        "conditioner.embedders.0.model.text_projection",
        "text_encoders.clip_g.transformer.text_model.embeddings.position_embedding.weight",
    ),
    "text_encoder_3": ("text_encoders.t5xxl.transformer.shared.weight",),
    "vae": ("first_stage_model.", "vae."),
}


class ModelKind(enum.Enum):
    BUILTIN = "builtin"  # built (or copied) on the executor from the catalogue
    FOLDER = "folder"  # a diffusers folder (a local path or a cached hub snapshot)
    SINGLE_FILE = "single-file"  # one checkpoint, the rest (configs at least) from ``config``
    CATALOGUED = "catalogued"  # checked where the weights are; the gateway read its entry


@dataclass(frozen=True)
class ModelFiles:
    """Where a checked model's files are: a diffusers ``folder`` (a single file's config
    folder; None for a built-in) and, for a single file, its ``checkpoint`` and the
    components it lacks (``from_config``: loaded from the folder's own weights)."""

    kind: ModelKind
    pipeline: str  # the pipeline class its model_index.json (or the family) names
    folder: Path | None = None
    checkpoint: Path | None = None
    from_config: tuple[str, ...] = ()


def check_model(source: ModelSource, family: str) -> ModelFiles:
    """Where ``source``'s files are, once every file ``family``'s pipeline loads is seen to
    be there and consistent; an :class:`InvalidSpec` naming the first one that is not."""
    if is_builtin(source.model):
        return _check_builtin(source, family)
    path = Path(source.model).expanduser()
    if path.is_file() or path.suffix in CHECKPOINT_SUFFIXES:
        return _check_single_file(source, path, family)
    if source.config is not None:
        raise InvalidSpec("config is only for single-file checkpoints", field="config")
    folder = _locate(source.model, source.revision, "model")
    pipeline = check_pipeline(pipeline_class(folder), family, folder)
    _check_index_entries(folder, family, "model")
    _check_components(folder, source.variant, field="model")
    _check_vision_geometry(folder, "model")
    return ModelFiles(ModelKind.FOLDER, pipeline, folder=folder)


def model_family(model: str) -> str:
    """The family of a built-in model, or of a folder (or cached hub id) by its pipeline."""
    if is_builtin(model):
        return known_builtin(model).family
    cls = pipeline_class(_locate(model, None, "model"))
    for family, spec in FAMILY_SPECS.items():
        if cls in spec.compatible:
            return family
    raise InvalidSpec(f"{model} holds a {cls}, which no family serves", field="model")


def pipeline_class(folder: Path, field: str = "model") -> str:
    """The pipeline class a diffusers folder declares (its ``model_index.json``)."""
    return str(model_index(folder, field).get("_class_name", ""))


def check_pipeline(cls: str, family: str, where: Path | str) -> str:
    """``cls`` once ``family`` is seen to serve it (``where``: the folder, for the error)."""
    if cls not in FAMILY_SPECS[family].compatible:
        raise InvalidSpec(f"{where} holds a {cls}, which cannot serve {family}", field="family")
    return cls


def _check_index_entries(folder: Path, family: str, field: str) -> None:
    """The ``model_index.json`` entries ``family`` requires (``FamilySpec.index_entries``)."""
    index = model_index(folder, field)
    for name, wanted, default, why in FAMILY_SPECS[family].index_entries:
        found = index.get(name, default)
        if found != wanted:
            raise InvalidSpec(
                f"{folder}/model_index.json: {name} is {found!r}, not {wanted!r}: {why}",
                field=field,
            )


def components(folder: Path, field: str = "model") -> dict[str, str]:
    """The loaded components ``model_index.json`` lists: name -> class."""
    return {
        name: str(entry[1])
        for name, entry in sorted(model_index(folder, field).items())
        if _loaded(name, entry)
    }


# -- the three kinds ------------------------------------------------------------------------


def _check_builtin(source: ModelSource, family: str) -> ModelFiles:
    native = known_builtin(source.model).family
    if native != family:
        raise InvalidSpec(f"{source.model} is a {native} model, not {family}", field="family")
    for option in ("variant", "revision", "config"):
        if getattr(source, option) is not None:
            raise InvalidSpec(f"a built-in model takes no {option}", field=option)
    return ModelFiles(ModelKind.BUILTIN, FAMILY_SPECS[family].pipeline)


def _check_single_file(source: ModelSource, path: Path, family: str) -> ModelFiles:
    if path.suffix not in CHECKPOINT_SUFFIXES:
        raise InvalidSpec(
            f"{path}: a single-file checkpoint ends in {' or '.join(CHECKPOINT_SUFFIXES)}",
            field="model",
        )
    if not path.is_file():
        raise InvalidSpec(f"no such checkpoint file: {path}", field="model")
    denoiser = FAMILY_SPECS[family].single_file
    if source.variant is not None and not denoiser.alone:
        raise InvalidSpec("variant names files of a diffusers folder", field="variant")
    if source.config is None:
        rest = (
            f"components but the {denoiser.component}"
            if denoiser.alone
            else "configs and tokenizers"
        )
        raise InvalidSpec(
            f"{path.name} is a single-file checkpoint: config must name the diffusers folder "
            f"(or cached hub id) with its {rest} (never fetched)",
            field="config",
        )
    # A .ckpt is read by unpickling it: only the loader does that.
    header = safetensors_header(path, "model") if path.suffix == ".safetensors" else None
    folder = _locate(source.config, source.revision, "config")
    pipeline = check_pipeline(pipeline_class(folder, "config"), family, folder)
    _check_index_entries(folder, family, "config")
    listed = tuple(components(folder, "config"))
    if denoiser.component not in listed:
        raise InvalidSpec(
            f"{folder}: model_index.json lists no {denoiser.component}", field="config"
        )
    if header is not None:
        _check_denoiser(path, header, folder / denoiser.component, denoiser)
    # What the file holds: the denoiser alone, or the pipeline but for what it lacks
    lacking = () if denoiser.alone or header is None else _components_lacking(folder, header)
    _check_clip_pair(path, listed, lacking)
    in_file = (
        (denoiser.component,) if denoiser.alone else tuple(n for n in listed if n not in lacking)
    )
    _check_libraries(folder, (denoiser.component,) if denoiser.alone else lacking)
    _check_components(folder, source.variant, in_file=in_file, field="config", file=path.name)
    return ModelFiles(
        ModelKind.SINGLE_FILE,
        pipeline,
        folder=folder,
        checkpoint=path.resolve(),
        from_config=lacking,
    )


CLIP_PAIR = ("text_encoder", "text_encoder_2")  # SDXL's CLIP-L and bigG, SD3's CLIP-L and -G


def _check_clip_pair(path: Path, listed: tuple[str, ...], lacking: tuple[str, ...]) -> None:
    """A file with two CLIP text encoders holds both or neither: diffusers tells the
    file's model type (and where its CLIP-L is) by the second one, so a file with only one
    fails in the loader however ``config`` fills the gap."""
    pair = [name for name in CLIP_PAIR if name in listed]
    missing = [name for name in pair if name in lacking]
    if len(pair) == 2 and len(missing) == 1:
        held = next(name for name in pair if name not in missing)
        raise InvalidSpec(
            f"{path.name} holds {held} but not {missing[0]}: a single file holds both of its "
            "CLIP text encoders or neither (then both load from config)",
            field="model",
        )


def _check_libraries(folder: Path, names: tuple[str, ...]) -> None:
    """The components the loader builds by class name (:data:`LIBRARIES`: nothing else
    from a folder's ``model_index.json`` is imported) come from diffusers or transformers."""
    index = model_index(folder, "config")
    for name in names:
        library = index[name][0]
        if library not in LIBRARIES:
            raise InvalidSpec(
                f"{folder}/model_index.json: {name} comes from {library!r}; a single file's "
                f"components load from {' or '.join(LIBRARIES)} only",
                field="config",
            )


def _components_lacking(folder: Path, tensors: dict[str, Any]) -> tuple[str, ...]:
    """The text encoders and VAE of ``folder``'s pipeline that a whole-pipeline file's
    ``tensors`` do not hold (SD3's plain ``sd3_medium.safetensors`` has no text encoder,
    a UNet-only file no VAE): they load from ``config``'s weights, as a diffusers user
    passes them to ``from_single_file`` (which fails on a file without them, rather than
    looking in ``config``)."""
    return tuple(
        name
        for name in components(folder, "config")
        if name in SINGLE_FILE_KEYS
        and not any(tensor.startswith(SINGLE_FILE_KEYS[name]) for tensor in tensors)
    )


def _check_denoiser(path: Path, header: dict[str, Any], part: Path, denoiser: DenoiserFile) -> None:
    """The file's denoiser is the one ``part``'s config describes, from its header alone:
    its input projection is there (under one of the layout's prefixes) and takes the
    config's input channels, and it reads text embeddings as wide as the config's (an SD
    1.5 file is no SDXL UNet, a text-to-image UNet no inpainting one)."""
    config_path = part / "config.json"
    config = _json_object(config_path)
    prefix = next((p for p in denoiser.prefixes if p + denoiser.input_weight in header), None)
    if prefix is None:
        raise InvalidSpec(
            f"{path.name} holds no {denoiser.component} in its original layout "
            f"(no {' or '.join(p + denoiser.input_weight for p in denoiser.prefixes)})",
            field="model",
        )
    context = _weight_ending(header, prefix, denoiser.context_weight)
    if context is None:
        under = f" under {prefix}" if prefix else ""
        raise InvalidSpec(
            f"{path.name}: its {denoiser.component} reads no text embeddings "
            f"(no {denoiser.context_weight}{under})",
            field="model",
        )
    config_name = _short(config_path)
    where = f"{path.name}: its {denoiser.component} takes"
    found = _width(header[prefix + denoiser.input_weight])
    if found is not None and denoiser.input_factor > 1:  # patches of latents: per channel
        found = found / denoiser.input_factor
        found = int(found) if found.is_integer() else found
    _same_width(f"{where} {found} input channels", found, config_name, config, "in_channels")
    found = _width(header[context])
    text = f"{where} text embeddings {found} wide"
    _same_width(text, found, config_name, config, denoiser.context_config)


def _width(entry: dict[str, Any]) -> int | None:
    """The input width of a weight ``[out, in, ...]`` a safetensors header declares."""
    shape = entry.get("shape", [])
    return shape[1] if len(shape) > 1 else None


def _same_width(
    what: str, found: int | None, name: str, config: dict[str, Any], entry: str
) -> None:
    """A file's weight is as wide as ``entry`` of the config ``name`` (a list: one of its
    widths, per block); ``what`` the file's weight takes, for the message."""
    expected = config.get(entry)
    if expected is None or found in (expected if isinstance(expected, list) else [expected]):
        return
    raise InvalidSpec(
        f"{what}, {name} says {entry} {expected} (the checkpoint of another model?)",
        field="model",
    )


def _weight_ending(header: dict[str, Any], prefix: str, name: str) -> str | None:
    """The first key under ``prefix`` that is ``name`` or ends in ``.name``."""
    keys = (k for k in header if k.startswith(prefix))
    return min(
        (k for k in keys if k[len(prefix) :] == name or k.endswith("." + name)), default=None
    )


def _json_object(path: Path) -> dict[str, Any]:
    """A component's ``config.json``, or an :class:`InvalidSpec` naming it."""
    _need(path, "config")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = None
    if not isinstance(doc, dict):
        raise InvalidSpec(f"{_short(path)} is not a JSON object ({path})", field="config")
    return doc


def _locate(name: str, revision: str | None, field: str) -> Path:
    """A local folder, or a hub id's snapshot in the local cache."""
    path = Path(name).expanduser()
    if path.is_dir():
        if revision is not None:
            raise InvalidSpec("revision is for hub ids, not local folders", field="revision")
        return path.resolve()
    if hubcache.is_hub_id(name):
        return hubcache.snapshot(name, revision, field)
    raise InvalidSpec(f"no such model folder, file or cached hub id: {name}", field=field)


def model_index(folder: Path, field: str) -> dict[str, Any]:
    """A diffusers folder's ``model_index.json``, or an :class:`InvalidSpec` naming it."""
    index = folder / "model_index.json"
    try:
        doc = json.loads(index.read_text())
    except (OSError, ValueError):
        raise InvalidSpec(
            f"{folder} is not a diffusers folder (no readable model_index.json)", field=field
        ) from None
    if not isinstance(doc, dict):
        raise InvalidSpec(f"{index} is not a JSON object", field=field)
    return doc


# -- components ------------------------------------------------------------------------------


def _check_components(
    folder: Path,
    variant: str | None,
    *,
    field: str,
    in_file: tuple[str, ...] = (),
    file: str | None = None,
) -> None:
    """Every component ``model_index.json`` lists: its folder, config and weights (but
    those ``in_file``: the single ``file``'s, whose missing weights it names), or its
    tokenizer files."""
    for name, entry in sorted(model_index(folder, field).items()):
        if not _loaded(name, entry):
            continue
        library, cls = entry
        part = folder / name
        if not part.is_dir():
            raise InvalidSpec(f"{folder}: missing component folder {name}/", field=field)
        if "Tokenizer" in cls:
            _check_tokenizer(part, cls, field)
        elif cls.endswith("Scheduler"):
            _need(part / "scheduler_config.json", field)
        elif "ImageProcessor" in cls or "FeatureExtractor" in cls:
            _need(part / "preprocessor_config.json", field)
        elif cls.endswith("Processor"):  # an image processor and a tokenizer (Qwen2-VL's)
            _check_processor(part, cls, field)
        else:
            _need(part / "config.json", field)
            if name not in in_file:
                why = f": {file} holds no {name}, so config must" if file else ""
                _check_weights(part, library, variant, field, why)


def _loaded(name: str, entry: Any) -> bool:
    """Whether a ``model_index.json`` item is a component the pipeline loads."""
    if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2:
        return False
    return entry[0] is not None and entry[1] is not None and name not in NEVER_LOADED


def _need(path: Path, field: str) -> None:
    if not path.is_file():
        raise InvalidSpec(f"missing {_short(path)} ({path})", field=field)


def _short(path: Path) -> str:
    """``component/file``: how an error names a file of a model folder."""
    return f"{path.parent.name}/{path.name}"


def _check_tokenizer(part: Path, cls: str, field: str) -> None:
    if (part / "tokenizer.json").is_file():
        return
    kind = next((k for k in TOKENIZER_FILES if cls.startswith(k)), None)
    for name in TOKENIZER_FILES[kind] if kind else ("tokenizer_config.json",):
        _need(part / name, field)


def _check_processor(part: Path, cls: str, field: str) -> None:
    """A multimodal processor's folder: its image processor's config (as published,
    ``preprocessor_config.json``, or as transformers saves a processor,
    ``processor_config.json``) and its tokenizer's files."""
    if not (part / "processor_config.json").is_file():
        _need(part / "preprocessor_config.json", field)
    _check_tokenizer(part, cls, field)


# How a multimodal processor cuts an image (its image processor's config) and how the text
# encoder's vision tower reads the patches (its ``vision_config``): Qwen2.5-VL's names.
VISION_GEOMETRY = (
    ("patch_size", "patch_size"),
    ("merge_size", "spatial_merge_size"),
    ("temporal_patch_size", "temporal_patch_size"),
)


def _check_vision_geometry(folder: Path, field: str) -> None:
    """A ``processor`` that cuts images into patches for the text encoder's vision tower
    (Qwen-Image-Edit's) cuts them as the tower reads them; otherwise the first edit fails
    deep inside the text encoder."""
    index = model_index(folder, field)
    if not (_loaded("processor", index.get("processor")) and "text_encoder" in index):
        return
    part = folder / "processor"
    published = part / "preprocessor_config.json"
    config_path = published if published.is_file() else part / "processor_config.json"
    images = _json_object(config_path)
    images = images if published.is_file() else images.get("image_processor", {})
    vision = _json_object(folder / "text_encoder" / "config.json").get("vision_config")
    if not isinstance(vision, dict) or not isinstance(images, dict):
        return
    for cut, read in VISION_GEOMETRY:
        if cut in images and read in vision and images[cut] != vision[read]:
            raise InvalidSpec(
                f"{_short(config_path)} says {cut} {images[cut]}, but "
                f"text_encoder/config.json's vision_config says {read} {vision[read]}: the "
                "vision tower would read other patches than the processor cuts",
                field=field,
            )


def _variant_name(name: str, variant: str | None) -> str:
    """diffusers' and transformers' file naming: the variant before the last suffix."""
    if variant is None:
        return name
    stem, _, suffix = name.rpartition(".")
    return f"{stem}.{variant}.{suffix}"


def _check_weights(
    part: Path, library: str, variant: str | None, field: str, why: str = ""
) -> None:
    """One weight file, or a shard index whose shards are all there and hold its tensors;
    ``why`` they are needed ends the message that finds none."""
    stem, pickled = WEIGHT_NAMES.get(library, WEIGHT_NAMES["diffusers"])
    index = part / _variant_name(f"{stem}.safetensors.index.json", variant)
    single = part / _variant_name(f"{stem}.safetensors", variant)
    if index.is_file():
        _check_shards(index, field)
    elif single.is_file():
        safetensors_header(single, field)
    elif not (part / _variant_name(pickled, variant)).is_file():
        others = sorted(p.name for p in part.glob("*.safetensors"))
        hint = f"; it holds {', '.join(others[:3])}" if others else ""
        if variant is None and others:
            hint += " (variant weights: name the variant in the spec)"
        raise InvalidSpec(f"missing {_short(single)} ({single}){hint}{why}", field=field)


def weight_shapes(part: Path, variant: str | None) -> dict[str, list[int]]:
    """The tensors of a checked component folder's safetensors weights (name -> shape),
    from one file or every shard its index lists; empty when the weights are pickled."""
    for stem, _ in WEIGHT_NAMES.values():
        index = part / _variant_name(f"{stem}.safetensors.index.json", variant)
        single = part / _variant_name(f"{stem}.safetensors", variant)
        if index.is_file():
            _check_shards(index, "model")
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            paths = [part / shard for shard in shards]
        elif single.is_file():
            paths = [single]
        else:
            continue
        return {
            name: [int(n) for n in entry["shape"]]
            for path in paths
            for name, entry in safetensors_header(path, "model").items()
        }
    return {}


def _check_shards(index: Path, field: str) -> None:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards: dict[str, set[str]] = {}
        for tensor, shard in weight_map.items():
            shards.setdefault(shard, set()).add(tensor)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise InvalidSpec(f"{_short(index)} is not a shard index ({index})", field=field) from None
    for shard, tensors in sorted(shards.items()):
        path = index.parent / shard
        if not path.is_file():
            raise InvalidSpec(f"missing {_short(path)}, a shard {_short(index)} lists", field=field)
        absent = sorted(tensors - set(safetensors_header(path, field)))
        if absent:
            raise InvalidSpec(
                f"{_short(path)} lacks {absent[0]}, which {_short(index)} places there",
                field=field,
            )


def _declared(entry: Any) -> bool:
    """A header entry as the format defines it: a dtype, a shape of non-negative ints and
    two data offsets (what the check reads from it later cannot then fail)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    return (
        isinstance(shape, list)
        and all(type(n) is int and n >= 0 for n in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(n) is int and n >= 0 for n in offsets)
    )


def safetensors_header(path: Path, field: str) -> dict[str, Any]:
    """The tensors a safetensors file declares, once its size is seen to match them (a
    truncated download fails here, not in the loader)."""
    bad = InvalidSpec(
        f"{_short(path)} is truncated or not a safetensors file ({path})", field=field
    )
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER:
                raise bad
            header = json.loads(f.read(length))
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        if not all(_declared(v) for v in tensors.values()):
            raise bad
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
        size = path.stat().st_size
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, struct.error):
        raise bad from None
    if size != 8 + length + end:
        raise bad
    return tensors
