"""``bench production`` on a CPU at a small scale of the production shapes: the cases it
reports and the ratios' baseline; the compiled stock's blocks are uncompiled after it."""

from __future__ import annotations

import torch

from retouch.functions.demo.production import build_shape
from retouch.platform.lab.bench.production import _compiled_blocks, run_production_bench


def test_a_small_flux_shape_reports_stock_and_mask_aware_cases() -> None:
    (report,) = run_production_bench(
        ["flux-dev"], [0.2], [1], steps=2, repeats=1, tiers=("device",), device="cpu",
        scale=0.05, resolution=128, profile=False,
    )  # fmt: skip
    tiers = {c.tier: c for c in report.cases}
    assert tiers["stock"].step_ratio == 1.0 and tiers["stock"].step_ms > 0
    sparse = tiers["host"]  # no GPU: the device tiers are skipped, the host tier runs
    assert 0 < sparse.mask_ratio < 0.3 and sparse.flop_ratio < 1
    # on a CPU the eager stock is the only stock, so both ratios divide by it
    assert sparse.step_ratio == sparse.step_ratio_eager
    assert any("no GPU" in s for s in report.skipped)


def test_compiled_blocks_are_the_repeated_ones_and_uncompiled_after() -> None:
    _, pipe = build_shape("flux-dev", "cpu", scale=0.05, dtype=torch.float32)
    denoiser = pipe.transformer
    blocks = [*denoiser.transformer_blocks, *denoiser.single_transformer_blocks]
    with _compiled_blocks(denoiser) as compiled:
        assert compiled == len(blocks)  # regional: the blocks, not the whole denoiser
        assert all(b._compiled_call_impl is not None for b in blocks)
        assert denoiser._compiled_call_impl is None
    assert all(b._compiled_call_impl is None for b in blocks)


def test_the_engine_bench_times_stock_with_its_denoiser_graphed(models_dir) -> None:
    """``bench engine``'s graphed stock (run on CUDA; on a CPU the graph bookkeeping
    replays eagerly): the stock edits through ``StockGraphs``, its forward put back after."""
    import time

    from retouch.functions.demo.images import template_image
    from retouch.platform.lab.bench.engine import _graphed_stock_s, load_demo
    from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor

    cpu = torch.device("cpu")
    family, pipe, size = load_demo("retouch:tiny-sd", models_dir, "engine", cpu, "auto")
    editor = MaskAwareEditor(pipe, family, cpu)
    template = template_image((size, size), seed=1)
    mask = torch.zeros(size, size, dtype=torch.bool).numpy()
    mask[32:64, 32:64] = True
    requests = [EditRequest(template, mask, "a red bicycle", 1, 2, 4.0, "a quiet street", 1)]
    seconds = _graphed_stock_s(editor, requests, 2, time.perf_counter, cpu)
    assert seconds > 0
    assert "forward" not in vars(pipe.unet)  # the wrapper is gone: later runs are eager
