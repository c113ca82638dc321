"""From a latent mask to the token sets sparse blocks compute, and how a batch lays them out.

A request's latent mask (the pipeline's own nearest-downsampled mask) becomes one
:class:`TokenSet` per token grid: UNet levels max-pool it (a token is computed when any
latent pixel under it is masked), Flux max-pools it 2×2 because it packs 2×2 latent pixels
into one token. A :class:`TokenBatch` lays the ragged sets of one batched forward out either
*padded* (``[rows, n_max, C]``, one batched attention call) or *packed* (``[1, T, C]``, no
padding, one attention call per row); both expose the same gather/scatter so the sparse
blocks are written once.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TokenSet:
    """The masked and unmasked token positions of one request on one token grid."""

    masked: torch.Tensor  # int64 [n], ascending, on the host
    unmasked: torch.Tensor  # int64 [N - n], ascending, on the host
    n_tokens: int

    @classmethod
    def from_grid(cls, grid: torch.Tensor) -> TokenSet:
        """Token sets of a boolean ``[H, W]`` grid (row-major token order)."""
        flat = grid.reshape(-1).cpu()
        positions = torch.arange(flat.numel())
        return cls(positions[flat], positions[~flat], flat.numel())

    @property
    def count(self) -> int:
        return int(self.masked.numel())

    @cached_property
    def digest(self) -> tuple[int, bytes]:
        """What identifies the set's content (equal sets give equal layouts, and so may
        share a batch layout and a captured step)."""
        masked = self.masked.numpy().tobytes()
        return (self.n_tokens, hashlib.blake2b(masked, digest_size=16).digest())

    @property
    def ratio(self) -> float:
        return self.count / self.n_tokens


def dilate(latent_mask: torch.Tensor, pixels: int) -> torch.Tensor:
    """A boolean ``[h, w]`` mask grown by ``pixels`` in every direction (a square window)."""
    if pixels <= 0:
        return latent_mask
    window = 2 * pixels + 1
    grown = F.max_pool2d(latent_mask[None, None].float(), window, stride=1, padding=pixels)
    return grown[0, 0] > 0


def pool_mask(latent_mask: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Max-pool a boolean ``[h, w]`` latent mask onto a coarser ``size`` grid.

    UNet downsamplers are stride-2 convolutions with padding 1 (output ``ceil(h / 2)``), so
    the pooling uses ``ceil_mode`` for odd sizes.
    """
    h, w = latent_mask.shape
    if (h, w) == tuple(size):
        return latent_mask.clone()
    kh, kw = math.ceil(h / size[0]), math.ceil(w / size[1])
    pooled = F.max_pool2d(latent_mask[None, None].float(), (kh, kw), ceil_mode=True)[0, 0]
    if tuple(pooled.shape) != tuple(size):
        raise ValueError(f"cannot pool a {h}x{w} mask onto {size}")
    return pooled > 0


def level_sizes(height: int, width: int, levels: int) -> list[tuple[int, int]]:
    """Grid sizes of successive UNet levels (each a stride-2 downsampling)."""
    sizes = [(height, width)]
    for _ in range(levels - 1):
        h, w = sizes[-1]
        sizes.append(((h + 1) // 2, (w + 1) // 2))
    return sizes


@dataclass(frozen=True)
class TokenBatch:
    """The masked tokens of every row of one batched forward on one token grid.

    Model rows come ``rows_per_request`` at a time (the two CFG halves of an SD request share
    one token set). ``flat_index`` lists every masked token as ``row * N + position`` in row
    order: it is the scatter target of the computed rows and the packed order.
    """

    sets: tuple[TokenSet, ...]  # one per request
    rows_per_request: int
    packed: bool
    device: torch.device
    n_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        sizes = {s.n_tokens for s in self.sets}
        if len(sizes) != 1:
            raise ValueError(f"requests in one batch must share the token grid, got {sizes}")
        object.__setattr__(self, "n_tokens", sizes.pop())

    @classmethod
    def everything(
        cls, n_tokens: int, requests: int, rows_per_request: int, device: torch.device
    ) -> TokenBatch:
        """Every token of every request (the packed rows a full block computes); one object
        per shape, so its device index tensors are made once (a captured step refers to
        them and may not copy from the host)."""
        return _everything(n_tokens, requests, rows_per_request, str(device))

    @property
    def rows(self) -> int:
        return len(self.sets) * self.rows_per_request

    @property
    def layout_key(self) -> tuple:
        """What a captured step depends on: the token sets, by content."""
        return ("sets", tuple(s.digest for s in self.sets))

    def dedupe(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows that may be written back: all of them (no slot repeats another; see
        ``maskaware.buckets`` for a layout whose do)."""
        return rows

    @cached_property
    def counts(self) -> tuple[int, ...]:
        return tuple(s.count for s in self.sets for _ in range(self.rows_per_request))

    @cached_property
    def n_max(self) -> int:
        return max(self.counts, default=0)

    @property
    def total(self) -> int:
        return sum(self.counts)

    def row_set(self, row: int) -> TokenSet:
        return self.sets[row // self.rows_per_request]

    @cached_property
    def flat_index(self) -> torch.Tensor:
        parts = [self.row_set(r).masked + r * self.n_tokens for r in range(self.rows)]
        return _cat_long(parts).to(self.device)

    @cached_property
    def positions(self) -> torch.Tensor:
        """Token position of every row of the sparse layout (padding repeats a valid one)."""
        if self.packed:
            parts = [self.row_set(r).masked for r in range(self.rows)]
            return _cat_long(parts).to(self.device)
        return torch.stack([self._padded(self.row_set(r).masked) for r in range(self.rows)]).to(
            self.device
        )

    @cached_property
    def _gather_index(self) -> torch.Tensor:
        if self.packed:
            return self.flat_index
        offsets = torch.arange(self.rows, device=self.device)[:, None] * self.n_tokens
        return (self.positions + offsets).reshape(-1)

    @cached_property
    def unpadded_slots(self) -> torch.Tensor | None:
        """The real token rows among the ``rows * n_max`` of the padded layout (positions
        worked out on the host, so no step waits on the device); ``None``: all are real."""
        if all(count == self.n_max for count in self.counts):
            return None
        parts = [torch.arange(c) + r * self.n_max for r, c in enumerate(self.counts)]
        return _cat_long(parts).to(self.device)

    @cached_property
    def padded_slots(self) -> torch.Tensor:
        """Packed layout: the packed token each slot of ``[rows * n_max]`` padded rows
        reads (a row's padding repeats its last token). A computation per row over the
        packed tokens (``runtime/mixedlora``) lays them out with it and puts its result
        back with :attr:`unpadded_slots`; made once per layout, on the host."""
        counts = torch.tensor(self.counts, dtype=torch.long)
        starts = torch.cumsum(counts, 0) - counts
        offsets = torch.minimum(
            torch.arange(self.n_max)[None, :], (counts - 1).clamp(min=0)[:, None]
        )
        slots = (starts[:, None] + offsets).clamp(0, max(int(counts.sum()) - 1, 0))
        return slots.reshape(-1).to(self.device)

    def _padded(self, masked: torch.Tensor) -> torch.Tensor:
        pad = masked[-1:] if masked.numel() else torch.zeros(1, dtype=torch.long)
        return torch.cat([masked, pad.expand(self.n_max - masked.numel())])

    def gather(self, full: torch.Tensor) -> torch.Tensor:
        """``[rows, N, C]`` → the sparse layout (``[rows, n_max, C]`` or ``[1, T, C]``)."""
        channels = full.shape[-1]
        picked = full.reshape(-1, channels).index_select(0, self._gather_index)
        if self.packed:
            return picked.unsqueeze(0)
        return picked.view(self.rows, self.n_max, channels)

    def gather_map(self, feature_map: torch.Tensor) -> torch.Tensor:
        """``[rows, C, H, W]`` → the sparse layout, like :meth:`gather` of its tokens. When
        every row shares one token set (one request) the masked columns are picked straight
        from the channels-first map: only the picked rows are ever copied."""
        return gather_feature_map(self, feature_map)

    def real_rows(self, sparse: torch.Tensor, channel_dims: int = 1) -> torch.Tensor:
        """The sparse layout's real token rows, ``[T, C]`` in ``flat_index`` order; the
        last ``channel_dims`` dimensions make a row's channels (2: ``[..., heads, dim]``)."""
        channels = math.prod(sparse.shape[-channel_dims:])
        flat = sparse.reshape(-1, channels)
        if self.packed or self.unpadded_slots is None:
            return flat
        return flat.index_select(0, self.unpadded_slots)

    def scatter(self, sparse: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """Write the real rows of ``sparse`` into a contiguous ``[rows, N, C]`` ``full``."""
        return self.scatter_rows(self.real_rows(sparse), full)

    def scatter_rows(self, rows: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """Write ``[T, C]`` token rows (``flat_index`` order) into a contiguous ``full``."""
        full.view(-1, full.shape[-1]).index_copy_(0, self.flat_index, rows)
        return full

    def masked_index(self, request: int) -> torch.Tensor:
        """A request's masked positions on the model's device (where its fresh rows go)."""
        memo = self.__dict__.setdefault("_masked_on_device", {})
        if request not in memo:
            memo[request] = self.sets[request].masked.to(self.device)
        return memo[request]

    def unmasked_index(self, request: int) -> torch.Tensor:
        """A request's unmasked positions on the model's device (scatter target of cached rows)."""
        memo = self.__dict__.setdefault("_unmasked_on_device", {})
        if request not in memo:
            memo[request] = self.sets[request].unmasked.to(self.device)
        return memo[request]

    def joint_index(self, text_len: int) -> torch.Tensor:
        """:attr:`flat_index` in a ``[rows, text_len + N, C]`` buffer whose rows start with
        ``text_len`` text tokens (joint attention's keys): where the masked rows go."""
        memo = self.__dict__.setdefault("_joint_index", {})
        if text_len not in memo:
            flat = self.flat_index
            memo[text_len] = flat + (flat // self.n_tokens + 1) * text_len
        return memo[text_len]

    @cached_property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """Packed layout: ``(start, count)`` of every row in the packed sequence."""
        starts = itertools.accumulate(self.counts, initial=0)
        return tuple(zip(starts, self.counts, strict=False))

    @cached_property
    def row_of_token(self) -> torch.Tensor:
        """Packed layout: the model row of every packed token (to expand per-row tensors)."""
        counts = torch.tensor(self.counts, device=self.device)
        return torch.repeat_interleave(torch.arange(self.rows, device=self.device), counts)


def gather_feature_map(batch: TokenBatch, feature_map: torch.Tensor) -> torch.Tensor:
    """``batch.gather_map``, for any layout with ``sets``, ``gather``, ``masked_index``,
    ``positions``, ``row_of_token`` and ``packed`` (the exact and the bucketed ones). The
    whole map is never transposed into a copy: one request picks its columns from the
    channels-first map, several packed ones index (row, column) pairs."""
    channels_first = feature_map.flatten(2)
    if len(batch.sets) != 1:
        if batch.packed:  # each token's (model row, column): one index, the picked copied
            return channels_first[batch.row_of_token, :, batch.positions].unsqueeze(0)
        return batch.gather(channels_first.transpose(1, 2))
    picked = channels_first.index_select(2, batch.masked_index(0)).transpose(1, 2)
    return picked.reshape(1, -1, picked.shape[-1]) if batch.packed else picked


def _cat_long(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@functools.lru_cache(maxsize=32)
def _everything(n_tokens: int, requests: int, rows_per_request: int, device: str) -> TokenBatch:
    whole = TokenSet(torch.arange(n_tokens), torch.zeros(0, dtype=torch.long), n_tokens)
    return TokenBatch((whole,) * requests, rows_per_request, True, torch.device(device))
