"""The token layouts of an editor's steps, kept for re-use: exact (one per set of masks)
or bucketed (every request's masked tokens padded up to a bucket, so that a step's shapes
follow the bucket, not the mask, and one captured CUDA graph serves every mask of it).

A layout's device index tensors are made once; a captured step refers to them, so the
same layout object must serve every step of its shape.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from retouch.runtime.maskaware.buckets import BucketBatch, Buckets
from retouch.runtime.maskaware.request import RequestState
from retouch.runtime.maskaware.tokens import TokenBatch, TokenSet

LAYOUTS = 16  # token batches kept for re-use (one per recent set of masks)
BUCKET_LAYOUTS = 256  # bucketed batches kept (one per grid, batch size, bucket, layout)


class StepLayouts:
    """One editor's step layouts on its device, and the padding its buckets cost."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buckets: Buckets | None = None
        self.padded_tokens = 0  # pad slots computed by bucketed steps, all told
        self._exact: OrderedDict[tuple, TokenBatch] = OrderedDict()
        self._bucketed: OrderedDict[tuple, BucketBatch] = OrderedDict()

    def set_buckets(self, buckets: Buckets | None) -> None:
        """Bucket later steps by ``buckets`` (``None``: exact layouts)."""
        self.buckets = buckets
        self._bucketed.clear()

    def padded_batch(self, states: list[RequestState]) -> list[RequestState]:
        """The batch as it runs: with batch-size buckets, padded up to one by repeating its
        last request (read-only in the forward; its copy's prediction is dropped and only
        the real requests advance), so a batch of 3 replays the graph of 4."""
        if self.buckets is None:
            return states
        return states + [states[-1]] * (self.buckets.batch_size(len(states)) - len(states))

    def grids(
        self, sets: dict[tuple[int, int], tuple[TokenSet, ...]], per: int, packed: bool
    ) -> dict[tuple[int, int], TokenBatch | BucketBatch]:
        """The step's token layout on every grid (``per`` model rows per request):
        bucketed when buckets are declared and every request has a masked token on every
        grid (a pad repeats one), else exact."""
        padding = None if self.buckets is None else self.buckets.padding(sets.values())
        if padding is None:
            return {size: self._layout(group, per, packed) for size, group in sets.items()}
        grids = {}
        for size, group in sets.items():
            n_tokens = group[0].n_tokens
            batch = self._bucket_batch(size, n_tokens, len(group), padding[n_tokens], per, packed)
            grids[size] = batch.fill(group)
            self.padded_tokens += batch.padded_tokens
        return grids

    def _bucket_batch(
        self,
        size: tuple[int, int],
        n_tokens: int,
        requests: int,
        bucket: int,
        per: int,
        packed: bool,
    ) -> BucketBatch:
        """The one bucketed batch of this shape, refilled every step it serves (a graph
        captured with it replays with its buffers)."""
        key = (size, requests, per, packed, bucket)
        batch = self._bucketed.get(key)
        if batch is None:
            batch = BucketBatch(n_tokens, requests, per, bucket, packed, self.device)
            self._bucketed[key] = batch
            while len(self._bucketed) > BUCKET_LAYOUTS:
                self._bucketed.popitem(last=False)
        self._bucketed.move_to_end(key)
        return batch

    def _layout(self, sets: tuple[TokenSet, ...], per: int, packed: bool) -> TokenBatch:
        """The token batch of these sets, re-used while the batch's masks stay the same (its
        device index tensors are made once, and a captured step can refer to them)."""
        key = (tuple(s.digest for s in sets), per, packed)
        batch = self._exact.get(key)
        if batch is None:
            batch = TokenBatch(sets, per, packed, self.device)
            self._exact[key] = batch
            while len(self._exact) > LAYOUTS:
                self._exact.popitem(last=False)
        self._exact.move_to_end(key)
        return batch
