"""Workloads: when invocations arrive, how much of its image each one masks, and which
template each one edits.

One definition per name, whoever draws it: the pool simulator (``bench sim``), the load
generator that drives a real pool (``bench load``, ``bench validate``) and the placement
bench's synthetic pool. A seed's workload is drawn in a fixed order (:class:`Draws`), so two
users of the same names and seed get the same draws, and the simulator and a real pool are
compared on the same workload.

Mask mixes (:class:`MaskMix`):

* ``beta``: a Beta distribution with the given mean and concentration
  ``BETA_CONCENTRATION`` (at mean 0.19: Beta(1.9, 8.1), most masks between 0.05 and 0.4),
  clipped to ``[MIN_RATIO, 1]``;
* ``bimodal``: ``BIMODAL``, 0.05 or 0.6 half each (small touch-ups and large replacements:
  where an invocation's cost varies most);
* ratios read from a file, one a line, drawn with replacement (instead of the Beta).

Arrivals (:func:`arrival_times`) at a mean rate: ``poisson``, ``gamma:CV`` (a renewal
process with inter-arrival coefficient of variation CV), ``step:F@T`` (Poisson whose rate
is F x from T s on) and ``diurnal:P:A[:CV]`` (rate x (1 + A sin(2 pi t / P)), Poisson or
Gamma with that CV); or a CSV trace (:func:`read_trace`).

Templates: Zipf popularity, rank ``k`` (from 1) drawn in proportion to ``k ** -zipf``. The
adapter sets of functions on one shared base model (each function a LoRA of its own) are
drawn the same way, from a stream of their own.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retouch.functions.knobs import (
    existing_file,
    knob,
    mask_ratio,
    non_negative_int,
    positive_float,
    positive_int,
)

MASK_MIXES = ("beta", "bimodal")
BIMODAL = (0.05, 0.6)  # the two mask ratios of the bimodal mix, drawn equally often
# The Beta's a + b. At mean 0.19 its standard deviation is 0.12: ratios vary widely, and
# few masks are near-empty (a concentration of 4 puts a fifth of them under 0.02).
BETA_CONCENTRATION = 10.0
MIN_RATIO = 0.01  # an empty mask never reaches the model: it is not load
DEFAULT_TEMPLATE = "t"  # a trace row's template when it names none
TEMPLATE_STREAM = 13  # the templates' stream: seed + this (see Draws)
ADAPTER_STREAM = 17  # the adapter sets' stream: seed + this
ARRIVALS_HELP = "poisson, gamma:CV (CV > 0), step:F@T, diurnal:P:A or trace:FILE"


@dataclass(frozen=True)
class MaskMix:
    """A named distribution of mask ratios: ``kind`` of ``MASK_MIXES``, the Beta's
    ``mean``, or ``values`` to draw from (read from a file; they replace the Beta)."""

    kind: str = "beta"
    mean: float = 0.19
    values: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in MASK_MIXES:
            raise ValueError(f"masks must be beta or bimodal, not {self.kind!r}")
        if self.kind == "beta" and not self.values and not 0 < self.mean < 1:
            raise ValueError(f"the mask mean must be in (0, 1), not {self.mean}")
        if self.values and not all(0 <= v <= 1 for v in self.values):
            raise ValueError("mask ratios must be in [0, 1]")

    @property
    def expected(self) -> float:
        """The mean ratio this mix draws (a standalone invocation's, the SLO's unit)."""
        if self.kind == "bimodal":
            return sum(BIMODAL) / len(BIMODAL)
        return float(np.mean(self.values)) if self.values else self.mean

    @property
    def label(self) -> str:
        """How reports name it: ``bimodal``, ``beta:MEAN`` or ``file``."""
        if self.kind == "bimodal":
            return "bimodal"
        return "file" if self.values else f"beta:{self.mean}"

    def draw(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """``count`` mask ratios."""
        if self.kind == "bimodal":
            return np.where(rng.random(count) < 0.5, *BIMODAL)
        if self.values:
            return rng.choice(np.array(self.values), count)
        a, b = self.mean * BETA_CONCENTRATION, (1 - self.mean) * BETA_CONCENTRATION
        return np.clip(rng.beta(a, b, count), MIN_RATIO, 1.0)


def read_ratios(path: Path) -> tuple[float, ...]:
    """Mask ratios in [0, 1], one a line (whitespace-separated)."""
    try:
        values = tuple(float(v) for v in path.read_text().split())
    except ValueError:
        values = (-1.0,)
    if not values or min(values) < 0 or max(values) > 1:
        raise ValueError(f"{path}: expected ratios in [0, 1], one per line")
    return values


@dataclass(frozen=True)
class Workload:
    """The workload a load generator sends to a real pool (``bench load``, ``bench
    validate``): how many invocations, their arrivals, masks and templates, and the seed.
    Its knobs are those commands' flags."""

    requests: int = knob(60, "measured invocations per run", env=False, parse=positive_int)
    warmup: int = knob(
        4, "invocations sent first and left out of the figures", env=False, parse=non_negative_int
    )
    arrivals: str = knob(
        "poisson", "inter-arrival distribution", env=False, choices=("poisson", "gamma")
    )
    cv: float = knob(
        1.0, "coefficient of variation of gamma inter-arrivals", env=False, parse=positive_float
    )
    mask_mean: float = knob(
        0.19,
        "beta mean: 0.11 (production), 0.19 (public), 0.35 (VITON-HD)",
        env=False,
        parse=mask_ratio,
    )
    mask_file: Path | None = knob(
        None, "mask ratios, one per line (instead of the beta)", env=False, parse=existing_file
    )
    zipf: float = knob(1.1, "Zipf exponent of template popularity", env=False, parse=positive_float)
    seed: int = knob(0, "seed of arrivals and masks", env=False, parse=non_negative_int)
    masks: str = knob(
        "beta",
        "mask ratios: a beta with --mask-mean, or bimodal (0.05 and 0.6, half each)",
        env=False,
        choices=MASK_MIXES,
    )

    @property
    def mix(self) -> MaskMix:
        """Its masks (a file's ratios replace the Beta)."""
        values = () if self.mask_file is None else read_ratios(self.mask_file)
        return MaskMix(self.masks, self.mask_mean, values if self.masks == "beta" else ())

    @property
    def process(self) -> str:
        """Its arrivals as :func:`arrival_times` names them."""
        return self.arrivals if self.arrivals == "poisson" else f"{self.arrivals}:{self.cv}"


class Draws:
    """The random streams of one seed's workload, drawn in a fixed order: the masks, then
    the arrival times, from one stream (``rng``, which a caller may go on drawing from);
    the templates and the adapter sets from streams of their own (``seed +
    TEMPLATE_STREAM``, ``seed + ADAPTER_STREAM``), so a seed's masks and arrivals stay the
    same whatever the templates and adapters."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def masks(self, mix: MaskMix, count: int) -> np.ndarray:
        return mix.draw(count, self.rng)

    def arrivals(self, arrivals: str, count: int, rate: float) -> np.ndarray:
        return arrival_times(arrivals, count, rate, self.rng)

    def templates(self, count: int, templates: int, zipf: float) -> np.ndarray:
        """Each arrival's template rank (0 the most popular) of ``templates``."""
        return zipf_ranks(
            count, templates, zipf, np.random.default_rng(self.seed + TEMPLATE_STREAM)
        )

    def adapters(self, count: int, adapters: int, zipf: float) -> np.ndarray:
        """Each arrival's adapter set rank (0 the most popular) of ``adapters``."""
        return zipf_ranks(count, adapters, zipf, np.random.default_rng(self.seed + ADAPTER_STREAM))


def zipf_ranks(count: int, items: int, zipf: float, rng: np.random.Generator) -> np.ndarray:
    """``count`` ranks in ``[0, items)``, rank ``k`` drawn in proportion to ``(k + 1) ** -zipf``."""
    if items < 1:
        raise ValueError(f"need at least 1 item to draw from, not {items}")
    weights = np.arange(1, items + 1, dtype=float) ** -zipf
    return rng.choice(items, size=count, p=weights / weights.sum())


# ---- arrivals -------------------------------------------------------------------------------
def step_change(arrivals: str) -> tuple[float, float] | None:
    """``(factor, at_s)`` of ``step:F@T`` arrivals, else None."""
    kind, _, args = arrivals.partition(":")
    if kind != "step":
        return None
    factor, _, at = args.partition("@")
    try:
        f, t = float(factor), float(at)
    except ValueError:
        f, t = 0.0, -1.0
    if not (f > 0 and t >= 0):
        raise ValueError(f"step arrivals are step:FACTOR@SECONDS, not {arrivals!r}")
    return f, t


def arrival_times(arrivals: str, count: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """``count`` arrival times from 0 at mean rate ``rate`` (the base rate of a step or a
    diurnal cycle): a Poisson process whose rate changes over time is drawn by thinning."""
    kind, _, args = arrivals.partition(":")
    if kind == "step":
        factor, at = step_change(arrivals) or (1.0, 0.0)
        return _thinned(rng, count, rate * max(1.0, factor),
                        lambda t: rate * (factor if t >= at else 1.0))  # fmt: skip
    if kind == "diurnal":
        period, amplitude, cv = _diurnal(args)
        if cv is not None:
            return _modulated_gamma(rng, count, rate, period, amplitude, cv)
        return _thinned(
            rng,
            count,
            rate * (1 + amplitude),
            lambda t: rate * (1 + amplitude * math.sin(2 * math.pi * t / period)),
        )
    return np.cumsum(gaps(arrivals, count, rate, rng))


def _diurnal(args: str) -> tuple[float, float, float | None]:
    """``P:A[:CV]`` of ``diurnal:P:A[:CV]``: period, amplitude and the CV (None: Poisson)."""
    try:
        period, amplitude, *rest = (float(v) for v in args.split(":"))
        if len(rest) > 1:
            raise ValueError
    except ValueError:
        period, amplitude, rest = 0.0, -1.0, []
    cv = rest[0] if rest else None
    if not (period > 0 and 0 <= amplitude < 1 and (cv is None or cv > 0)):
        raise ValueError(
            f"diurnal arrivals are diurnal:PERIOD_S:AMPLITUDE (< 1)[:CV], not {args!r}"
        )
    return period, amplitude, cv


def gaps(arrivals: str, count: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """``count`` inter-arrival gaps with mean ``1/rate``: exponential (``poisson``), or
    Gamma with a coefficient of variation (``gamma:CV``)."""
    if arrivals == "poisson":
        return rng.exponential(1.0 / rate, count)
    kind, _, cv_text = arrivals.partition(":")
    try:
        cv = float(cv_text)
    except ValueError:
        cv = 0.0
    if kind != "gamma" or not cv > 0:
        raise ValueError(f"arrivals must be {ARRIVALS_HELP}, not {arrivals!r}")
    shape = 1.0 / (cv * cv)
    return rng.gamma(shape, 1.0 / (rate * shape), count)


def _modulated_gamma(
    rng: np.random.Generator, count: int, rate: float, period: float, amplitude: float, cv: float
) -> np.ndarray:
    """A bursty diurnal stream: a Gamma renewal process (inter-arrival CV ``cv``) whose rate
    follows ``rate (1 + amplitude sin(2 pi t / period))``, by time rescaling: unit-rate
    arrivals in operational time ``u`` are mapped through the inverse of the cumulative
    rate ``Lambda(t)``."""
    shape = 1.0 / (cv * cv)
    u = np.cumsum(rng.gamma(shape, 1.0 / shape, count))
    horizon = u[-1] / (rate * (1 - amplitude)) + period  # Lambda(horizon) > u[-1]
    t = np.linspace(0.0, horizon, max(2, int(horizon / 0.01)))
    w = 2 * math.pi / period
    cumulative = rate * (t + amplitude / w * (1 - np.cos(w * t)))
    return np.interp(u, cumulative, t)


def _thinned(
    rng: np.random.Generator, count: int, peak: float, rate_at: Callable[[float], float]
) -> np.ndarray:
    """Lewis-Shedler thinning: candidates at the ``peak`` rate, each kept with probability
    rate(t) / peak."""
    times: list[float] = []
    t = 0.0
    while len(times) < count:
        t += float(rng.exponential(1.0 / peak))
        if rng.random() * peak <= rate_at(t):
            times.append(t)
    return np.array(times)


# ---- traces ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trace:
    """A replayed arrival trace: sorted arrival times, and mask ratios and templates where
    it has them."""

    arrival_s: np.ndarray
    mask_ratio: np.ndarray | None = None
    templates: list[str] | None = None

    @property
    def rate(self) -> float:
        """Mean arrivals per second over the trace's span."""
        span = float(self.arrival_s[-1] - self.arrival_s[0])
        return (len(self.arrival_s) - 1) / span if span > 0 else math.inf


def trace_path(arrivals: str) -> Path | None:
    """The file of ``trace:FILE`` arrivals, else None."""
    return Path(arrivals[len("trace:") :]) if arrivals.startswith("trace:") else None


def read_trace(path: Path) -> Trace:
    """A CSV whose header has ``arrival_s`` (seconds from the start, sorted) and optionally
    ``mask_ratio`` (in (0, 1]) and ``template``; other columns are ignored (one function).
    Errors name the line."""
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise ValueError(f"cannot read the trace {path}: {exc.strerror}") from exc
    if not rows or "arrival_s" not in rows[0]:
        raise ValueError(f"{path}: the header needs an arrival_s column")
    times, ratios = [], []
    has_ratio = "mask_ratio" in rows[0]
    templates = None
    if "template" in rows[0]:
        templates = [str(row.get("template") or DEFAULT_TEMPLATE) for row in rows]
    for line, row in enumerate(rows, start=2):
        try:
            at = float(row["arrival_s"])
            ratio = float(row["mask_ratio"]) if has_ratio else 1.0
        except (TypeError, ValueError):
            raise ValueError(f"{path}:{line}: not a number") from None
        if times and at < times[-1]:
            raise ValueError(f"{path}:{line}: arrival_s must be sorted")
        if not (math.isfinite(at) and 0 < ratio <= 1):
            raise ValueError(f"{path}:{line}: arrival_s finite, mask_ratio in (0, 1]")
        times.append(at)
        ratios.append(ratio)
    if len(times) < 2:
        raise ValueError(f"{path}: a trace needs at least two arrivals")
    return Trace(np.array(times), np.array(ratios) if has_ratio else None, templates)
