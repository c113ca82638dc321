"""``retouch bench ops``: aten ops dispatched per denoising step, mask-aware vs stock.

On a GPU a step's host overhead (Python, dispatcher, kernel launches) grows with the number
of ops it dispatches, and on small models or small masks that overhead, not the FLOPs,
bounds the step. Counting the ops is a CPU proxy for it: deterministic, independent of the
machine's load, and available without a GPU. Issue #29's acceptance is a mask-aware (sparse)
step dispatching at most 1.25× the ops of a stock step, per model family.

Every op call that reaches a :class:`~torch.utils._python_dispatch.TorchDispatchMode` is
counted (aten ops after the decompositions that happen above that mode). What one *step*
is, the same on both sides: one non-final denoising step of a batch, everything the
pipeline does per step on the calling thread, i.e. the denoiser's forward, the guidance
combination, the scheduler step and the inpaint blend (the final step is left out on both
sides: the pipelines skip the blend's re-noising there).

* stock: ``(ops(stock_edits with N steps) - ops(stock_edits with 1 step)) / (N - 1)``:
  one batched diffusers call each, so the set-up, the encodes and the VAE decode cancel.
* sparse: the requests are prepared (outside the count), then each of the first ``N - 1``
  ``editor.step(states)`` calls is counted. The first of them also builds what a batch
  builds once and re-uses every later step (its token layouts, device index tensors, 1×1
  projection matrices): it is reported on its own (``first_step_ops``), and ``sparse_ops``
  is the mean of the later ones, the steady state a served request spends most steps in
  (so ``N`` ≥ 3). No row loader is declared, so the blocks gather their cached rows
  themselves, on the counted thread.

``top_extra`` lists the ops with the largest per-step excess (sparse minus stock).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from retouch.functions.demo.images import template_image
from retouch.functions.families import family_spec
from retouch.platform.api.config import default_data_dir
from retouch.platform.lab.bench.engine import EDIT_PROMPT, TEMPLATE_PROMPT, aligned_mask, load_demo
from retouch.runtime.maskaware.buckets import Buckets
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.maskaware.store import MemoryActivations

log = logging.getLogger(__name__)

TOP = 10  # ops listed in ``top_extra``
LAYOUTS = ("exact", "bucketed")


class OpCounter(TorchDispatchMode):
    """Counts, by aten op name, every op call that reaches the mode while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.name()] += 1
        return func(*args, **(kwargs or {}))


def count_ops(run: Callable[[], object]) -> Counter[str]:
    """The ops ``run()`` dispatches on this thread, by name."""
    with OpCounter() as counter:
        run()
    return counter.counts


def run_ops_bench(
    models: list[str],
    mask_ratio: float = 0.2,
    batch: int = 1,
    steps: int = 3,
    models_dir: Path | None = None,
    *,
    guidance: float = 4.0,
    tier: str = "device",
    layout: str = "exact",
) -> list[dict[str, Any]]:
    """Ops per step, stock and sparse, for each built-in model (on the CPU).

    ``tier``: where the template's rows rest for the sparse steps: ``device`` (resident
    with the model: blocks copy them whole, the path a GPU serves hot templates from) or
    ``host`` (gathered per request and block, the host tier's path). ``layout``: the
    sparse steps' token layout, ``exact`` (each mask's own shapes) or ``bucketed`` (masked
    tokens padded to a bucket: the layout a served GPU step is captured with).

    One row per model: ``model, family, mask_ratio, batch, stock_ops, sparse_ops, ratio
    (sparse / stock), top_extra`` (``[(op, sparse - stock), ...]``, the ``TOP`` largest
    positive), ``first_step_ops`` (the first sparse step, layouts built). ``steps`` (≥ 3):
    the edits' denoising steps; the first and the last are not in ``sparse_ops``.
    """
    if steps < 3:
        raise ValueError("steps must be at least 3 (the first and the final step are not counted)")
    if batch < 1:
        raise ValueError("batch must be at least 1")
    if tier not in ("device", "host"):
        raise ValueError(f"tier must be device or host, not {tier!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    folder = models_dir or default_data_dir() / "models"
    return [_model_row(m, mask_ratio, batch, steps, folder, guidance, tier, layout) for m in models]


def _model_row(
    model: str,
    mask_ratio: float,
    batch: int,
    steps: int,
    models_dir: Path,
    guidance: float,
    tier: str,
    layout: str,
) -> dict[str, Any]:
    device = torch.device("cpu")
    family, pipe, size = load_demo(model, models_dir, "ops", device)
    editor = MaskAwareEditor(pipe, family, device)
    if layout == "bucketed":
        editor.set_buckets(Buckets())
    template = template_image((size, size), seed=1)
    mask = aligned_mask(size, mask_ratio, editor.model_family.token_cell(pipe))
    halo = family_spec(family).halo

    def requests(n: int) -> list[EditRequest]:
        return [
            EditRequest(
                template, mask, EDIT_PROMPT, 100 + i, n, guidance, TEMPLATE_PROMPT, 1, 0, halo
            )
            for i in range(batch)
        ]

    stock = count_ops(lambda: editor.stock_edits(requests(steps), output_type="np"))
    stock.subtract(count_ops(lambda: editor.stock_edits(requests(1), output_type="np")))

    store = MemoryActivations()
    editor.bake(template, TEMPLATE_PROMPT, 1, steps, guidance, store)
    if tier == "device":
        store = store.placed(device)
    states = [editor.prepare(r, store) for r in requests(steps)]
    first = count_ops(lambda: editor.step(states))
    sparse: Counter[str] = Counter()
    for _ in range(steps - 2):
        sparse.update(count_ops(lambda: editor.step(states)))

    stock_ops = sum(stock.values()) / (steps - 1)
    sparse_ops = sum(sparse.values()) / (steps - 2)
    extra = {
        op: sparse[op] / (steps - 2) - stock[op] / (steps - 1) for op in set(sparse) | set(stock)
    }
    top = sorted(((op, d) for op, d in extra.items() if d > 0), key=lambda x: (-x[1], x[0]))
    row = {
        "model": model,
        "family": family,
        "mask_ratio": mask_ratio,
        "batch": batch,
        "tier": tier,
        "layout": layout,
        "stock_ops": _number(stock_ops),
        "sparse_ops": _number(sparse_ops),
        "first_step_ops": sum(first.values()),
        "ratio": round(sparse_ops / stock_ops, 3),
        "top_extra": [(op, _number(d)) for op, d in top[:TOP]],
    }
    log.info("%s", row)
    return row


def _number(value: float) -> int | float:
    """An integral count as an int, else rounded to a tenth."""
    return int(value) if value == int(value) else round(value, 1)
