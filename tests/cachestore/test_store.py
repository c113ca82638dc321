"""ActivationStore API: bake, tiers, acquire, read_rows, prefetch, delete, ls, stats."""

from __future__ import annotations

import threading
from pathlib import Path

import lmdb
import pytest
import torch

from retouch.cachestore.errors import FormatMismatch, ReadOnlyStore, StoreClosed
from retouch.cachestore.layout import FORMAT_KEY, META_DB
from retouch.cachestore.store import ActivationStore, StoreConfig, Tier

MiB = 1 << 20


def template(seed: int, steps: int = 2) -> dict[tuple[int, str, str], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {
        (step, block, name): torch.randn(2, 64, 16, generator=gen).to(dtype)
        for step in range(steps)
        for block, dtype in (("down.0", torch.float16), ("mid", torch.bfloat16))
        for name in ("k", "v", "y")
    }
    out[(-1, "", "noise")] = torch.randn(4, 8, 8, generator=gen)
    return out


def bake(store: ActivationStore, key: str, tensors: dict, **meta) -> None:
    with store.bake(key, {"function": "f", **meta}) as w:
        for (step, block, name), tensor in tensors.items():
            w.put(step, block, name, tensor)


@pytest.fixture
def store(tmp_path: Path):
    s = ActivationStore(
        StoreConfig(path=tmp_path / "cache", host_budget_bytes=8 * MiB, map_size=64 * MiB)
    )
    yield s
    s.close()


def test_bake_then_read_every_tensor(store: ActivationStore) -> None:
    tensors = template(1)
    bake(store, "t", tensors)
    assert store.tier("t") is Tier.HOST
    with store.acquire("t") as h:
        assert h.meta["function"] == "f"
        assert h.nbytes == sum(t.nbytes for t in tensors.values())
        assert h.slots() == list(tensors)
        for slot, tensor in tensors.items():
            assert torch.equal(h.get(*slot), tensor)
    store.evict("t")
    assert store.tier("t") is Tier.DISK
    with store.acquire("t") as h:
        for slot, tensor in tensors.items():
            assert torch.equal(h.get(*slot), tensor)
    assert store.tier("t") is Tier.HOST


def test_read_rows_gathers_token_rows(store: ActivationStore) -> None:
    tensors = template(2)
    bake(store, "t", tensors)
    store.evict("t")
    rows = torch.tensor([0, 3, 4, 5, 63])
    out = torch.empty(2, 5, 16, dtype=torch.bfloat16)
    store.read_rows("t", 1, "mid", "v", rows, out)
    assert torch.equal(out, tensors[(1, "mid", "v")][:, rows])
    stats = store.stats()
    assert stats["host_reads"] == 1 and stats["host_bytes_read"] == out.nbytes
    assert stats["disk_hits"] == 1 and stats["disk_bytes_read"] > 0


def test_bake_is_invisible_until_commit_and_aborts_on_error(store: ActivationStore) -> None:
    with pytest.raises(RuntimeError, match="boom"), store.bake("t", {}) as w:
        w.put(0, "b", "k", torch.ones(4, 4))
        assert store.tier("t") is Tier.NONE
        raise RuntimeError("boom")
    assert store.tier("t") is Tier.NONE
    assert store.ls() == []
    assert store.stats()["bake_aborts"] == 1
    assert store.verify()["orphans"] == {
        "orphan_generations": 0,
        "dead_staging_records": 0,
        "bakes_in_progress": 0,
    }
    with pytest.raises(KeyError):
        store.acquire("t")
    assert store.stats()["misses"] == 1


def test_put_validation(store: ActivationStore) -> None:
    with store.bake("t", {}) as w:
        w.put(0, "b", "k", torch.ones(2))
        with pytest.raises(ValueError, match="twice"):
            w.put(0, "b", "k", torch.ones(2))
        with pytest.raises(TypeError):
            w.put(1, "b", "k", torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="msgpack"):
        store.bake("u", {"bad": object()})


def test_put_snapshots_the_callers_tensor(store: ActivationStore) -> None:
    buf = torch.zeros(8)
    with store.bake("t", {}) as w:
        w.put(0, "b", "k", buf)
        buf.fill_(7)
    store.evict("t")
    with store.acquire("t") as h:
        assert torch.count_nonzero(h.get(0, "b", "k")) == 0


def test_rebake_replaces_the_template(store: ActivationStore) -> None:
    bake(store, "t", {(0, "b", "k"): torch.zeros(4)})
    bake(store, "t", {(0, "b", "k"): torch.ones(4)})
    store.evict("t")
    with store.acquire("t") as h:
        assert torch.equal(h.get(0, "b", "k"), torch.ones(4))
    assert len(store.ls()) == 1


def test_held_template_is_not_evicted(store: ActivationStore) -> None:
    bake(store, "t", template(3))
    with store.acquire("t") as h:
        assert store.evict("t") is False
        assert torch.is_tensor(h.get(0, "mid", "k"))
    assert store.evict("t") is True
    with pytest.raises(RuntimeError, match="after release"):
        h.get(0, "mid", "k")


def test_prefetch_merges_concurrent_loads(store: ActivationStore) -> None:
    bake(store, "t", template(4))
    store.evict("t")
    gate = threading.Event()
    real_load = store._disk.load

    def slow_load(*args, **kwargs):
        gate.wait(10)
        return real_load(*args, **kwargs)

    store._disk.load = slow_load
    first, second = store.prefetch("t"), store.prefetch("t")
    assert first is second
    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("h", store.acquire("t")))
    reader.start()
    for _ in range(500):  # until the reader blocks on the in-flight load
        if first._condition._waiters:
            break
        threading.Event().wait(0.01)
    gate.set()
    assert first.result(10) > 0
    reader.join(10)
    got["h"].release()
    stats = store.stats()
    assert stats["prefetches"] == 1 and stats["prefetch_merged"] == 1
    assert stats["prefetch_waits"] == 1 and stats["loads"] == 1
    assert store.prefetch("t").result() == 0
    assert store.stats()["prefetch_resident"] == 1


def test_acquire_takes_over_a_prefetch_still_queued(tmp_path: Path) -> None:
    config = StoreConfig(path=tmp_path / "c", map_size=64 * MiB, prefetch_workers=1)
    with ActivationStore(config) as store:
        for key in "ab":
            bake(store, key, template(ord(key)))
            store.evict(key)
        gate = threading.Event()
        real_load = store._disk.load

        def load(key, *args):
            if key == "a":
                gate.wait(10)
            return real_load(key, *args)

        store._disk.load = load
        stuck = store.prefetch("a")  # occupies the only prefetch worker
        queued = store.prefetch("b")
        with store.acquire("b") as h:  # does not wait behind "a"
            assert not stuck.done()
            assert torch.equal(h.get(0, "mid", "v"), template(ord("b"))[(0, "mid", "v")])
        assert queued.done() and queued.result() > 0
        gate.set()
        assert stuck.result(10) > 0
        stats = store.stats()
        assert stats["prefetch_taken_over"] == 1 and stats["loads"] == 2


def test_prefetch_of_absent_key_raises_keyerror(store: ActivationStore) -> None:
    with pytest.raises(KeyError):
        store.prefetch("nope").result(10)


def test_delete_and_delete_where(store: ActivationStore) -> None:
    bake(store, "a", template(5), function="f1")
    bake(store, "b", template(6), function="f1")
    bake(store, "c", template(7), function="f2")
    store.evict("b")
    assert store.delete_where(function="f1") == ["a", "b"]
    assert [row["key"] for row in store.ls()] == ["c"]
    assert store.delete("c") is True
    assert store.delete("c") is False
    assert store.tier("c") is Tier.NONE
    assert store.stats()["templates"] == 0


def test_ls_and_stats_describe_both_tiers(store: ActivationStore) -> None:
    bake(store, "a", template(8))
    bake(store, "b", template(9))
    store.evict("b")
    rows = {row["key"]: row for row in store.ls()}
    assert rows["a"]["tier"] == "host" and rows["b"]["tier"] == "disk"
    assert rows["a"]["valid"] and rows["a"]["bytes"] > 0 and rows["a"]["meta"]["function"] == "f"
    stats = store.stats()
    assert stats["templates"] == 2 and stats["disk_templates"] == 2 and stats["host_templates"] == 1
    assert stats["disk_bytes"] == rows["a"]["bytes"] + rows["b"]["bytes"]
    assert stats["bakes"] == 2 and stats["host_evictions"] == 1


def test_readonly_store_reads_but_refuses_writes(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    with ActivationStore(StoreConfig(path=path, map_size=64 * MiB)) as writer:
        bake(writer, "t", template(10))
    with ActivationStore(StoreConfig(path=path, map_size=64 * MiB, readonly=True)) as reader:
        assert reader.tier("t") is Tier.DISK
        with reader.acquire("t") as h:
            assert h.get(-1, "", "noise").shape == (4, 8, 8)
        with pytest.raises(ReadOnlyStore):
            reader.bake("u", {})
        with pytest.raises(ReadOnlyStore):
            reader.delete("t")


def test_format_version_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    ActivationStore(StoreConfig(path=path, map_size=64 * MiB)).close()
    env = lmdb.open(str(path), max_dbs=8, map_size=64 * MiB)
    with env.begin(write=True, db=env.open_db(META_DB)) as txn:
        txn.put(FORMAT_KEY, b"999")
    env.close()
    with pytest.raises(FormatMismatch, match="999"):
        ActivationStore(StoreConfig(path=path, map_size=64 * MiB))


def test_closed_store_refuses_use(tmp_path: Path) -> None:
    store = ActivationStore(StoreConfig(path=tmp_path / "c", map_size=64 * MiB))
    store.close()
    store.close()
    with pytest.raises(StoreClosed):
        store.tier("t")


def test_map_size_is_fixed_at_creation(tmp_path: Path) -> None:
    """Processes mapping one file with different sizes would break each other's reads."""
    path = tmp_path / "cache"
    with ActivationStore(StoreConfig(path=path, map_size=64 * MiB)) as first:
        bake(first, "t", template(11))
    with ActivationStore(StoreConfig(path=path, map_size=256 * MiB)) as second:
        assert second.stats()["map_size"] == 64 * MiB
        assert second.stats()["disk_budget_bytes"] <= 64 * MiB
        assert second.tier("t") is Tier.DISK
