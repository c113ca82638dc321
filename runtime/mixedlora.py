"""Mixed-adapter steps: the rows of one batch each compute with their own LoRA set.

Why: peft selects adapters per model (``set_adapters``), so a batch could run one adapter
set and the sets of a long tail took turns, each turn a swap, batches of one. Here a step
of several sets runs every LoRA layer's base projection once for the whole batch (peft's
layers with their adapters disabled compute exactly their base layer) and a forward hook
adds each row's low-rank updates (S-LoRA's and Punica's gathered update, in plain torch
ops): every resident file has a *slot* in a per-layer stack of its A and B matrices (rank
padded with zeros to the layer's largest; slot 0 is all zeros, the bare model's), a step's
rows gather their slots' matrices and two batched matmuls compute every row's update at
once. The dispatched ops per layer do not grow with the number of sets in the batch.

The arithmetic per row is peft's, ``base(x) + B(A(dropout(x))) * scale * alpha / r``
(``LoraLayer.set_scale``; dropout is the identity at inference), with ``alpha / r`` folded
into the stacked B, zero-padded ranks (which add exact zeros) and other GEMM shapes: equal
within float tolerance, not to the bit. A row whose set holds several files
takes one update per file (a second, general path: gathered pairs added with
``index_add``).

The hook is a no-op outside :func:`rows_with`; it is registered on each LoRA wrapper when
the residency puts it into the denoiser (``adapterlayers``). A layer's input is laid out
with the batch's model rows first (``[rows, ...]``: the stock step, the padded layout), or
it is the packed layout of the sparse block running (``[1, T, C]``, every row's masked
tokens one after another, ``ForwardContext.grid``): the update then lays the tokens out in
padded rows for its two rank-sized matmuls and adds back to the packed output, so the
layer's own projection, attention and every other op run packed, without the padding a
batch of unequal masks would cost. Families whose packed layers all see that layout say
so (``FamilyModel.mixes_packed``: the UNet); the others' mixed steps run padded (Flux's
packed blocks project text and image rows together, 2-D). Plain LoRA on linear layers
only: a DoRA file or a LoRA of a convolution is refused when a step mixes it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from retouch.runtime.maskaware.context import current as current_forward

ZERO_SLOT = 0  # the bare model's slot: zero matrices


@dataclass(frozen=True)
class RowAdapters:
    """Which slot updates which row in one step, at which scale.

    ``slots``: the residency's files by slot (``slots[0]`` is the zero slot, None), and
    ``generation`` identifies that assignment (a layer restacks when it changes). Each
    (row, slot, scale) triple is one update; ``dense`` when the triples are exactly the
    rows in order (every row one file or none), the common case the fast path serves.
    """

    slots: tuple[str | None, ...]
    generation: int
    rows: int  # the batch's model rows
    pair_rows: torch.Tensor  # int64 [P]
    pair_slots: torch.Tensor  # int64 [P]
    pair_scales: torch.Tensor  # float32 [P, 1, 1]
    dense: bool


_current: RowAdapters | None = None  # engine thread only: set for one step by rows_with


def row_adapters(
    sets: Sequence[Mapping[str, float]],
    rows_per_request: int,
    slots: Mapping[str, int],
    names: tuple[str | None, ...],
    generation: int,
    device: torch.device | str,
) -> RowAdapters:
    """The step's plan: ``sets[i]`` maps the PEFT adapter names of request ``i``'s files to
    their scales (empty: the bare model); request ``i`` owns model rows ``i * per`` to
    ``(i + 1) * per - 1`` (its guidance halves), as every family lays its batch out.
    ``slots`` maps each name to its slot, ``names`` lists them by slot."""
    triples: list[tuple[int, int, float]] = []
    for i, adapters in enumerate(sets):
        pairs = [(slots[name], float(scale)) for name, scale in adapters.items()] or [
            (ZERO_SLOT, 0.0)
        ]
        for row in range(i * rows_per_request, (i + 1) * rows_per_request):
            triples.extend((row, slot, scale) for slot, scale in pairs)
    rows = len(sets) * rows_per_request
    dense = [r for r, _, _ in triples] == list(range(rows))
    return RowAdapters(
        names,
        generation,
        rows,
        torch.tensor([r for r, _, _ in triples], dtype=torch.int64, device=device),
        torch.tensor([s for _, s, _ in triples], dtype=torch.int64, device=device),
        torch.tensor([c for _, _, c in triples], dtype=torch.float32, device=device).view(-1, 1, 1),
        dense,
    )


@contextmanager
def rows_with(denoiser: nn.Module, plan: RowAdapters) -> Iterator[None]:
    """Run the block of code (one step's forward) with ``plan``'s per-row updates: peft's
    own adapters off (every LoRA layer computes its base), the hooks adding the updates."""
    global _current
    if _current is not None:
        raise RuntimeError("mixed-adapter steps do not nest")
    if getattr(denoiser, "_hf_peft_config_loaded", False):
        denoiser.disable_lora()
    _current = plan
    try:
        yield
    finally:
        _current = None


def hook(layer: nn.Module) -> None:
    """Register the per-row update on a LoRA wrapper (once)."""
    if isinstance(layer, LoraLayer) and not getattr(layer, "_retouch_rows_hooked", False):
        layer.register_forward_hook(_add_rows)
        layer._retouch_rows_hooked = True
        layer._retouch_stack = None


def drop_stacks(module: nn.Module) -> None:
    """Forget the layers' built stacks (a second copy of the slotted weights, not in the
    module's parameters): a sleep that moves the weights to the host frees them too, and
    the next mixed step builds them again from the LoRA layers."""
    for layer in module.modules():
        if getattr(layer, "_retouch_stack", None) is not None:
            layer._retouch_stack = None


def stack_bytes(denoiser: nn.Module, slots: Sequence[str | None]) -> int:
    """Bytes the layers' stacks take for this slot assignment (built at the next mixed
    step): on each LoRA layer a slotted file targets, A and B for every slot (free ones
    too) at the layer's largest rank. The residency counts them in its byte budget: with
    every resident file slotted they are a second copy of its adapters' weights."""
    names = {name for name in slots if name is not None}
    total = 0
    for layer in denoiser.modules():
        if not isinstance(layer, LoraLayer):
            continue
        files = [name for name in layer.lora_A if name in names]
        if not files:
            continue
        rank = max(layer.r[name] for name in files)
        weight = layer.get_base_layer().weight
        itemsize = layer.lora_A[files[0]].weight.element_size()
        total += len(slots) * (weight.shape[0] + weight.shape[1]) * rank * itemsize
    return total


@dataclass(frozen=True)
class _Stack:
    """One layer's slots, laid out for the batched matmuls: A transposed ``[S, in, r]``
    and B transposed and scaled by its file's ``alpha / r`` ``[S, r, out]`` (zero where a
    slot's file does not target this layer, and beyond a file's rank)."""

    generation: int
    a: torch.Tensor
    b: torch.Tensor


def _stack(layer: LoraLayer, plan: RowAdapters) -> _Stack:
    stack = layer._retouch_stack
    if stack is not None and stack.generation == plan.generation:
        return stack
    files = [name for name in plan.slots if name is not None and name in layer.lora_A]
    for name in files:
        if name in layer.lora_variant:
            raise ValueError(f"adapter {name}: mixed steps take plain LoRA (no DoRA)")
        if not isinstance(layer.lora_A[name], nn.Linear):
            raise ValueError(f"adapter {name}: mixed steps take LoRAs of linear layers")
    rank = max((layer.r[name] for name in files), default=1)
    weight = layer.get_base_layer().weight
    dtype = layer.lora_A[files[0]].weight.dtype if files else weight.dtype
    slots = len(plan.slots)
    a = torch.zeros(slots, weight.shape[1], rank, dtype=dtype, device=weight.device)
    b = torch.zeros(slots, rank, weight.shape[0], dtype=dtype, device=weight.device)
    for slot, name in enumerate(plan.slots):
        if name is None or name not in layer.lora_A:
            continue
        r = layer.r[name]
        root = math.sqrt(r) if layer.use_rslora.get(name, False) else r
        a[slot, :, :r] = layer.lora_A[name].weight.t()
        b[slot, :r] = layer.lora_B[name].weight.t() * (layer.lora_alpha[name] / root)
    layer._retouch_stack = _Stack(plan.generation, a, b)
    return layer._retouch_stack


def _add_rows(layer: LoraLayer, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    """Every row's updates: two batched matmuls over the rows' gathered slots, scaled by
    each row's scale, added in place (six ops a layer on the dense path; two more where
    the layer sees the packed layout)."""
    plan = _current
    if plan is None:
        return None
    x = args[0]
    packed = None if x.shape[0] == plan.rows else _packed_rows(x, plan)
    if packed is not None:
        if packed.tokens == 0:
            return output
        x = packed.rows(x)
    update = _updates(x, plan, _stack(layer, plan)).to(output.dtype)
    if packed is None:
        if plan.dense:
            output.add_(update)
        else:
            output.index_add_(0, plan.pair_rows, update)
        return output
    if not plan.dense:  # each row's sum of its files' updates
        update = update.new_zeros(plan.rows, *update.shape[1:]).index_add_(
            0, plan.pair_rows, update
        )
    packed.add(output, update)
    return output


def _updates(x: torch.Tensor, plan: RowAdapters, stack: _Stack) -> torch.Tensor:
    """Each (row, slot, scale) pair's update of the rows-first ``x``: ``[P, ..., out]``."""
    pairs = x if plan.dense else x.index_select(0, plan.pair_rows)
    if pairs.dtype != stack.a.dtype:
        pairs = pairs.to(stack.a.dtype)
    flat = pairs if pairs.ndim == 3 else pairs.reshape(pairs.shape[0], -1, pairs.shape[-1])
    hidden = torch.bmm(flat, stack.a.index_select(0, plan.pair_slots))
    update = torch.bmm(hidden, stack.b.index_select(0, plan.pair_slots)).mul_(plan.pair_scales)
    if pairs.ndim != 3:
        update = update.view(*pairs.shape[:-1], update.shape[-1])
    return update


@dataclass(frozen=True)
class _Packed:
    """A packed token grid (``[1, T, C]``: every row's masked tokens one after another)
    laid out as rows ``[rows, n_max, C]`` for the low-rank update, and back: only the
    rank-sized matmuls see the padding, the layer's own projection runs packed."""

    rows_n: int
    n_max: int
    tokens: int
    gather: torch.Tensor | None  # [rows * n_max]: the packed token each padded slot reads
    keep: torch.Tensor | None  # [T]: each packed token's padded slot; None: no padding

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(self.tokens, x.shape[-1])
        if self.gather is not None:
            flat = flat.index_select(0, self.gather)
        return flat.view(self.rows_n, self.n_max, x.shape[-1])

    def add(self, output: torch.Tensor, update: torch.Tensor) -> None:
        flat = update.reshape(self.rows_n * self.n_max, update.shape[-1])
        if self.keep is not None:
            flat = flat.index_select(0, self.keep)
        output[0].add_(flat)


def _packed_rows(x: torch.Tensor, plan: RowAdapters) -> _Packed:
    """``x`` in the packed layout of the sparse block running now (``ForwardContext.grid``,
    set by a family whose ``mixes_packed`` says its packed layers all see ``[1, T, C]``).
    The grid's index tensors are made once per layout (``TokenBatch.padded_slots``); a
    bucketed grid's rows are all full: a view, no index (nothing made during a capture)."""
    ctx = current_forward()
    grid = ctx.grid if ctx is not None else None
    tokens = sum(grid.counts) if grid is not None else -1
    if (
        grid is None
        or not grid.packed
        or grid.rows != plan.rows
        or x.ndim != 3
        or x.shape[:2] != (1, tokens)
    ):
        raise RuntimeError(
            f"a mixed-adapter step's layer got an input of shape {tuple(x.shape)}: neither "
            f"its batch's {plan.rows} rows nor the packed tokens of the running grid"
        )
    keep = grid.unpadded_slots
    gather = None if keep is None else grid.padded_slots
    return _Packed(grid.rows, grid.n_max, tokens, gather, keep)
