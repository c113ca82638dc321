"""The text-encoder part of LoRA adapter sets: prompts encoded with the function's LoRAs.

A LoRA file may adapt the text encoders (``text_encoder.*``, ``text_encoder_2.*``; kohya's
``lora_te*_``) besides the denoiser; a function's prompts must then be encoded with them.
Text encoders run where prompts are encoded: a pre worker (``runtime/worker_server.py``)
or, without workers, the executor's own pipeline; both use :class:`TextAdapters`.

Each file's text-encoder part is injected once per process into the shared encoders under
its own adapter name (a hash of its path), so sets that share a file share its weights;
:meth:`TextAdapters.encoding` makes one set active at its scales for the duration of an
encode and disables every adapter for a function without one. Loading goes through peft's
own API (``inject_adapter_in_model`` + ``set_peft_model_state_dict``): transformers'
``load_adapter`` wants a newer peft than the registry has. The state dict is read and
converted as diffusers' ``load_lora_weights`` reads it (``lora_state_dict``: kohya files
too), with diffusers' own rank and alpha rules, so the encodings equal diffusers'.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Iterator

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft
from diffusers.utils.peft_utils import (
    delete_adapter_layers,
    get_peft_kwargs,
    set_adapter_layers,
    set_weights_and_activate_adapters,
)
from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

from retouch.functions.adapters import AdapterSpec
from retouch.functions.errors import InvalidSpec
from retouch.runtime.adapters import read_lora

log = logging.getLogger(__name__)

CLIP_ROOT = "text_model."  # older LoRA files keep CLIP's root module; transformers 5 has none


def adapter_name(path: str) -> str:
    """The peft adapter name of one LoRA file: files are loaded once, whatever their scale."""
    return "te-" + hashlib.sha256(path.encode()).hexdigest()[:12]


class TextAdapters:
    """The LoRA text-encoder parts loaded into one pipeline's text encoders, and which of
    them is active. Thread-safe: an encode holds the lock while its set is active (the
    encoders are shared by every function of the model)."""

    def __init__(self, pipe: DiffusionPipeline) -> None:
        self.pipe = pipe
        self.encoders = {
            name: module
            for name in getattr(pipe, "_lora_loadable_modules", ())
            if name.startswith("text_encoder")
            and isinstance(module := getattr(pipe, name, None), torch.nn.Module)
        }
        self._files: dict[str, tuple[str, ...]] = {}  # path -> encoders it adapts
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def encoding(self, adapters: tuple[AdapterSpec, ...]) -> Iterator[None]:
        """Encode prompts with ``adapters``' text-encoder parts active at their scales
        (none: the base encoders), loading files not seen before. Afterwards the encoders
        are the base model's again: an encode outside this context gets no function's LoRA."""
        with self._lock:
            try:
                for i, adapter in enumerate(adapters):
                    self._load(adapter, f"adapters[{i}].path")
                self._activate(adapters)
                yield
            finally:
                self._activate(())

    def load(self, adapters: tuple[AdapterSpec, ...]) -> None:
        """Load ``adapters``' text-encoder parts now (a deploy), not on the first encode."""
        with self.encoding(adapters):
            pass

    def adapts(self, adapters: tuple[AdapterSpec, ...]) -> bool:
        """Whether any of ``adapters`` (loaded) changes a text encoder."""
        with self._lock:
            return any(self._files.get(a.path) for a in adapters)

    # -- under the lock ---------------------------------------------------------------------

    def _load(self, adapter: AdapterSpec, where: str) -> None:
        if adapter.path in self._files:
            return
        state, alphas = _lora_state(self.pipe, adapter.path, where)
        adapted: list[str] = []
        try:
            for prefix, encoder in self.encoders.items():
                part = _encoder_part(state, prefix, encoder)
                if part:
                    _inject(encoder, part, _alphas_of(alphas, prefix), adapter, where)
                    adapted.append(prefix)
        except BaseException:
            # A file one encoder refused leaves no layers in the encoders that took it
            # (peft makes a new adapter active: every later encode would use it).
            for prefix in adapted:
                delete_adapter_layers(self.encoders[prefix], adapter_name(adapter.path))
            raise
        self._files[adapter.path] = tuple(adapted)
        if adapted:
            log.info("loaded the %s part of %s", ", ".join(adapted), adapter.path)

    def _activate(self, adapters: tuple[AdapterSpec, ...]) -> None:
        for prefix, encoder in self.encoders.items():
            if not any(prefix in adapted for adapted in self._files.values()):
                continue  # no LoRA layers in this encoder: nothing to switch
            scales: dict[str, float] = {}  # one file named twice: its scales summed
            for a in adapters:
                if prefix in self._files.get(a.path, ()):
                    name = adapter_name(a.path)
                    scales[name] = scales.get(name, 0.0) + a.scale
            set_adapter_layers(encoder, enabled=bool(scales))
            if scales:
                set_weights_and_activate_adapters(encoder, list(scales), list(scales.values()))


def _lora_state(
    pipe: DiffusionPipeline, path: str, where: str
) -> tuple[dict[str, torch.Tensor], dict[str, float] | None]:
    """The file's state dict and network alphas as the denoiser's residency reads them
    (:func:`read_lora`: kohya and older diffusers layouts converted); a file diffusers
    cannot read is the spec's."""
    try:
        return read_lora(type(pipe), path)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise InvalidSpec(
            f"{path}: diffusers cannot read it as a LoRA ({exc})", field=where
        ) from exc


def _encoder_part(
    state: dict[str, torch.Tensor], prefix: str, encoder: torch.nn.Module
) -> dict[str, torch.Tensor]:
    """One text encoder's tensors, in peft's naming and the encoder's module names."""
    part = {k.removeprefix(f"{prefix}."): v for k, v in state.items() if k.startswith(f"{prefix}.")}
    if not part:
        return {}
    part = convert_state_dict_to_peft(convert_state_dict_to_diffusers(part))
    if not hasattr(encoder, "text_model"):
        part = {k.removeprefix(CLIP_ROOT): v for k, v in part.items()}
    return part


def _alphas_of(alphas: dict[str, float] | None, prefix: str) -> dict[str, float] | None:
    if not alphas:
        return None
    return {k.removeprefix(f"{prefix}."): v for k, v in alphas.items() if k.split(".")[0] == prefix}


def _inject(
    encoder: torch.nn.Module,
    part: dict[str, torch.Tensor],
    alphas: dict[str, float] | None,
    adapter: AdapterSpec,
    where: str,
) -> None:
    """Add the file's LoRA layers to ``encoder`` under its adapter name, with diffusers'
    rank and alpha rules; modules or widths the encoder lacks are the spec's error."""
    rank = {k: v.shape[1] for k, v in part.items() if k.endswith("lora_B.weight")}
    if not rank:
        raise InvalidSpec(f"{adapter.path}: its text-encoder part has no lora_B", field=where)
    config = LoraConfig(**get_peft_kwargs(rank, alphas, part, is_unet=False))
    name = adapter_name(adapter.path)
    modules = dict(encoder.named_modules())
    missing = sorted({k.split(".lora_")[0] for k in part} - set(modules))
    if missing:
        raise InvalidSpec(
            f"{adapter.path} adapts {missing[0]}, which this model's text encoder does not "
            "have: a LoRA for another base model",
            field=where,
        )
    first = next(encoder.parameters())  # the encoder's own device and dtype
    try:
        inject_adapter_in_model(config, encoder, adapter_name=name)
        result = set_peft_model_state_dict(encoder, part, adapter_name=name)
    except RuntimeError as exc:  # a width that does not fit: torch's size mismatch
        delete_adapter_layers(encoder, name)
        raise InvalidSpec(
            f"{adapter.path} does not fit this model's text encoder: a LoRA for another "
            f"base model ({str(exc).splitlines()[-1].strip()})",
            field=where,
        ) from exc
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        delete_adapter_layers(encoder, name)
        raise InvalidSpec(
            f"{adapter.path}: {unexpected[0]} matches no module of this model's text encoder",
            field=where,
        )
    encoder.to(device=first.device, dtype=first.dtype)
