"""The cost model: per-block latencies as linear functions of tokens, loads of bytes.

Profiled on the executor's own device (FlashPS fits the same shapes, R² = 0.99) and used
twice: by the plan (which blocks run sparse this step) and, through the executor's state,
by placement (predicted completion of a batch plus a newcomer).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from retouch.runtime.plan import BlockCost


@dataclass(frozen=True)
class LinearFit:
    """``y = intercept + slope * x`` with its coefficient of determination."""

    intercept: float
    slope: float
    r2: float

    def __call__(self, x: float) -> float:
        return max(0.0, self.intercept + self.slope * x)

    @classmethod
    def fit(cls, xs: list[float], ys: list[float]) -> LinearFit:
        x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
        if len(x) < 2 or np.ptp(x) == 0:
            return cls(float(y.mean()) if len(y) else 0.0, 0.0, 1.0)
        slope, intercept = np.polyfit(x, y, 1)
        residual = float(((y - (intercept + slope * x)) ** 2).sum())
        total = float(((y - y.mean()) ** 2).sum())
        return cls(float(intercept), float(slope), 1.0 - residual / total if total > 0 else 1.0)

    @classmethod
    def fit_theil_sen(cls, xs: list[float], ys: list[float]) -> LinearFit:
        """The median of the pairwise slopes and the median residual (``r2`` not computed:
        1): a line that a few samples slowed by other work on the device do not pull, where
        least squares did (an engine's step fit on 2 shared cores: an intercept of 473 ms
        from 9 steps, for steps that take ~190 ms)."""
        x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
        i, j = np.triu_indices(len(x), k=1)
        dx = x[j] - x[i]
        apart = np.abs(dx) > 0.01 * np.abs(x).mean()  # pairs at one x tell no slope
        if not apart.any():
            return cls(float(np.median(y)) if len(y) else 0.0, 0.0, 1.0)
        slope = float(np.median((y[j] - y[i])[apart] / dx[apart]))
        return cls(float(np.median(y - slope * x)), slope, 1.0)

    @classmethod
    def fit_medians(cls, xs: list[float], ys: list[float]) -> LinearFit:
        """:meth:`fit` on the median ``y`` of each distinct ``x``: repeated measurements of
        one configuration count once, and a sample slowed by another process does not pull
        the line (timings on a shared machine)."""
        groups: dict[float, list[float]] = {}
        for x, y in zip(xs, ys, strict=True):
            groups.setdefault(float(x), []).append(float(y))
        keys = sorted(groups)
        return cls.fit(keys, [float(np.median(groups[k])) for k in keys])


@dataclass(frozen=True)
class BlockProfile:
    """One block: compute time against the tokens it processes, for the whole batch.

    ``bytes_per_token_sparse`` is what a sparse block loads per *unmasked* token (K and V,
    plus Y where the family reads Y inside a sparse block); ``bytes_per_token_exit`` is its
    Y per unmasked token, loaded when the next block runs full. Both count every model
    row of a request (the two CFG halves of SD).
    """

    name: str
    compute: LinearFit
    bytes_per_token_sparse: int
    bytes_per_token_exit: int
    level: int = 0  # the block's token grid: 0 the finest of a request, 1 the next...


@dataclass(frozen=True)
class CostModel:
    device: str
    blocks: list[BlockProfile]
    load: LinearFit  # seconds against bytes copied into the compute device's buffers
    extra: dict[str, Any] = field(default_factory=dict)

    def block_costs(self, tokens: list[tuple[int, ...]]) -> list[BlockCost]:
        """Costs of every block for one step of a batch: ``tokens[i]`` is block *i*'s
        (masked, total) token count summed over the batch (UNet levels differ per block),
        optionally with the unmasked tokens whose rows are loaded (default: all of them;
        fewer when some templates are resident on the device)."""
        return [self._cost(b, *t) for b, t in zip(self.blocks, tokens, strict=True)]

    def _cost(
        self, block: BlockProfile, masked: int, total: int, streamed: int | None = None
    ) -> BlockCost:
        unmasked = total - masked if streamed is None else streamed
        return BlockCost(
            sparse=block.compute(masked),
            full=block.compute(total),
            load_sparse=self.load(unmasked * block.bytes_per_token_sparse) if unmasked else 0.0,
            load_exit=self.load(unmasked * block.bytes_per_token_exit)
            if unmasked and block.bytes_per_token_exit
            else 0.0,
        )

    def min_r2(self) -> float:
        return min([self.load.r2, *(b.compute.r2 for b in self.blocks)])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> CostModel:
        blocks = [
            BlockProfile(
                b["name"],
                LinearFit(**b["compute"]),
                b["bytes_per_token_sparse"],
                b["bytes_per_token_exit"],
                b.get("level", 0),
            )
            for b in doc["blocks"]
        ]
        return cls(doc["device"], blocks, LinearFit(**doc["load"]), doc.get("extra", {}))
