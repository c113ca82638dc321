"""The entries a template's bake stores, from the model's shapes alone (no bake, no
weights: a pipeline built on the ``meta`` device will do), so that a capacity plan sizes
the activation store of a model nobody has baked on this machine.

Per template: the seed's ``noise`` and ``vae_noise`` and the family's ``template_tensors``
(step -1, float32, the latent shape). Per denoising step and block, in the family's block
order, the rows the bake records (``[rows, tokens, channels]`` in the compute dtype,
``docs/maskaware.md``, "The bake"): a UNet block's ``k{j}``/``v{j}`` (attn1's width) and
``y`` (its input's channels) at its level's token grid; a DiT block's ``k``, ``v`` and
``y`` (the model's inner width) on the patch grid. The rows then go through the
function's :class:`~retouch.runtime.maskaware.storedrows.EncodingWriter`, as in a bake, so
fp8 codes and scales come out of the same code that writes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from retouch.cachestore.manifest import EntrySpec
from retouch.runtime.maskaware.editor import TEMPLATE_BLOCK, MaskAwareEditor
from retouch.runtime.maskaware.loader import family_rows
from retouch.runtime.maskaware.rowformat import RowFormat
from retouch.runtime.maskaware.store import TEMPLATE_STEP
from retouch.runtime.maskaware.storedrows import EncodingWriter

Recorded = tuple[int, str, str, torch.dtype, tuple[int, ...]]  # step, block, name, dtype, shape


class EntryList:
    """A bake writer that keeps only what each tensor is (meta tensors carry no data)."""

    def __init__(self) -> None:
        self.entries: list[EntrySpec] = []

    def put(self, step: int, block: str, name: str, tensor: torch.Tensor) -> None:
        self.entries.append(EntrySpec.of((step, block, name), tensor))

    def annotate(self, items: dict[str, Any]) -> None:
        pass


def template_entries(
    editor: MaskAwareEditor, height: int, width: int, steps: int, storage: RowFormat
) -> list[EntrySpec]:
    """Every entry a bake of one ``height`` x ``width`` template at ``steps`` stores.
    Every step records the same tensors: the first step's go through the writer (an
    encoding of a meta tensor runs torch's Python reference ops, milliseconds each), the
    later steps repeat its entries."""
    sink = EntryList()
    writer = EncodingWriter(sink, storage)
    for step, block, name, dtype, shape in recorded_tensors(editor, height, width, min(steps, 1)):
        writer.put(step, block, name, torch.empty(shape, dtype=dtype, device="meta"))
    first = [entry for entry in sink.entries if entry.step == 0]
    later = [dataclasses.replace(entry, step=step) for step in range(1, steps) for entry in first]
    return sink.entries + later


def recorded_tensors(
    editor: MaskAwareEditor, height: int, width: int, steps: int
) -> Iterator[Recorded]:
    """What the bake hands its writer, in order: per-template tensors, then each step's."""
    impl = editor.impl
    latent = tuple(impl.noise_shape(height, width))
    for name in ("noise", "vae_noise", *impl.template_tensors):
        yield TEMPLATE_STEP, TEMPLATE_BLOCK, name, torch.float32, latent
    rows = family_rows(editor)
    per_step = [
        (block, name, shape)
        for block in rows.order
        for name, shape in _block_rows(editor, block, height, width)
    ]
    for step in range(steps):
        for block, name, shape in per_step:
            yield step, block, name, impl.dtype, shape


def _block_rows(
    editor: MaskAwareEditor, block: str, height: int, width: int
) -> Iterator[tuple[str, tuple[int, ...]]]:
    impl = editor.impl
    rows = family_rows(editor)
    names = dict.fromkeys((*rows.sparse[block], *rows.exit[block]))
    pipe = impl.pipe
    lh, lw = impl.latent_size(height, width)
    if getattr(pipe, "unet", None) is not None:
        module = pipe.unet.get_submodule(block)  # its GroupNorm sees the input channels
        h, w = _level_grid(lh, lw, _unet_level(block, impl.levels))
        for name in names:
            if name == "y":
                yield name, (impl.rows_per_request, h * w, module.norm.num_channels)
            else:
                attn = module.transformer_blocks[int(name[1:])].attn1
                yield name, (impl.rows_per_request, h * w, attn.to_k.out_features)
        return
    tokens = impl.grid_tokens(lh, lw)
    for name in names:
        yield name, (impl.rows_per_request, tokens, impl.row_channels(block, name))


def _unet_level(block: str, levels: int) -> int:
    """The resolution level of a UNet block: ``down_blocks.i`` is level i, the mid block the
    deepest, ``up_blocks.i`` level ``levels - 1 - i``."""
    stage, _, rest = block.partition(".")
    if stage == "mid_block":
        return levels - 1
    index = int(rest.split(".", 1)[0])
    return index if stage == "down_blocks" else levels - 1 - index


def _level_grid(h: int, w: int, level: int) -> tuple[int, int]:
    """The latent grid at ``level`` (each stride-2 downsampler halves, rounding up)."""
    for _ in range(level):
        h, w = (h + 1) // 2, (w + 1) // 2
    return h, w
