"""Token sets, the packed/padded layouts, the in-memory store and noise composition."""

from __future__ import annotations

import pytest
import torch

from retouch.runtime.maskaware.noise import SeedNoise
from retouch.runtime.maskaware.store import MemoryActivations, fetch_rows
from retouch.runtime.maskaware.tokens import TokenBatch, TokenSet, level_sizes, pool_mask

CPU = torch.device("cpu")


def test_pool_mask_marks_every_token_that_covers_a_masked_pixel() -> None:
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[5, 2] = True
    pooled = pool_mask(mask, (4, 4))
    assert pooled.sum() == 1 and pooled[2, 1]
    assert pool_mask(mask, (8, 8)).equal(mask)


def test_pool_mask_odd_grid_uses_ceil_like_a_stride_two_conv() -> None:
    assert level_sizes(9, 7, 3) == [(9, 7), (5, 4), (3, 2)]
    mask = torch.zeros(9, 7, dtype=torch.bool)
    mask[8, 6] = True
    pooled = pool_mask(mask, (5, 4))
    assert pooled.shape == (5, 4) and pooled[4, 3] and pooled.sum() == 1


def test_token_set_splits_positions() -> None:
    grid = torch.tensor([[True, False], [False, True]])
    tokens = TokenSet.from_grid(grid)
    assert tokens.masked.tolist() == [0, 3] and tokens.unmasked.tolist() == [1, 2]
    assert tokens.ratio == 0.5


def _ragged_batch(packed: bool) -> TokenBatch:
    grids = [torch.zeros(4, 4, dtype=torch.bool) for _ in range(3)]
    grids[0][0, :3] = True
    grids[1][1:3, 1:3] = True
    grids[2][3, 3] = True
    sets = tuple(TokenSet.from_grid(g) for g in grids)
    return TokenBatch(sets, rows_per_request=2, packed=packed, device=CPU)


@pytest.mark.parametrize("packed", [True, False])
def test_gather_scatter_round_trip(packed: bool) -> None:
    batch = _ragged_batch(packed)
    assert batch.counts == (3, 3, 4, 4, 1, 1) and batch.rows == 6
    full = torch.randn(batch.rows, 16, 5)
    sparse = batch.gather(full)
    assert sparse.shape == ((1, 16, 5) if packed else (6, 4, 5))
    rows = batch.real_rows(sparse)
    assert rows.equal(full.reshape(-1, 5)[batch.flat_index])
    out = batch.scatter(sparse * 2, full.clone())
    touched = torch.zeros(96, dtype=torch.bool)
    touched[batch.flat_index] = True
    assert out.reshape(-1, 5)[touched].equal(full.reshape(-1, 5)[touched] * 2)
    assert out.reshape(-1, 5)[~touched].equal(full.reshape(-1, 5)[~touched])


def test_packed_and_padded_agree_on_real_rows() -> None:
    full = torch.randn(6, 16, 3)
    packed, padded = _ragged_batch(True), _ragged_batch(False)
    assert packed.real_rows(packed.gather(full)).equal(padded.real_rows(padded.gather(full)))
    assert packed.segments == ((0, 3), (3, 3), (6, 4), (10, 4), (14, 1), (15, 1))
    assert packed.row_of_token.tolist() == [0] * 3 + [1] * 3 + [2] * 4 + [3] * 4 + [4, 5]


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("requests", [1, 3])
def test_gather_from_a_channels_first_map_equals_gather_of_its_tokens(
    packed: bool, requests: int
) -> None:
    """UNet blocks pick masked tokens straight from ``[rows, C, H, W]`` maps."""
    grid = torch.zeros(4, 4, dtype=torch.bool)
    grid[1:3, 2:] = True
    sets = [TokenSet.from_grid(grid.roll(r, dims=1)) for r in range(requests)]
    batch = TokenBatch(tuple(sets), 2, packed, CPU)
    fmap = torch.randn(batch.rows, 3, 4, 4)
    tokens = fmap.flatten(2).transpose(1, 2)
    assert batch.gather_map(fmap).equal(batch.gather(tokens))


def test_everything_batch_covers_all_tokens() -> None:
    batch = TokenBatch.everything(5, requests=2, rows_per_request=1, device=CPU)
    assert batch.total == 10 and batch.flat_index.tolist() == list(range(10))


def test_memory_store_row_gather_matches_index_select() -> None:
    store = MemoryActivations()
    tensor = torch.randn(2, 10, 4)
    store.writer().put(3, "block", "k", tensor)
    rows = torch.tensor([1, 4, 9])
    out = torch.empty(2, 3, 4)
    fetch_rows(store.reader(), 3, "block", "k", rows, out)
    assert out.equal(tensor[:, rows])
    assert store.nbytes == tensor.numel() * 4 and len(store) == 1
    with pytest.raises(KeyError, match="block"):
        store.get(2, "block", "k")


def test_fetch_rows_falls_back_to_get() -> None:
    tensor = torch.randn(1, 6, 2)

    class GetOnly:
        def get(self, step: int, block: str, name: str) -> torch.Tensor:
            return tensor

    out = torch.empty(1, 2, 2)
    fetch_rows(GetOnly(), 0, "b", "v", torch.tensor([0, 5]), out)
    assert out.equal(tensor[:, [0, 5]])


def test_noise_composition_takes_the_request_inside_the_mask_only() -> None:
    template = SeedNoise.draw(1, (1, 4, 6, 6), torch.float32)
    request = SeedNoise.draw(2, (1, 4, 6, 6), torch.float32)
    mask = torch.zeros(6, 6, dtype=torch.bool)
    mask[2:4, 1:5] = True
    mixed = template.compose(request, mask)
    for got, own, other in (
        (mixed.latents, request.latents, template.latents),
        (mixed.vae, request.vae, template.vae),
    ):
        assert got[..., mask].equal(own[..., mask])
        assert got[..., ~mask].equal(other[..., ~mask])
    assert SeedNoise.draw(1, (1, 4, 6, 6), torch.float32).latents.equal(template.latents)
    assert not template.latents.equal(template.vae)


def test_halo_grows_the_computed_tokens_around_the_mask() -> None:
    """A halo of h latent pixels adds exactly the ring within h pixels (square window) of
    the mask at the finest level, and the coarser levels pool the grown mask."""
    from retouch.runtime.maskaware.request import token_sets

    mask = torch.zeros(16, 16, dtype=torch.bool)
    mask[5:8, 6:9] = True
    sizes = [(16, 16), (8, 8)]
    plain = token_sets(mask, sizes)
    grown = token_sets(mask, sizes, halo=2)
    assert plain[(16, 16)].count == 9
    assert grown[(16, 16)].count == 7 * 7  # rows 3..9, columns 4..10
    assert grown[(8, 8)].count >= plain[(8, 8)].count
    corner = torch.zeros(16, 16, dtype=torch.bool)
    corner[0, 0] = True
    assert token_sets(corner, sizes, halo=2)[(16, 16)].count == 9  # clipped at the border
