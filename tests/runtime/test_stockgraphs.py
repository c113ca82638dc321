"""The stock denoiser call from graphs (the best-stock baseline) gives the stock pipeline's
images: on a CPU the capture bookkeeping runs with eager "replays" on the static inputs,
so what is checked is that every input reaches the replay (static copies refilled per
call) and that a new argument layout gets its own entry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retouch.functions.demo.images import template_image
from retouch.functions.demo.models import demo_model, ensure_demo_model
from retouch.functions.families import family_spec
from retouch.runtime.maskaware.editor import EditRequest, MaskAwareEditor
from retouch.runtime.models import load_pipeline
from retouch.runtime.stockgraphs import StockGraphs
from tests.runtime.maskaware.test_buckets import blob_mask

CPU = torch.device("cpu")
STEPS = 3


@pytest.mark.parametrize("model", ["retouch:tiny-flux", "retouch:tiny-sd"])
def test_stock_steps_from_graphs_give_the_stock_images(model, models_dir) -> None:
    spec = demo_model(model)
    pipe = load_pipeline(ensure_demo_model(model, models_dir), spec.family, CPU)
    editor = MaskAwareEditor(pipe, spec.family, CPU)
    size, guidance = spec.resolution, family_spec(spec.family).guidance
    template = template_image((size, size), 1)

    def requests(n: int) -> list[EditRequest]:
        return [
            EditRequest(template, blob_mask(size, i, 0.2), "a red bicycle", 7 + i, STEPS,
                        guidance, "a quiet street", 1)
            for i in range(n)
        ]  # fmt: skip

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # static inputs are other allocations: same kernels
    try:
        eager = editor.stock_edits(requests(2), output_type="np")
        alone = editor.stock_edits(requests(1), output_type="np")
        denoiser = getattr(pipe, editor.impl.denoiser)
        with StockGraphs(denoiser, CPU) as graphs:
            graphed = editor.stock_edits(requests(2), output_type="np")
            again = editor.stock_edits(requests(1), output_type="np")
            assert len(graphs.entries) == 2  # batch 2 and batch 1: one layout each
            assert graphs.eager == 2 and graphs.replays == 2 * (STEPS - 1)
        assert "forward" not in vars(denoiser)  # the module's own forward again
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_allclose(eager, graphed, atol=1e-6)
    np.testing.assert_allclose(alone, again, atol=1e-6)
