"""Host budget smaller than two templates: alternating reads spill and reload."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from retouch.cachestore.store import ActivationStore, StoreConfig, Tier
from retouch.cachestore.streaming import StreamedTemplate

MiB = 1 << 20
SHAPE = (2, 256, 128)  # 128 KiB in fp16; 4 of them per template = 512 KiB


def template(seed: int) -> dict[tuple[int, str, str], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        (step, "blk", name): torch.randn(SHAPE, generator=gen).half()
        for step in range(2)
        for name in ("k", "v")
    }


def bake(store: ActivationStore, key: str, tensors: dict) -> None:
    with store.bake(key, {"function": "f"}) as w:
        for slot, tensor in tensors.items():
            w.put(*slot, tensor)


@pytest.mark.parametrize("policy", ["lru", "lcbfu"])
def test_alternating_reads_of_three_templates_spill_and_reload(tmp_path: Path, policy: str) -> None:
    """Host-only bakes (write_through=False) reach the disk only by being spilled."""
    budget = 768 << 10  # 1.5 templates
    config = StoreConfig(
        path=tmp_path / "c",
        host_budget_bytes=budget,
        map_size=64 * MiB,
        write_through=False,
        policy=policy,
    )
    temps = {key: template(i) for i, key in enumerate("abc")}
    rows = torch.arange(0, 256, 3)
    with ActivationStore(config) as store:
        for key, tensors in temps.items():
            bake(store, key, tensors)
        for round_ in range(4):
            for key in "abcacb":
                with store.acquire(key) as h:
                    for slot, tensor in temps[key].items():
                        out = torch.empty(2, len(rows), 128, dtype=torch.float16)
                        h.read_rows(*slot, rows, out)
                        assert torch.equal(out, tensor[:, rows]), (round_, key, slot)
                store.flush()  # let the spill land, so the next read reloads from disk
                stats = store.stats()
                assert stats["host_bytes"] <= budget
        stats = store.stats()
        assert stats["spills"] == 3, stats  # each template written to disk once, by eviction
        assert stats["spill_failures"] == 0
        assert stats["loads"] >= 10  # reloaded from disk again and again
        assert stats["host_evictions"] >= 10
        assert stats["disk_templates"] == 3 and stats["host_templates"] == 1
        assert stats["host_overcommits"] == 0
        assert sorted(store.tier(k).value for k in "abc") == ["disk", "disk", "host"]
        assert store.verify()["corrupt"] == []


def test_write_through_evicts_without_spilling(tmp_path: Path) -> None:
    config = StoreConfig(path=tmp_path / "c", host_budget_bytes=768 << 10, map_size=64 * MiB)
    with ActivationStore(config) as store:
        for i, key in enumerate("abc"):
            bake(store, key, template(i))
        for key in "abcabc":
            with store.acquire(key) as h:
                assert torch.equal(
                    h.get(0, "blk", "k"), template("abc".index(key))[(0, "blk", "k")]
                )
        stats = store.stats()
        assert stats["spills"] == 0 and stats["loads"] >= 5 and stats["disk_templates"] == 3


def test_template_larger_than_host_budget_is_streamed_by_step(tmp_path: Path) -> None:
    config = StoreConfig(path=tmp_path / "c", host_budget_bytes=100 << 10, map_size=64 * MiB)
    with ActivationStore(config) as store:
        bake(store, "big", template(1))
        assert store.tier("big") is Tier.DISK  # too large to keep after the bake
        with store.acquire("big") as h:
            assert isinstance(h, StreamedTemplate)
            assert store.tier("big") is Tier.DISK  # never loaded whole
            assert h.get(1, "blk", "v").shape == SHAPE
        stats = store.stats()
        assert stats["streamed"] == 1  # (a step alone may exceed this tiny budget)
        assert stats["disk_bytes_read"] <= sum(t.nbytes for t in template(1).values())


def test_rescue_of_a_template_being_spilled(tmp_path: Path) -> None:
    config = StoreConfig(
        path=tmp_path / "c", host_budget_bytes=768 << 10, map_size=64 * MiB, write_through=False
    )
    with ActivationStore(config) as store:
        gate = __import__("threading").Event()
        real = store._disk._write_template

        def slow_write(*args):
            gate.wait(10)
            return real(*args)

        store._disk._write_template = slow_write
        bake(store, "a", template(0))
        bake(store, "b", template(1))  # evicts a -> spill blocked on the gate
        assert store.stats()["host_spilling_bytes"] > 0
        with store.acquire("a") as h:  # taken back from the spill queue, no I/O
            assert torch.equal(h.get(0, "blk", "k"), template(0)[(0, "blk", "k")])
        gate.set()
        store.close()
        stats = store._counters.snapshot()
        assert stats["rescues"] == 1 and stats["loads"] == 0
