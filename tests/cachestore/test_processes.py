"""Other processes: a writer SIGKILLed mid-bake, and a reader racing a writer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from retouch.cachestore.store import ActivationStore, StoreConfig, Tier

MiB = 1 << 20
MAP = 256 * MiB

PRELUDE = """
import json, sys, time
from pathlib import Path
import torch
from retouch.cachestore.store import ActivationStore, StoreConfig
path = Path(sys.argv[1])
MAP = 256 << 20
"""

BAKE_THEN_HANG = (
    PRELUDE
    + """
store = ActivationStore(StoreConfig(path=path, map_size=MAP, write_batch_bytes=1 << 16))
with store.bake("t", {"function": "f"}) as w:
    for step in range(20):
        w.put(step, "blk", "k", torch.full((64, 512), float(step)))  # 128 KiB each
    w._flush()
    while w._inflight:
        w._inflight.popleft().result()  # staged values are on disk now
    print("STAGED", flush=True)
    time.sleep(60)
"""
)

WRITER = (
    PRELUDE
    + """
store = ActivationStore(StoreConfig(path=path, map_size=MAP, host_budget_bytes=0))
ready = Path(sys.argv[3]) if len(sys.argv) > 3 else None
while ready is not None and not ready.exists():  # start writing once the reader reads
    time.sleep(0.01)
for i in range(int(sys.argv[2])):
    with store.bake("t", {"i": i}) as w:
        for step in range(4):
            for name in ("k", "v"):
                w.put(step, "blk", name, torch.full((2, 256, 64), float(i)).half())
store.close()
"""
)

READER = (
    PRELUDE
    + """
store = ActivationStore(StoreConfig(path=path, map_size=MAP, readonly=True, host_budget_bytes=0))
seen, reads, deadline = set(), 0, time.time() + 60
Path(sys.argv[3]).touch()
while time.time() < deadline:
    try:
        with store.acquire("t") as h:
            i = h.meta["i"]
            for slot in h.slots():
                t = h.get(*slot)
                assert bool((t == i).all()), ("mixed snapshot", i, slot, t.flatten()[0].item())
            assert len(h.slots()) == 8
    except KeyError:
        time.sleep(0.001)
        continue
    seen.add(i)
    reads += 1
    if i == int(sys.argv[2]) - 1:
        break
print(json.dumps({"reads": reads, "distinct": len(seen)}))
"""
)


def run_script(tmp_path: Path, name: str, source: str, *args: str) -> subprocess.Popen:
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_writer_killed_mid_bake_leaves_no_partial_template(tmp_path: Path) -> None:
    path = tmp_path / "c"
    store = ActivationStore(StoreConfig(path=path, map_size=MAP))
    with store.bake("other", {}) as w:
        w.put(0, "b", "k", torch.ones(8))
    store.close()
    child = run_script(tmp_path, "bake.py", BAKE_THEN_HANG, str(path))
    try:
        line = child.stdout.readline()
        assert line.strip() == "STAGED", child.stderr.read()
        with ActivationStore(StoreConfig(path=path, map_size=MAP, readonly=True)) as peek:
            assert peek.tier("t") is Tier.NONE  # staged but not committed: invisible
            assert peek.verify()["orphans"]["bakes_in_progress"] == 1
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    with ActivationStore(StoreConfig(path=path, map_size=MAP)) as store:
        assert store.tier("t") is Tier.NONE
        assert [row["key"] for row in store.ls()] == ["other"]
        report = store.verify()  # the dead writer's staging was removed on open
        assert report["corrupt"] == []
        assert report["orphans"] == {
            "orphan_generations": 0,
            "dead_staging_records": 0,
            "bakes_in_progress": 0,
        }
        assert store.stats()["file_bytes"] > 20 * 128 * 1024  # the values had reached disk
        with store.bake("t", {"function": "f"}) as w:
            for step in range(20):
                w.put(step, "blk", "k", torch.full((64, 512), float(step)))
        store.evict("t")
        with store.acquire("t") as h:
            assert torch.equal(h.get(19, "blk", "k"), torch.full((64, 512), 19.0))


@pytest.mark.slow
def test_writer_killed_at_random_moments_never_corrupts(tmp_path: Path) -> None:
    path = tmp_path / "c"
    ActivationStore(StoreConfig(path=path, map_size=MAP)).close()
    for delay in (0.9, 1.3, 1.7, 2.2):
        child = run_script(tmp_path, "writer.py", WRITER, str(path), "100000")
        try:
            child.wait(delay)
        except subprocess.TimeoutExpired:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
        with ActivationStore(StoreConfig(path=path, map_size=MAP)) as store:
            report = store.verify()
            assert report["corrupt"] == [] and report["orphans"]["orphan_generations"] == 0
            if store.tier("t") is not Tier.NONE:
                with store.acquire("t") as h:
                    i = h.meta["i"]
                    assert all(bool((h.get(*s) == i).all()) for s in h.slots())


def test_reader_process_sees_consistent_snapshots_while_another_writes(tmp_path: Path) -> None:
    path = tmp_path / "c"
    ActivationStore(StoreConfig(path=path, map_size=MAP)).close()
    rounds = "60"
    ready = str(tmp_path / "reader-ready")
    reader = run_script(tmp_path, "reader.py", READER, str(path), rounds, ready)
    writer = run_script(tmp_path, "writer.py", WRITER, str(path), rounds, ready)
    _, werr = writer.communicate(timeout=120)
    rout, rerr = reader.communicate(timeout=120)
    assert writer.returncode == 0, werr
    assert reader.returncode == 0, rerr
    result = json.loads(rout)
    # every read saw one whole generation, and the reads overlapped many commits
    assert result["distinct"] >= 2, result
    with ActivationStore(StoreConfig(path=path, map_size=MAP)) as store:
        with store.acquire("t") as h:
            assert h.meta["i"] == int(rounds) - 1
        assert store.verify()["orphans"]["orphan_generations"] == 0
