"""Integrity of the disk tier: checksum verification, orphaned values and the partial
bakes of dead writers, and the garbage collection that removes them.

Each function works inside a transaction the caller owns (the collecting ones inside a
write transaction on the writer thread).
"""

from __future__ import annotations

from typing import Any

import lmdb

from retouch.cachestore.codec import check_value
from retouch.cachestore.diskenv import DiskEnv, decode_or_none, entry_header, writer_alive
from retouch.cachestore.errors import CorruptValue
from retouch.cachestore.layout import gen_key, value_key


def new_report() -> dict[str, Any]:
    """The counters and lists :func:`verify_template` fills in."""
    return {"templates": 0, "values": 0, "bytes": 0, "corrupt": [], "invalid": []}


def verify_template(
    env: DiskEnv, txn: lmdb.Transaction, key: str, raw: memoryview, report: dict[str, Any]
) -> dict[str, Any] | None:
    """Check one template inside ``txn``; returns a problem record or None."""
    manifest = decode_or_none(raw)
    if manifest is None:
        return {"key": key, "reason": "undecodable manifest"}
    if not manifest.valid:
        report["invalid"].append(key)
        return None
    report["templates"] += 1
    for entry in manifest.entries:
        value = txn.get(value_key(manifest.gen, *entry.slot), db=env.values)
        try:
            header = entry_header(value, entry, check_value)
        except CorruptValue as exc:
            step, block, name = entry.slot
            return {"key": key, "reason": str(exc), "step": step, "block": block, "name": name}
        report["values"] += 1
        report["bytes"] += header.nbytes
    return None


def orphan_report(env: DiskEnv) -> dict[str, int]:
    """Generations holding values that no manifest or live bake refers to."""
    with env.begin() as txn:
        scan = env.scan(txn)
        live = {m.gen for m in scan.manifests.values()}
        staging = env.staging_records(txn)
        live |= {gen for gen, rec in staging if writer_alive(rec)}
        orphans = [gen for gen in env.value_gens(txn) if gen not in live]
        dead = sum(1 for gen, rec in staging if not writer_alive(rec))
    return {
        "orphan_generations": len(orphans),
        "dead_staging_records": dead,
        "bakes_in_progress": len(staging) - dead,
    }


def remove_dead_bakes(env: DiskEnv, txn: lmdb.Transaction) -> int:
    """Remove generations staged by writers that died before committing; returns how many."""
    dead = [gen for gen, rec in env.staging_records(txn) if not writer_alive(rec)]
    for gen in dead:
        env.drop_staging(txn, gen)
    return len(dead)


def collect_garbage(env: DiskEnv, txn: lmdb.Transaction) -> int:
    """Remove invalid and broken templates, dead writers' staging records and values no
    live generation owns; returns the bytes freed."""
    scan = env.scan(txn)
    freed = 0
    for key, manifest in list(scan.manifests.items()):
        if not manifest.valid:
            freed += env.delete_template(txn, key, manifest)
    for key in scan.broken:
        freed += env.delete_template(txn, key, None)
    live = {m.gen for m in scan.manifests.values() if m.valid}
    for gen, rec in env.staging_records(txn):
        if writer_alive(rec):
            live.add(gen)
        else:
            txn.delete(gen_key(gen), db=env.staging)
    for gen in list(env.value_gens(txn)):
        if gen not in live:
            freed += env.delete_gen(txn, gen)
    return freed
