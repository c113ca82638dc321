"""Placement: which executor runs an invocation.

Every policy sees the executors that can serve the function (healthy, function loaded)
and what the gateway knows about the invocation. ``least-requests`` is the default until
the mask-aware, cost-model placement of FlashPS Algorithm 2 lands (it needs the executors'
profiled cost models); ``round-robin`` stays as a baseline for comparisons.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class PlacementRequest:
    function: str
    template: str
    mask_ratio: float


class Candidate(Protocol):
    name: str
    inflight: int


class Placement(Protocol):
    name: str

    def choose(self, candidates: list[Candidate], request: PlacementRequest) -> Candidate: ...


@dataclass
class RoundRobin:
    name: str = "round-robin"
    _counter: itertools.count = field(default_factory=itertools.count)

    def choose(self, candidates: list[Candidate], request: PlacementRequest) -> Candidate:
        return candidates[next(self._counter) % len(candidates)]


@dataclass
class LeastRequests:
    """Fewest invocations in flight; ties go to the executor listed first (stable)."""

    name: str = "least-requests"

    def choose(self, candidates: list[Candidate], request: PlacementRequest) -> Candidate:
        return min(candidates, key=lambda c: c.inflight)


POLICIES = {"round-robin": RoundRobin, "least-requests": LeastRequests}


def make_placement(name: str) -> Placement:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown placement {name!r}; choose from {sorted(POLICIES)}") from None
