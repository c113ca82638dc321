"""Corruption is detected on read, the template is invalidated and can be re-baked;
map-full and budget pressure evict or refuse without corrupting anything."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest
import torch

from retouch.cachestore.diskenv import DATA_FILE, is_full
from retouch.cachestore.errors import CorruptEntry, StoreFull
from retouch.cachestore.layout import MANIFEST_DB, VALUES_DB, value_key
from retouch.cachestore.manifest import Manifest
from retouch.cachestore.store import ActivationStore, StoreConfig, Tier

MiB = 1 << 20


def marked(seed: int) -> torch.Tensor:
    """A tensor whose bytes are unique in the data file (so a test can find them)."""
    return (torch.arange(16384, dtype=torch.int32) * 7 + seed * 1_000_003).view(4, 4096)


def template(seed: int) -> dict[tuple[int, str, str], torch.Tensor]:
    return {(0, "blk", "k"): marked(seed), (0, "blk", "v"): torch.randn(2, 64, 8).half()}


def bake(store: ActivationStore, key: str, tensors: dict, **meta) -> None:
    with store.bake(key, {"function": "f", **meta}) as w:
        for slot, tensor in tensors.items():
            w.put(*slot, tensor)


def open_store(path: Path, **kw) -> ActivationStore:
    kw.setdefault("map_size", 64 * MiB)
    kw.setdefault("host_budget_bytes", 0)  # every acquire reads the disk tier
    return ActivationStore(StoreConfig(path=path, **kw))


def flip_byte_in_file(path: Path, pattern: bytes) -> None:
    data = path.read_bytes()
    at = data.find(pattern)
    assert at >= 0 and data.find(pattern, at + 1) < 0, "pattern must occur exactly once"
    with path.open("r+b") as f:
        f.seek(at + len(pattern) // 2)
        f.write(bytes([data[at + len(pattern) // 2] ^ 0xFF]))


def assert_corrupt_then_rebaked(store: ActivationStore, key: str, seed: int) -> None:
    with pytest.raises(CorruptEntry) as info:
        store.acquire(key)
    assert info.value.key == key and (info.value.step, info.value.block) == (0, "blk")
    assert store.tier(key) is Tier.NONE  # invalid reads as absent ...
    with pytest.raises(KeyError):
        store.acquire(key)  # ... so the runtime re-bakes
    row = next(r for r in store.ls() if r["key"] == key)
    assert row["valid"] is False and "checksum" in row["reason"]
    bake(store, key, template(seed))
    with store.acquire(key) as h:
        assert torch.equal(h.get(0, "blk", "k"), marked(seed))
    assert store.stats()["corrupt"] == 1


def test_corrupt_value_written_through_raw_lmdb(tmp_path: Path) -> None:
    path = tmp_path / "c"
    with open_store(path) as store:
        bake(store, "t", template(1))
    env = lmdb.open(str(path), max_dbs=8, map_size=64 * MiB)
    with env.begin(write=True) as txn:
        manifest = Manifest.unpack(txn.get(b"t", db=env.open_db(MANIFEST_DB, txn=txn)))
        values = env.open_db(VALUES_DB, txn=txn)
        vkey = value_key(manifest.gen, 0, "blk", "k")
        bad = bytearray(txn.get(vkey, db=values))
        bad[-100] ^= 0x01
        txn.put(vkey, bytes(bad), db=values)
    env.close()
    with open_store(path) as store:
        assert store.tier("t") is Tier.DISK
        assert_corrupt_then_rebaked(store, "t", 1)
        assert store.verify()["corrupt"] == []


def test_corrupt_bytes_in_the_data_file(tmp_path: Path) -> None:
    path = tmp_path / "c"
    with open_store(path) as store:
        bake(store, "a", template(1))
        bake(store, "b", template(2))
    for seed in (1, 2):
        flip_byte_in_file(path / DATA_FILE, marked(seed).numpy().tobytes()[20000:20064])
    with open_store(path) as store:
        assert_corrupt_then_rebaked(store, "a", 1)
        report = store.verify()  # finds b without anyone reading it
        assert [p["key"] for p in report["corrupt"]] == ["b"]
        assert store.tier("b") is Tier.NONE
        assert store.gc() > 0
        assert [r["key"] for r in store.ls()] == ["a"]
        assert store.verify() == {
            "templates": 1,
            "values": 2,
            "bytes": sum(t.nbytes for t in template(1).values()),
            "corrupt": [],
            "invalid": [],
            "orphans": {
                "orphan_generations": 0,
                "dead_staging_records": 0,
                "bakes_in_progress": 0,
            },
        }


def test_undecodable_manifest_reads_as_corrupt_then_absent(tmp_path: Path) -> None:
    path = tmp_path / "c"
    with open_store(path) as store:
        bake(store, "t", template(1))
    env = lmdb.open(str(path), max_dbs=8, map_size=64 * MiB)
    with env.begin(write=True) as txn:
        txn.put(b"t", b"V\xc1garbage", db=env.open_db(MANIFEST_DB, txn=txn))
    env.close()
    with open_store(path) as store:
        with pytest.raises(CorruptEntry, match="manifest"):
            store.acquire("t")
        assert store.tier("t") is Tier.NONE
        assert store.verify()["orphans"]["orphan_generations"] == 1
        assert store.gc() > 0
        assert store.verify()["orphans"]["orphan_generations"] == 0


def test_map_full_evicts_then_refuses_without_damage(tmp_path: Path) -> None:
    size = 2 * MiB  # each template is ~ 64 KiB + 2 KiB; the map holds ~ 25
    with open_store(tmp_path / "c", map_size=size, disk_budget_bytes=size) as store:
        for i in range(60):
            bake(store, f"t{i}", template(i))
        stats = store.stats()
        assert stats["disk_evictions"] > 0 and stats["bakes"] == 60
        with store.acquire("t59") as h:
            assert torch.equal(h.get(0, "blk", "k"), marked(59))
        # fits the budget (= map size) but not the map with LMDB's own pages: LMDB refuses,
        # the store evicts everything it may and then refuses cleanly
        huge = {(0, "blk", "k"): torch.zeros(size - 64 * 1024, dtype=torch.uint8)}
        with pytest.raises(StoreFull, match="nothing left to evict"):
            bake(store, "huge", huge)
        assert store.tier("huge") is Tier.NONE
        report = store.verify()
        assert report["corrupt"] == [] and report["orphans"]["orphan_generations"] == 0
        bake(store, "after", template(1))  # still writable
    with open_store(tmp_path / "c", map_size=size, disk_budget_bytes=size) as store:
        assert store.verify()["corrupt"] == []
        assert store.tier("after") is Tier.DISK


@pytest.mark.parametrize(("policy", "evicted"), [("lru", "b"), ("lcbfu", "a")])
def test_disk_budget_evicts_least_valuable(tmp_path: Path, policy: str, evicted: str) -> None:
    one = sum(t.nbytes for t in template(0).values())
    with open_store(tmp_path / "c", disk_budget_bytes=int(2.5 * one), policy=policy) as store:
        bake(store, "a", template(1), saved_compute=0.1)
        bake(store, "b", template(2), saved_compute=0.9)
        for _ in range(3):
            store.acquire("a").release()  # a: recent but cheap to recompute
        bake(store, "c", template(3), saved_compute=0.5)
        assert store.tier(evicted) is Tier.NONE
        assert sum(store.tier(k) is Tier.DISK for k in "abc") == 2
        assert store.stats()["disk_evictions"] == 1


def test_template_larger_than_disk_budget_is_refused(tmp_path: Path) -> None:
    with open_store(tmp_path / "c", disk_budget_bytes=32 << 10) as store:
        bake(store, "small", {(0, "b", "k"): torch.zeros(1000)})
        with pytest.raises(StoreFull, match="disk budget"):
            bake(store, "big", template(1))
        assert store.tier("small") is Tier.DISK and store.tier("big") is Tier.NONE
        assert store.verify()["orphans"]["orphan_generations"] == 0


def test_disk_full_is_recognised() -> None:
    assert is_full(lmdb.Error("mdb_txn_commit: No space left on device"))
    assert is_full(lmdb.MapFullError("mdb_put: MDB_MAP_FULL"))
    assert not is_full(lmdb.Error("mdb_put: Invalid argument"))


@pytest.mark.parametrize("policy", ["lru", "lcbfu"])
def test_disk_budget_evicts_ephemeral_templates_first(tmp_path: Path, policy: str) -> None:
    """An uploaded image's bake (ephemeral key) goes before a deployed template, even one
    that is older and never read again."""
    one = sum(t.nbytes for t in template(0).values())
    with open_store(tmp_path / "c", disk_budget_bytes=int(2.5 * one), policy=policy) as store:
        bake(store, "deployed", template(1))
        bake(store, "~upload", template(2))
        for _ in range(3):
            store.acquire("~upload").release()
        bake(store, "deployed-2", template(3))
        assert store.tier("~upload") is Tier.NONE
        assert store.tier("deployed") is Tier.DISK and store.tier("deployed-2") is Tier.DISK


def test_host_tier_evicts_ephemeral_templates_first(tmp_path: Path) -> None:
    one = sum(t.nbytes for t in template(0).values())
    with open_store(tmp_path / "c", host_budget_bytes=int(2.5 * one)) as store:
        bake(store, "deployed", template(1))
        bake(store, "~upload", template(2))
        store.acquire("~upload").release()  # most recently used, still the first to go
        bake(store, "deployed-2", template(3))
        assert store.tier("deployed") is Tier.HOST and store.tier("deployed-2") is Tier.HOST
        assert store.tier("~upload") is Tier.DISK
