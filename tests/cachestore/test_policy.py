"""Eviction order of the LRU and LCBFU policies."""

from __future__ import annotations

import pytest

from retouch.cachestore.policy import (
    LCBFUPolicy,
    LRUPolicy,
    ephemeral_first,
    is_ephemeral,
    make_policy,
    saved_compute,
)


def test_lru_evicts_least_recently_used_and_unseen_first() -> None:
    policy = LRUPolicy()
    for key in ("a", "b", "c"):
        policy.on_access(key, 1.0)
    policy.on_access("a", 1.0)
    assert policy.rank(["a", "b", "c", "new"]) == ["new", "b", "c", "a"]


def test_lcbfu_weighs_frequency_by_saved_compute() -> None:
    policy = LCBFUPolicy()
    for _ in range(3):
        policy.on_access("often_cheap", 0.2)  # 3 x 0.2 = 0.6
    policy.on_access("rare_valuable", 0.9)  # 1 x 0.9 = 0.9
    policy.on_access("rare_cheap", 0.1)  # 0.1
    assert policy.rank(["often_cheap", "rare_valuable", "rare_cheap"]) == [
        "rare_cheap",
        "often_cheap",
        "rare_valuable",
    ]


def test_lcbfu_ages_old_popularity() -> None:
    """A template that was hot long ago loses to a stream of one-hit newcomers eventually
    (GreedyDual inflation); without aging it would stay forever."""
    policy = LCBFUPolicy()
    for _ in range(5):
        policy.on_access("old_hot", 1.0)  # priority 5
    victims = []
    for i in range(8):
        policy.on_access(f"x{i}", 1.0)  # priority: inflation + 1
        victim = policy.rank(["old_hot", f"x{i}"])[0]
        victims.append(victim)
        policy.on_evict(victim)
        if victim == "old_hot":
            break
    assert victims[:4] == ["x0", "x1", "x2", "x3"]
    assert victims[-1] == "old_hot"


def test_make_policy_accepts_names_and_factories() -> None:
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy(LCBFUPolicy), LCBFUPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo")


def test_saved_compute_defaults_and_clamps() -> None:
    assert saved_compute({}) == 1.0
    assert saved_compute({"saved_compute": 0.25}) == 0.25
    assert saved_compute({"saved_compute": -3}) == 0.0
    assert saved_compute({"saved_compute": "x"}) == 1.0


def test_ephemeral_keys_rank_before_all_others() -> None:
    """Uploaded images' bakes (ephemeral keys) go first, whatever the policy prefers."""
    for policy in (LRUPolicy(), LCBFUPolicy()):
        for key in ("~old", "deployed", "~new"):
            policy.on_access(key, 1.0)
        for _ in range(3):
            policy.on_access("~new", 1.0)
        ranked = ephemeral_first(policy, ["deployed", "~new", "~old", "unseen"])
        assert ranked[:2] == ["~old", "~new"] and set(ranked[2:]) == {"deployed", "unseen"}
        assert is_ephemeral("~x") and not is_ephemeral("x~")
