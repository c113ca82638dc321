"""A LoRA file's denoiser layers: built off the engine thread, attached between steps.

Why: diffusers' ``load_lora_adapter`` spends nearly all of its time (about 210 of 220 ms on
tiny-sd, 2-core CPU) in peft walking the whole denoiser and creating modules, and it
changes the live modules, so it can only run on the engine thread, in one piece: the
running batch's step stalls for about six steps' time. Here the same peft calls
(``inject_adapter_in_model`` + ``set_peft_model_state_dict``, with the ``LoraConfig``
diffusers derives from the file) run in the reader thread on a *shadow*: a module tree that
holds only the targeted base layers (the live objects, shared and never changed) at their
dotted paths. That yields one peft LoRA wrapper per target with its weights loaded.

What is left for the engine thread is :func:`attach_some`: per layer, a module swap (a base
layer no adapter wraps yet) or moving the new adapter's entries into the layer's existing
wrapper (peft's per-adapter attributes, the lists its ``delete_adapter`` removes), about
0.1 ms a layer, done a few layers at a time under a time budget between steps. No attached
layer computes with the new adapter: a live wrapper keeps its active adapters, a new
wrapper has none active (its base layer's output exactly). Once every layer is in, the
adapter's config is registered with the denoiser (``peft_config``) so that diffusers'
``set_adapters`` and ``delete_adapters`` know it: the results equal a one-piece
``load_lora_adapter`` exactly (same config, same modules, same tensors).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from diffusers.utils import convert_unet_state_dict_to_peft
from diffusers.utils.peft_utils import _create_lora_config
from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from retouch.runtime.mixedlora import hook

CHUNK = 8  # targets built per shadow between two calls of a build's ``pace``


@dataclass
class LoraLayers:
    """One file's denoiser LoRA under the PEFT adapter ``name``: its config and the built
    wrappers (dotted path, wrapper) not yet attached. ``config`` is None for a file
    without a denoiser part (a text-encoder-only LoRA): nothing to attach or select."""

    name: str
    config: LoraConfig | None
    pending: deque[tuple[str, BaseTunerLayer]] = field(default_factory=deque)


def build_layers(
    denoiser: nn.Module,
    prefix: str,
    weights: dict[str, torch.Tensor],
    alphas: dict[str, float] | None,
    name: str,
    pace: Callable[[float], None] | None = None,
) -> LoraLayers:
    """(any thread) The file's LoRA layers for ``denoiser``, as ``load_lora_adapter``
    would make them, built on shadows of the targeted layers: the live modules are only
    read. ``weights`` and ``alphas`` are in diffusers' layout (``lora_state_dict``).

    The build runs :data:`CHUNK` targets at a time, each chunk on its own shadow (peft's
    walks stay small), and hands the seconds each took to ``pace`` (which may sleep):
    building is Python work that holds the interpreter lock, so a build at full speed
    slows a step that needs it too."""
    state = {
        k.removeprefix(f"{prefix}."): v for k, v in weights.items() if k.startswith(f"{prefix}.")
    }
    if not state:
        return LoraLayers(name, None)
    if any(".lokr_" in k or "lora_controlnet" in k for k in state):
        raise ValueError(f"adapter {name}: LoKr and control LoRA files are not LoRA adapters")
    if "lora_A" not in next(iter(state)):
        state = convert_unet_state_dict_to_peft(state)
    ranks = {f"^{k}": v.shape[1] for k, v in state.items() if "lora_B" in k and v.ndim > 1}
    if alphas:
        alphas = {
            k.removeprefix(f"{prefix}."): v for k, v in alphas.items() if k.startswith(f"{prefix}.")
        }
    config = _create_lora_config(state, alphas, None, ranks, adapter_name=name)
    targets = sorted({k.split(".lora")[0] for k in state})
    built: deque[tuple[str, BaseTunerLayer]] = deque()
    for start in range(0, len(targets), CHUNK):
        began = time.perf_counter()
        chunk = targets[start : start + CHUNK]
        built.extend(_build_chunk(denoiser, config, state, chunk, name))
        if pace is not None:
            pace(time.perf_counter() - began)
    return LoraLayers(name, config, built)


def _build_chunk(
    denoiser: nn.Module,
    config: LoraConfig,
    state: dict[str, torch.Tensor],
    targets: list[str],
    name: str,
) -> list[tuple[str, BaseTunerLayer]]:
    """The wrappers of ``targets``, built and loaded on a shadow of their base layers."""
    shadow = _shadow(denoiser, targets)
    mine = {k: v for k, v in state.items() if k.split(".lora")[0] in targets}
    inject_adapter_in_model(config, shadow, adapter_name=name, low_cpu_mem_usage=True)
    set_peft_model_state_dict(shadow, mine, adapter_name=name, low_cpu_mem_usage=True)
    built = [(path, shadow.get_submodule(path)) for path in targets]
    for _, wrapper in built:
        wrapper.set_adapter([])  # attached, it computes its base layer until selected
    return built


def _shadow(denoiser: nn.Module, targets: list[str]) -> nn.Module:
    """A tree of empty modules with each target's base layer (the live object) at its
    path: peft injects into it without touching the denoiser's own modules."""
    root = nn.Module()
    for path in targets:
        try:
            live = denoiser.get_submodule(path)
        except AttributeError as exc:
            raise ValueError(f"the LoRA targets {path!r}, which the denoiser lacks") from exc
        base = live.get_base_layer() if isinstance(live, BaseTunerLayer) else live
        *parents, leaf = path.split(".")
        node = root
        for part in parents:
            child = node._modules.get(part)
            if child is None:
                child = nn.Module()
                node.add_module(part, child)
            node = child
        node.add_module(leaf, base)
    return root


def attach_some(denoiser: nn.Module, lora: LoraLayers, deadline: float | None) -> bool:
    """(engine thread, between steps) Attach built layers until ``deadline`` (a
    ``perf_counter`` time; at least one layer; None: all of them). True once every layer
    is in and the adapter is registered with the denoiser."""
    while lora.pending:
        path, wrapper = lora.pending[0]
        _attach(denoiser, path, wrapper, lora.name)  # on failure the layer stays pending
        lora.pending.popleft()
        if deadline is not None and time.perf_counter() >= deadline and lora.pending:
            return False
    if lora.config is not None:
        if getattr(denoiser, "peft_config", None) is None:
            denoiser.peft_config = {}
        denoiser.peft_config[lora.name] = lora.config
        denoiser._hf_peft_config_loaded = True
    return True


def _attach(denoiser: nn.Module, path: str, wrapper: BaseTunerLayer, name: str) -> None:
    """Put one built layer in: the wrapper itself where the base layer is bare, else the
    adapter's entries into the wrapper already there (its active adapters unchanged)."""
    parent_path, _, attr = path.rpartition(".")
    parent = denoiser.get_submodule(parent_path) if parent_path else denoiser
    live = parent._modules[attr]
    if not isinstance(live, BaseTunerLayer):
        if live is not wrapper.get_base_layer():
            raise RuntimeError(f"{path} changed since adapter {name} was built for it")
        parent._modules[attr] = wrapper
        hook(wrapper)  # a mixed-adapter step's per-row updates (runtime/mixedlora)
        return
    if live.get_base_layer() is not wrapper.get_base_layer():
        raise RuntimeError(f"{path} changed since adapter {name} was built for it")
    for attribute in (*live.adapter_layer_names, *live.other_param_names, "lora_variant"):
        source = getattr(wrapper, attribute, None)
        if source is not None and name in source:
            getattr(live, attribute)[name] = source[name]
