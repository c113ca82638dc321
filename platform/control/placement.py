"""Placement: which executor runs an invocation.

A policy sees the executors that can serve the function and have room (each with its
:class:`~retouch.platform.control.cluster.ExecutorView`) and the invocation. Policies are
pure choices over that picture; they hold no I/O and no clock.

``maskaware`` (the default) is FlashPS Algorithm 2 with template affinity: the minimum of
the predicted completion (the executor's batch ⊕ the newcomer, stepped with its cost model
and the bubble-free plan; a template on disk delays the newcomer's join by what of its load
the encode does not hide) plus a bake where the template is not baked; among near-ties a template stays where its host tier already holds it,
else goes where loading it evicts the least popular template (or nothing), else to its
rendezvous-hash home, so equal executors split the templates between them; and a guard
stops affinity from piling work onto one executor: when the affine choice would
finish more than ``imbalance`` later than the fastest, the fastest wins. In a large pool
only a shortlist (the executors with the least predicted work plus residency cost) gets an
exact prediction, which keeps a decision sub-millisecond at 64 executors. A function's
adapter set is costed like its template: nothing where the device holds it, its load where
it does not, and the swaps its steps wait for where batches of other sets run
(``ExecutorView.adapter_load_s`` / ``adapter_swap_s``). The baselines stay for comparison:
``adapter-blind`` (``maskaware`` without the adapter terms), ``least-requests``,
``round-robin``, ``least-masked-tokens`` and ``template-hash`` (consistent hashing on the
template).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from retouch.platform.control.cluster import ExecutorView, PlacementRequest, Residency

log = logging.getLogger(__name__)

__all__ = ["POLICIES", "Candidate", "Placement", "PlacementRequest", "make_placement"]

NEAR_TIE = 0.05  # predicted scores within 5 % (or 10 ms) count as equal
DEMAND_HALF_LIFE = 500  # decisions after which a template's past demand counts half
SHORTLIST = 8  # executors given an exact prediction per decision in a large pool


class Candidate(Protocol):
    name: str
    inflight: int
    slots: int
    view: ExecutorView


class Placement(Protocol):
    name: str
    late_binding: bool  # bind only when an executor has batch room (else: any free slot)

    def choose(self, candidates: Sequence[Candidate], request: PlacementRequest) -> Candidate: ...


@dataclass
class RoundRobin:
    name: str = "round-robin"
    late_binding: bool = False
    _counter: itertools.count = field(default_factory=itertools.count)

    def choose(self, candidates: Sequence[Candidate], request: PlacementRequest) -> Candidate:
        return candidates[next(self._counter) % len(candidates)]


@dataclass
class LeastRequests:
    """Fewest invocations in flight; ties go to the executor listed first (stable)."""

    name: str = "least-requests"
    late_binding: bool = False

    def choose(self, candidates: Sequence[Candidate], request: PlacementRequest) -> Candidate:
        return min(candidates, key=lambda c: c.inflight)


@dataclass
class LeastMaskedTokens:
    """Fewest masked tokens in flight (a mask-aware count, no cost model)."""

    name: str = "least-masked-tokens"
    late_binding: bool = False

    def choose(self, candidates: Sequence[Candidate], request: PlacementRequest) -> Candidate:
        return min(candidates, key=lambda c: (c.view.masked_tokens(), c.inflight))


@dataclass
class TemplateHash:
    """Consistent hashing of the template onto the executors (virtual nodes on a ring): a
    template keeps going to the same executor while the pool is stable, and only its share
    moves when one joins or leaves. An executor without room is skipped along the ring."""

    name: str = "template-hash"
    late_binding: bool = False
    vnodes: int = 64
    _rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = field(default_factory=dict)

    def choose(self, candidates: Sequence[Candidate], request: PlacementRequest) -> Candidate:
        by_name = {c.name: c for c in candidates}
        hashes, names = self._ring(tuple(sorted(by_name)))
        start = bisect.bisect(hashes, _hash(f"{request.function}/{request.template}"))
        for i in range(len(names)):
            name = names[(start + i) % len(names)]
            if name in by_name:
                return by_name[name]
        return candidates[0]

    def _ring(self, names: tuple[str, ...]) -> tuple[list[int], list[str]]:
        ring = self._rings.get(names)
        if ring is None:
            points = sorted((_hash(f"{n}#{i}"), n) for n in names for i in range(self.vnodes))
            ring = ([h for h, _ in points], [n for _, n in points])
            self._rings = {names: ring}  # the pool changed: older rings are stale
        return ring


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class TemplateDemand:
    """Each template's recent share of the decisions, decayed per decision rather than per
    second (a policy holds no clock): how much a template is worth keeping in host memory."""

    def __init__(self, half_life: int = DEMAND_HALF_LIFE) -> None:
        self._growth = 2.0 ** (1.0 / half_life)
        self._unit = 1.0  # grows instead of every weight decaying: O(1) per decision
        self._weights: dict[tuple[str, str], float] = {}

    def add(self, key: tuple[str, str]) -> None:
        self._unit *= self._growth
        self._weights[key] = self._weights.get(key, 0.0) + self._unit
        if self._unit > 1e100:  # renormalise, forgetting what has decayed to nothing
            self._weights = {
                k: w / self._unit for k, w in self._weights.items() if w > self._unit * 1e-9
            }
            self._unit = 1.0

    def value(self, key: tuple[str, str]) -> float:
        return self._weights.get(key, 0.0) / self._unit


@dataclass
class MaskAware:
    """Minimum predicted completion plus residency cost, near-ties by what each host tier
    holds and would evict, then the template's rendezvous-hash home (an upload's at
    random), and an imbalance guard (see the module docstring)."""

    name: str = "maskaware"
    late_binding: bool = True
    imbalance: float = 0.5  # affinity may finish at most this much later than the fastest
    # Exact predictions only for this many executors, those with the least remaining work
    # (each invocation's steps left at its solo step cost: a sum, no batch stepping) plus
    # residency cost: the power-of-k-choices idea of Ray Serve's router, ranked by cost.
    shortlist: int = SHORTLIST
    seed: int | None = None
    adapters: bool = True  # cost each executor's adapter sets (False: adapter-blind)
    fallback: LeastRequests = field(default_factory=LeastRequests)
    _rng: random.Random = field(init=False)
    _demand: TemplateDemand = field(init=False, default_factory=TemplateDemand)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def choose(self, candidates: Sequence[Candidate], request: PlacementRequest) -> Candidate:
        if request.template and not request.full:
            self._demand.add((request.function, request.template))
        scored = []
        for c in self._shortlist(candidates, request):
            prediction = c.view.predict(request, adapters=self.adapters)
            if prediction is None:  # no profile of its model there yet: count requests
                return self.fallback.choose(candidates, request)
            finish = prediction.finish_s
            score = finish + c.view.bake_cost_s(request)
            if not math.isfinite(score):  # a broken profile or fit: trust no prediction
                log.warning("executor %s predicts %r s: placing by requests", c.name, score)
                return self.fallback.choose(candidates, request)
            scored.append((score, finish, c))
        best = min(s for s, _, _ in scored)
        near = [item for item in scored if item[0] <= best * (1 + NEAR_TIE) + 0.01]
        _, finish, chosen = self._tie_break(near, request)
        fastest = min(f for _, f, _ in scored)
        if finish > fastest * (1 + self.imbalance) + 0.01:
            return min(scored, key=lambda item: item[1])[2]
        return chosen

    def _shortlist(
        self, candidates: Sequence[Candidate], request: PlacementRequest
    ) -> Sequence[Candidate]:
        return shortlist(candidates, request, self.shortlist, adapters=self.adapters)

    def _tie_break(
        self, near: list[tuple[float, float, Candidate]], request: PlacementRequest
    ) -> tuple[float, float, Candidate]:
        """Among near-equal executors a template goes where it costs the host tiers least:
        where it is already held (in the device tier first, then in host memory); else where loading it evicts nothing or the least
        popular template; among those, to its rendezvous-hash home, so equal executors
        split the templates instead of each pulling every template in. Measured: at
        random, a Zipf mix of 12 templates spread over both executors and maskaware hit
        the host tier less than least-requests; by hash alone, one executor's share could
        hold more popular templates than its tier. An upload has no template, and an edit
        that reads no row needs none of it: at random."""
        if len(near) == 1:
            return near[0]
        if not request.template or request.full:
            return self._rng.choice(near)
        template = (request.function, request.template)
        held = [item for item in near if item[2].view.tier(*template) is Residency.DEVICE]
        held = held or [item for item in near if item[2].view.tier(*template) is Residency.HOST]
        if not held:
            costs = [self._eviction_cost(item[2].view) for item in near]
            held = [item for item, cost in zip(near, costs, strict=True) if cost == min(costs)]
        key = f"{request.function}/{request.template}@"
        return max(held, key=lambda item: _hash(key + item[2].name))

    def _eviction_cost(self, view: ExecutorView) -> float:
        """The recent demand for the template a load would evict there (0: room to spare)."""
        victim = view.residency.victim(view.host_capacity)
        return 0.0 if victim is None else self._demand.value(victim)


def shortlist(
    candidates: Sequence[Candidate],
    request: PlacementRequest,
    k: int = SHORTLIST,
    *,
    adapters: bool = True,
) -> Sequence[Candidate]:
    """The ``k`` executors with the least remaining work (each invocation's steps left at
    its solo step cost, memoised per view) plus the template's residency cost (and, with
    ``adapters``, the adapter set's): the ones worth an exact prediction (placement and
    admission both use it)."""
    if len(candidates) <= k:
        return candidates
    # Each cost once, then a stable sort of positions (ties keep the listed order, as
    # sorting the candidates themselves would): this runs on every decision and arrival.
    costs = [c.view.solo_work_s() + c.view.residency_cost_s(request, adapters) for c in candidates]
    return [candidates[i] for i in sorted(range(len(costs)), key=costs.__getitem__)[:k]]


POLICIES = {
    "maskaware": MaskAware,
    "adapter-blind": functools.partial(MaskAware, name="adapter-blind", adapters=False),
    "least-requests": LeastRequests,
    "round-robin": RoundRobin,
    "least-masked-tokens": LeastMaskedTokens,
    "template-hash": TemplateHash,
}


def make_placement(name: str) -> Placement:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown placement {name!r}; choose from {sorted(POLICIES)}") from None
