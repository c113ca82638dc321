"""Row gathers along the token dimension (-2)."""

from __future__ import annotations

import pytest
import torch

from retouch.cachestore.rows import RowSelection, gather_rows


@pytest.mark.parametrize("shape", [(50, 8), (2, 50, 8), (2, 3, 50, 8)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gather_matches_indexing(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    src = torch.randn(shape).to(dtype)
    rows = torch.tensor([0, 7, 8, 9, 49, 3])
    out = torch.empty((*shape[:-2], len(rows), shape[-1]), dtype=dtype)
    gather_rows(src, rows, out)
    assert torch.equal(out, src[..., rows, :])


def test_gather_into_non_contiguous_out() -> None:
    src = torch.randn(2, 20, 4)
    rows = torch.tensor([1, 2, 19], dtype=torch.int32)
    big = torch.zeros(2, 3, 8)
    out = big[..., :4]
    gather_rows(src, rows, out)
    assert torch.equal(big[..., :4], src[:, rows.long()])
    assert torch.count_nonzero(big[..., 4:]) == 0


def test_gather_refuses_mismatched_out() -> None:
    src = torch.randn(2, 20, 4)
    with pytest.raises(ValueError, match="out must be"):
        gather_rows(src, torch.tensor([1, 2]), torch.empty(2, 3, 4))
    with pytest.raises(ValueError, match="out must be"):
        gather_rows(src, torch.tensor([1, 2]), torch.empty(2, 2, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="rows"):
        gather_rows(src, torch.tensor([[1, 2]]), torch.empty(2, 2, 4))


def test_row_selection_is_reused_across_shapes() -> None:
    selection = RowSelection(torch.tensor([2, 0, 5], dtype=torch.int32))
    for shape in [(6, 3), (2, 6, 3), (4, 6, 3), (2, 6, 3)]:
        src = torch.randn(shape)
        out = torch.empty((*shape[:-2], 3, 3))
        gather_rows(src, selection, out)
        assert torch.equal(out, src[..., [2, 0, 5], :])
    assert len(selection) == 3 and len(selection._flat) == 3
