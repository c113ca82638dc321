"""The durable journal of accepted jobs: one record file per job in ``<data dir>/jobs``.

A record is written when a job is accepted (before the client hears 202) and again when it
ends; each write replaces the file atomically (temporary file, fsync, rename, fsync of the
folder), so after a crash every record is either the old or the new version, never torn.
Why a file per job rather than one append-only log: removing an expired job is unlinking
its file (no compaction), a corrupt record costs one job, not the log after it, and a
job's result (its image) is written once, with its job.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from retouch.functions.errors import RetouchError
from retouch.functions.wire.codec import as_map, pack, unpack
from retouch.functions.wire.jobs import check_job_id

log = logging.getLogger(__name__)

SUFFIX = ".job"


class RecordFolder:
    """Msgpack records on disk, one file per id, each replaced atomically (call from a
    worker thread: every method does file I/O). The job journal is one; the webhook
    delivery journal (``platform/jobs/deliveryjournal.py``) another."""

    suffix = SUFFIX
    check_id = staticmethod(check_job_id)  # the id as a safe file name, or it raises

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, job_id: str) -> Path:
        return self.root / f"{self.check_id(job_id)}{self.suffix}"

    def write(self, record: dict[str, Any]) -> None:
        """Replace the record durably."""
        final = self.path(record["id"])
        tmp = final.with_name(f".{final.name}.tmp")
        with tmp.open("wb") as f:
            f.write(pack(record))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        self._sync_folder()

    def read(self, job_id: str) -> dict[str, Any]:
        return as_map(unpack(self.path(job_id).read_bytes()))

    def delete(self, job_id: str) -> None:
        self.path(job_id).unlink(missing_ok=True)

    def load(self) -> list[dict[str, Any]]:
        """Every readable record; a corrupt one is set aside (``.corrupt``) and logged."""
        for stale in self.root.glob(f".*{self.suffix}.tmp"):  # a write cut short by a crash
            stale.unlink(missing_ok=True)
        records = []
        for path in sorted(self.root.glob(f"*{self.suffix}")):
            try:
                record = as_map(unpack(path.read_bytes()))
                if record.get("id") != path.stem:
                    raise ValueError(f"record names {record.get('id')!r}")
            except (OSError, ValueError, RetouchError) as exc:
                log.error("record %s is unreadable (%s); set aside", path, exc)
                path.rename(path.with_suffix(".corrupt"))
                continue
            records.append(record)
        return records

    def _sync_folder(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class JobJournal(RecordFolder):
    """Job records in ``<data dir>/jobs``."""

    def accept(self, record: dict[str, Any], nbytes: int) -> None:
        """Record a job just accepted (the shared journal also checks the caps of every
        gateway's jobs here; one gateway's are checked by its job store beforehand)."""
        self.write(record)
