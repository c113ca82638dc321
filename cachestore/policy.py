"""Eviction policies: which template a tier gives up first.

A policy only ranks keys; the tiers own the bytes. Each tier has its own policy instance,
so the host tier and the disk tier keep separate access histories.

* ``LRUPolicy`` — least recently used first (the default, FlashPS's choice).
* ``LCBFUPolicy`` — NIRVANA's LCBFU: value = access frequency x compute saved per access
  (``meta["saved_compute"]``, the fraction of a full generation a hit saves; 1.0 when
  absent); the least valuable goes first. Frequencies are aged GreedyDual-style: a
  template's priority is ``L + freq * saved`` where ``L`` rises to the priority of the last
  victim, so a template that was popular long ago cannot stay forever.

Both tiers evict *ephemeral* templates (keys starting with :data:`EPHEMERAL_PREFIX`, e.g.
the runtime's bakes of uploaded images) before any other valid template, in the policy's
order among themselves. The class lives in the key so that every process sharing the disk
tier sees it without decoding metadata.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

DEFAULT_SAVED_COMPUTE = 1.0
EPHEMERAL_PREFIX = "~"  # keys of templates evicted before all others


def is_ephemeral(key: str) -> bool:
    return key.startswith(EPHEMERAL_PREFIX)


def ephemeral_first(policy: EvictionPolicy, keys: Iterable[str]) -> list[str]:
    """``keys`` least valuable first, every ephemeral key before every other one."""
    keys = list(keys)
    return [
        *policy.rank(k for k in keys if is_ephemeral(k)),
        *policy.rank(k for k in keys if not is_ephemeral(k)),
    ]


def saved_compute(meta: dict) -> float:
    """Fraction of a full generation one hit on this template saves (LCBFU weight)."""
    value = meta.get("saved_compute", DEFAULT_SAVED_COMPUTE)
    try:
        return max(float(value), 0.0)
    except (TypeError, ValueError):
        return DEFAULT_SAVED_COMPUTE


class EvictionPolicy(ABC):
    """Ranks candidate keys for eviction; not thread-safe (the owning tier locks)."""

    @abstractmethod
    def on_access(self, key: str, saved: float) -> None:
        """A template was read (hit or load) or inserted."""

    @abstractmethod
    def rank(self, keys: Iterable[str]) -> list[str]:
        """``keys`` ordered least valuable first; keys never seen keep their given order
        and come before seen ones (callers pass unseen keys oldest first)."""

    def on_evict(self, key: str) -> None:
        """The tier evicted ``key``; the default forgets it."""
        self.forget(key)

    @abstractmethod
    def forget(self, key: str) -> None:
        """Drop all state about ``key`` (deleted or evicted)."""


@dataclass
class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    _clock: itertools.count = field(default_factory=lambda: itertools.count(1))
    _last: dict[str, int] = field(default_factory=dict)

    def on_access(self, key: str, saved: float) -> None:
        self._last[key] = next(self._clock)

    def rank(self, keys: Iterable[str]) -> list[str]:
        return sorted(keys, key=lambda k: self._last.get(k, 0))

    def forget(self, key: str) -> None:
        self._last.pop(key, None)


@dataclass
class LCBFUPolicy(EvictionPolicy):
    """Lowest frequency x saved-compute first, with GreedyDual aging; ties go LRU."""

    _clock: itertools.count = field(default_factory=lambda: itertools.count(1))
    _inflation: float = 0.0
    _freq: dict[str, int] = field(default_factory=dict)
    _priority: dict[str, float] = field(default_factory=dict)
    _last: dict[str, int] = field(default_factory=dict)

    def on_access(self, key: str, saved: float) -> None:
        freq = self._freq.get(key, 0) + 1
        self._freq[key] = freq
        self._priority[key] = self._inflation + freq * saved
        self._last[key] = next(self._clock)

    def rank(self, keys: Iterable[str]) -> list[str]:
        return sorted(keys, key=lambda k: (self._priority.get(k, 0.0), self._last.get(k, 0)))

    def on_evict(self, key: str) -> None:
        self._inflation = max(self._inflation, self._priority.get(key, 0.0))
        self.forget(key)

    def forget(self, key: str) -> None:
        self._freq.pop(key, None)
        self._priority.pop(key, None)
        self._last.pop(key, None)

    def score(self, key: str) -> float:
        """Current priority of ``key`` (for ``ls`` and tests)."""
        return self._priority.get(key, 0.0)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "lcbfu": LCBFUPolicy}

PolicySpec = str | Callable[[], EvictionPolicy]


def make_policy(spec: PolicySpec) -> EvictionPolicy:
    """A fresh policy from a name (``"lru"``, ``"lcbfu"``) or a zero-argument factory."""
    if callable(spec):
        policy = spec()
        if not isinstance(policy, EvictionPolicy):
            raise TypeError(f"policy factory returned {type(policy).__name__}")
        return policy
    try:
        return POLICIES[spec]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {spec!r}; choose from {list(POLICIES)}"
        ) from None
