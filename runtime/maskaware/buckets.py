"""Token layouts whose shapes do not depend on the mask: masked tokens padded to a bucket.

A :class:`~retouch.runtime.maskaware.tokens.TokenBatch` has the shapes of its masks (each
row's masked-token count), so a CUDA graph captured for it serves only those masks, and in
served traffic every edit brings its own. A :class:`BucketBatch` pads every row's masked
tokens up to one *bucket* size and holds the token indices as *data* in device buffers it
refills for each step's masks: one graph per (grid, requests, bucket) then serves every mask
that fits the bucket.

Padding must not change the real tokens' values. A pad slot repeats its row's last masked
token: it computes what that token computes (its own query against the row's keys; every
other op is token-wise), and before anything is written back, each pad slot's rows are
replaced by its real token's rows (:meth:`BucketBatch.dedupe`), so the duplicate writes of
a scatter carry identical bits whatever order the device writes them in. Pad slots never
become keys of another token. Duplicates cost compute the mask does not need; they need no
attention mask and no extra buffer row, and every sparse block stays as written for the
exact layout.

:class:`Buckets` chooses the sizes: fractions of a grid's tokens, rounded up to a multiple
(tensor-core tiles on a GPU). A batch takes one bucket *level* for all its grids (UNet
levels pool the mask coarser, so their ratios are higher; each grid takes its own size of
the level): layouts are then at most ``levels × batch sizes`` per resolution (and the
stock steps' one per batch size).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from retouch.runtime.maskaware.tokens import TokenSet, gather_feature_map

DEFAULT_FRACTIONS = (0.125, 0.25, 0.375, 0.5, 0.75, 1.0)
DEFAULT_MULTIPLE = 8


@dataclass(frozen=True)
class Buckets:
    """Bucket sizes per token grid: ``ceil(fraction × n_tokens)`` rounded up to ``multiple``
    (at most ``n_tokens``), one level per fraction, ascending."""

    fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    multiple: int = DEFAULT_MULTIPLE
    # Batch sizes a step is padded up to (its last request repeated, the copy's output
    # dropped); empty: every batch size is its own.
    batch_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.fractions or list(self.fractions) != sorted(self.fractions):
            raise ValueError(f"bucket fractions must be ascending, got {self.fractions}")
        if not all(0 < f <= 1 for f in self.fractions) or self.fractions[-1] != 1.0:
            raise ValueError(f"bucket fractions must be in (0, 1] and end at 1: {self.fractions}")
        if self.multiple < 1:
            raise ValueError(f"bucket multiple must be >= 1, not {self.multiple}")
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or any(
            b < 1 for b in self.batch_sizes
        ):
            raise ValueError(f"batch sizes must be ascending and >= 1, got {self.batch_sizes}")

    @classmethod
    def for_batches(cls, max_batch: int) -> Buckets:
        """The default sizes, and batch sizes 1, 2, 4, ... below ``max_batch``, and it: a
        batch of 3 replays the graph of 4 instead of capturing its own."""
        sizes = [b for b in (2**i for i in range(max_batch.bit_length())) if b < max_batch]
        return cls(batch_sizes=(*sizes, max_batch))

    @property
    def levels(self) -> int:
        return len(self.fractions)

    def batch_size(self, requests: int) -> int:
        """The batch size ``requests`` are run at (padded up; beyond the sizes: as many)."""
        return next((b for b in self.batch_sizes if b >= requests), requests)

    def sizes(self, n_tokens: int) -> tuple[int, ...]:
        """The bucket size of every level on a grid of ``n_tokens``."""
        return tuple(
            min(n_tokens, _round_up(max(1, math.ceil(f * n_tokens)), self.multiple))
            for f in self.fractions
        )

    def level(self, counts: Mapping[int, int]) -> int:
        """The smallest level whose size holds ``counts`` (grid size → the most masked
        tokens of any row on it) on every grid."""
        for level in range(self.levels):
            if all(self.sizes(n)[level] >= count for n, count in counts.items()):
                return level
        raise ValueError(f"masked counts {dict(counts)} exceed their grids")

    def padding(self, groups: Iterable[Sequence[TokenSet]]) -> dict[int, int] | None:
        """The bucket every row of a step is padded to, per grid (``n_tokens`` → size):
        one level for the batch, the smallest that holds every row on every grid. None
        when a row has no masked token on some grid (nothing to repeat: exact layout).
        The editor lays the step out with it and the planner costs what it computes."""
        counts: dict[int, int] = {}
        for group in groups:
            if not BucketBatch.fits(group):
                return None
            n = group[0].n_tokens
            counts[n] = max(counts.get(n, 0), *(s.count for s in group))
        level = self.level(counts)
        return {n: self.sizes(n)[level] for n in counts}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


_SERIAL = itertools.count(1)


class BucketBatch:
    """The masked tokens of one batched forward on one token grid, every row padded to
    ``bucket`` slots, with the same gather/scatter interface as ``TokenBatch``.

    One object per (grid, requests, rows per request, bucket, layout) is refilled for every
    step (:meth:`fill`): its device index tensors keep their addresses, so a step captured
    with them replays correctly for any masks that fit the bucket.
    """

    def __init__(
        self,
        n_tokens: int,
        requests: int,
        rows_per_request: int,
        bucket: int,
        packed: bool,
        device: torch.device,
    ) -> None:
        if not 0 < bucket <= n_tokens:
            raise ValueError(f"bucket {bucket} must be in (0, {n_tokens}]")
        self.n_tokens, self.bucket, self.packed = n_tokens, bucket, packed
        self.rows_per_request, self.device = rows_per_request, device
        self.serial = next(_SERIAL)  # a graph captured with this object replays only with it
        self.sets: tuple[TokenSet, ...] = ()
        self._filled: tuple = ()  # the digests of the sets the buffers hold
        self._requests = requests
        rows = requests * rows_per_request
        self._slots = torch.zeros(rows, bucket, dtype=torch.long, device=device)  # positions
        self._gather = torch.zeros(rows * bucket, dtype=torch.long, device=device)
        self._source = torch.zeros(rows * bucket, dtype=torch.long, device=device)
        self._joint: dict[int, torch.Tensor] = {}
        # each request's slot positions: views of the buffer, made once (refills show)
        self._masked = [self._slots[r * rows_per_request] for r in range(requests)]
        # fixed by the shape: read by every sparse block, made once
        self._counts = (bucket,) * rows
        self._segments = tuple((row * bucket, bucket) for row in range(rows))
        self._unmasked: dict[int, torch.Tensor] = {}
        self.padded_tokens = 0  # pad slots of the last fill (a figure for /metrics)

    @staticmethod
    def fits(sets: Sequence[TokenSet]) -> bool:
        """Whether every set has a masked token to repeat (an empty one has none)."""
        return all(s.count > 0 for s in sets)

    def fill(self, sets: Sequence[TokenSet]) -> BucketBatch:
        """Lay out ``sets`` (one per request) in the buffers; their counts must fit. The
        sets of the step before (a batch keeps its masks between joins and leaves) are
        there already: nothing is copied."""
        digests = tuple(s.digest for s in sets)
        if digests == self._filled:
            self.sets = tuple(sets)
            return self
        if len(sets) != self._requests:
            raise ValueError(f"{len(sets)} token sets for a batch of {self._requests}")
        if any(s.n_tokens != self.n_tokens for s in sets):
            raise ValueError(f"token sets of another grid than {self.n_tokens} tokens")
        if not self.fits(sets) or max(s.count for s in sets) > self.bucket:
            raise ValueError(f"counts {[s.count for s in sets]} do not fit bucket {self.bucket}")
        per, bucket = self.rows_per_request, self.bucket
        slots, source = [], []
        for row in range(len(sets) * per):
            masked = sets[row // per].masked
            count = masked.numel()
            slots.append(torch.cat([masked, masked[-1:].expand(bucket - count)]))
            real = torch.arange(bucket).clamp_(max=count - 1)
            source.append(real + row * bucket)
        slots_host = torch.stack(slots)
        offsets = torch.arange(slots_host.shape[0])[:, None] * self.n_tokens
        self._slots.copy_(slots_host)
        self._gather.copy_((slots_host + offsets).reshape(-1))
        self._source.copy_(torch.cat(source))
        for text_len, index in self._joint.items():
            index.copy_(self._joint_of(text_len))
        self._unmasked.clear()
        self.sets, self._filled = tuple(sets), digests
        self.padded_tokens = sum(bucket - s.count for s in sets) * per
        return self

    # -- the TokenBatch interface ---------------------------------------------------------

    @property
    def layout_key(self) -> tuple:
        """What a captured step depends on: this object's buffers, not the masks."""
        return ("bucket", self.serial, self.bucket)

    @property
    def rows(self) -> int:
        return self._slots.shape[0]

    @property
    def counts(self) -> tuple[int, ...]:
        return self._counts

    @property
    def n_max(self) -> int:
        return self.bucket

    @property
    def total(self) -> int:
        return self.rows * self.bucket

    def row_set(self, row: int) -> TokenSet:
        return self.sets[row // self.rows_per_request]

    @property
    def flat_index(self) -> torch.Tensor:
        """Every slot as ``row * N + position`` (pad slots repeat their real token)."""
        return self._gather

    @property
    def positions(self) -> torch.Tensor:
        """Token position of every slot: ``[rows * bucket]`` packed, ``[rows, bucket]``
        padded."""
        return self._slots.view(-1) if self.packed else self._slots

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        return self._segments

    @property
    def row_of_token(self) -> torch.Tensor:
        memo = self.__dict__.get("_row_of_token")
        if memo is None:
            rows = torch.arange(self.rows, device=self.device)
            memo = self.__dict__["_row_of_token"] = rows.repeat_interleave(self.bucket)
        return memo

    def dedupe(self, rows: torch.Tensor) -> torch.Tensor:
        """``[rows * bucket, C]`` slot rows with each pad slot's replaced by its real
        token's: what may be written back (duplicate writes then carry equal bits)."""
        return rows.index_select(0, self._source)

    def gather(self, full: torch.Tensor) -> torch.Tensor:
        """``[rows, N, C]`` → ``[rows, bucket, C]`` (padded) or ``[1, rows * bucket, C]``."""
        channels = full.shape[-1]
        picked = full.reshape(-1, channels).index_select(0, self._gather)
        if self.packed:
            return picked.unsqueeze(0)
        return picked.view(self.rows, self.bucket, channels)

    def gather_map(self, feature_map: torch.Tensor) -> torch.Tensor:
        """``[rows, C, H, W]`` → the sparse layout (as ``TokenBatch.gather_map``)."""
        return gather_feature_map(self, feature_map)

    def real_rows(self, sparse: torch.Tensor, channel_dims: int = 1) -> torch.Tensor:
        """Every slot's row, ``[rows * bucket, C]`` (pad slots included: the scatter
        :meth:`dedupe`-s them)."""
        channels = math.prod(sparse.shape[-channel_dims:])
        return sparse.reshape(-1, channels)

    def scatter(self, sparse: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        return self.scatter_rows(self.real_rows(sparse), full)

    def scatter_rows(self, rows: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """Write the slots' rows into a contiguous ``[rows, N, C]`` ``full``."""
        full.view(-1, full.shape[-1]).index_copy_(0, self._gather, self.dedupe(rows))
        return full

    def masked_index(self, request: int) -> torch.Tensor:
        """A request's slot positions on the device (pads repeat a masked position)."""
        return self._masked[request]

    def unmasked_index(self, request: int) -> torch.Tensor:
        """A request's unmasked positions on the device (the eager host-row path only: its
        size is the mask's)."""
        if request not in self._unmasked:
            self._unmasked[request] = self.sets[request].unmasked.to(self.device)
        return self._unmasked[request]

    def joint_index(self, text_len: int) -> torch.Tensor:
        """:attr:`flat_index` in a ``[rows, text_len + N, C]`` buffer (text rows first)."""
        if text_len not in self._joint:
            self._joint[text_len] = self._joint_of(text_len)
        return self._joint[text_len]

    def _joint_of(self, text_len: int) -> torch.Tensor:
        flat = self._gather
        return flat + (flat // self.n_tokens + 1) * text_len
