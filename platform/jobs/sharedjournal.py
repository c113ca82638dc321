"""The job journal and the webhook delivery journal in the shared state store.

The same records as the files of ``platform/jobs/journal.py`` (msgpack maps, the job's
``to_record``), one row each, with the columns the gateways query beside them: whose the
job is (``tenant``), which gateway runs it (``gateway``), its status and bytes.

Exactly once: a gateway writes a job's row only while the row names it and the job has not
ended (:meth:`SharedJobJournal.write` is fenced), so when a gateway thought dead is taken
over, its late writes are refused (:class:`TakenOver`) and only the new runner's end
counts. The caps on live jobs and retained bytes are checked against every gateway's rows
in the transaction that inserts a job (:meth:`SharedJobJournal.accept`), under one
advisory lock, so two gateways cannot both admit a tenant's last allowed job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from retouch.functions.wire.codec import as_map, pack, unpack
from retouch.functions.wire.jobs import JobRequest
from retouch.platform.jobs.retention import (
    JOB_OVERHEAD_BYTES,
    LIVE_RETRY_AFTER_S,
    RetentionLimits,
    Usage,
    refuse_beyond_caps,
    slim_request,
)
from retouch.platform.state.statestore import NOW, StateStore

log = logging.getLogger(__name__)

LIVE = ("queued", "running")
ADMIT_LOCK = 0x72657431  # serialises admissions (cap checks and inserts) of all gateways
CLAIM_BATCH = 64


class TakenOver(OSError):
    """This gateway's write was refused: another gateway runs the job now (or it ended)."""


@dataclass(frozen=True)
class StoredJob:
    """A job's record as the store has it, and its status column: ``running`` once the
    gateway that runs it started it (the record itself is written at acceptance and end)."""

    record: dict[str, Any]
    status: str


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """The record without its payload and result image: what listings read (a page of a
    thousand jobs is a page of small records, whatever their images weigh)."""
    out = dict(record)
    request = JobRequest.from_wire(record["request"])
    out["request"] = slim_request(request, request.invoke.template or "").to_wire()
    if isinstance(record.get("result"), dict):
        out["result"] = {**record["result"], "image": b""}
    return out


class SharedJobJournal:
    """Job records in ``retouch_jobs`` (every method blocks: call it from a worker thread,
    as the job store does with the file journal)."""

    def __init__(self, store: StateStore, limits: RetentionLimits, retention_s: float) -> None:
        self.store = store
        self.limits = limits
        self.retention_s = retention_s

    # ---- the file journal's interface ---------------------------------------------------
    def accept(self, record: dict[str, Any], nbytes: int) -> None:
        """Insert a new job run by this gateway, if every gateway's jobs together leave
        room for it under the caps (else 429, as one gateway would answer)."""
        tenant = str(record.get("owner", ""))
        with self.store.transaction() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (ADMIT_LOCK,))
            usage = {None: self._usage(cur, None), tenant: self._usage(cur, tenant)}
            refuse_beyond_caps(
                self.limits,
                tenant,
                nbytes - JOB_OVERHEAD_BYTES,
                usage.__getitem__,
                lambda who, _usage, _needed: self._until_freed(cur, who),
            )
            cur.execute(
                "INSERT INTO retouch_jobs (id, tenant, function, gateway, status, created_at, "
                "completed_at, bytes, record, summary) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (
                    record["id"],
                    tenant,
                    record["function"],
                    self.store.gateway,
                    record["status"],
                    record["created_at"],
                    record.get("completed_at"),
                    nbytes,
                    pack(record),
                    pack(summary(record)),
                ),
            )

    def write(self, record: dict[str, Any], nbytes: int | None = None) -> None:
        """Replace the record of a job this gateway runs; :class:`TakenOver` when the
        row names another gateway now, or the job already ended."""
        data = pack(record)
        with self.store.cursor() as cur:
            cur.execute(
                "UPDATE retouch_jobs SET status = %s, completed_at = %s, record = %s, "
                "summary = %s, bytes = %s "
                "WHERE id = %s AND gateway = %s AND status IN ('queued', 'running')",
                (
                    record["status"],
                    record.get("completed_at"),
                    data,
                    pack(summary(record)),
                    nbytes if nbytes is not None else JOB_OVERHEAD_BYTES + len(data),
                    record["id"],
                    self.store.gateway,
                ),
            )
            if cur.rowcount == 0:
                raise TakenOver(f"job {record['id']} is no longer this gateway's to write")

    def read(self, job_id: str) -> dict[str, Any]:
        """The job's record, whichever gateway runs or ran it (``FileNotFoundError`` when
        there is none, as the file journal)."""
        stored = self.fetch(job_id)
        if stored is None:
            raise FileNotFoundError(job_id)
        return stored.record

    def fetch(self, job_id: str) -> StoredJob | None:
        """The job's record and status column (None: no such job)."""
        with self.store.cursor() as cur:
            cur.execute("SELECT record, status FROM retouch_jobs WHERE id = %s", (job_id,))
            row = cur.fetchone()
        return None if row is None else StoredJob(_unpack(row[0]), row[1])

    def delete(self, job_id: str) -> None:
        """Remove an ended job (a live one's row stays: another gateway may run it)."""
        with self.store.cursor() as cur:
            cur.execute(
                "DELETE FROM retouch_jobs WHERE id = %s AND status NOT IN ('queued', 'running')",
                (job_id,),
            )

    def mark_running(self, job_id: str) -> None:
        """The job this gateway runs has started (listings filter on it; others show it)."""
        with self.store.cursor() as cur:
            cur.execute(
                "UPDATE retouch_jobs SET status = 'running' "
                "WHERE id = %s AND gateway = %s AND status = 'queued'",
                (job_id, self.store.gateway),
            )

    def owns(self, job_id: str) -> bool:
        """Whether this gateway still runs the job (nobody took it over, it has not ended)."""
        with self.store.cursor() as cur:
            cur.execute(
                "SELECT 1 FROM retouch_jobs WHERE id = %s AND gateway = %s "
                "AND status IN ('queued', 'running')",
                (job_id, self.store.gateway),
            )
            return cur.fetchone() is not None

    def taken(self, job_ids: list[str]) -> list[str]:
        """Of the jobs this gateway runs, those whose rows name another gateway now (taken
        over while this one was thought dead) or are gone."""
        if not job_ids:
            return []
        with self.store.cursor() as cur:
            cur.execute(
                "SELECT id FROM retouch_jobs WHERE id = ANY(%s) AND gateway = %s",
                (job_ids, self.store.gateway),
            )
            still = {r[0] for r in cur.fetchall()}
        return [i for i in job_ids if i not in still]

    def release(self, job_id: str) -> None:
        """Give a claimed job back (it could not be taken up here): it names no living
        gateway, so the next claim, of any gateway, takes it."""
        with self.store.cursor() as cur:
            cur.execute(
                "UPDATE retouch_jobs SET gateway = '' WHERE id = %s AND gateway = %s",
                (job_id, self.store.gateway),
            )

    def load(self) -> list[dict[str, Any]]:
        """This gateway's records: none at a start (its id is new); its old jobs come back
        through :meth:`claim`, as any dead gateway's."""
        with self.store.cursor() as cur:
            cur.execute("SELECT record FROM retouch_jobs WHERE gateway = %s", (self.store.gateway,))
            return [_unpack(r[0]) for r in cur.fetchall()]

    # ---- several gateways ---------------------------------------------------------------
    def claim(self) -> list[dict[str, Any]]:
        """Take the unfinished jobs of dead gateways (oldest first, a batch at a time):
        their rows name this gateway from now on, and this gateway runs them again."""
        with self.store.cursor() as cur:
            cur.execute(
                "UPDATE retouch_jobs SET gateway = %(me)s "
                "WHERE id IN (SELECT id FROM retouch_jobs WHERE status IN ('queued', 'running') "
                f"AND {self.store.dead_gateways_sql()} ORDER BY created_at "
                "LIMIT %(n)s FOR UPDATE SKIP LOCKED) RETURNING record, cancel_requested",
                {"me": self.store.gateway, "ttl": self.store.ttl_s, "n": CLAIM_BATCH},
            )
            rows = cur.fetchall()
        records = []
        for data, cancel in rows:
            record = _unpack(data)
            record["cancel_requested"] = bool(cancel)
            records.append(record)
        return records

    def request_cancel(self, job_id: str) -> bool:
        """Ask whichever gateway runs the job to cancel it; False when it already ended."""
        with self.store.cursor() as cur:
            cur.execute(
                "UPDATE retouch_jobs SET cancel_requested = true "
                "WHERE id = %s AND status IN ('queued', 'running')",
                (job_id,),
            )
            return cur.rowcount > 0

    def cancels(self) -> list[str]:
        """Jobs this gateway runs whose cancel another gateway was asked for."""
        with self.store.cursor() as cur:
            cur.execute(
                "SELECT id FROM retouch_jobs WHERE gateway = %s AND cancel_requested "
                "AND status IN ('queued', 'running')",
                (self.store.gateway,),
            )
            return [r[0] for r in cur.fetchall()]

    def listing(
        self,
        tenant: str | None,
        status: str | None,
        function: str | None,
        limit: int,
        before: tuple[float, str] | None,
    ) -> list[StoredJob]:
        """Every gateway's jobs, newest first (``tenant`` None: all tenants'), as their
        summaries (:func:`summary`)."""
        where, args = ["true"], []
        for column, value in (("tenant", tenant), ("status", status), ("function", function)):
            if value is not None:
                where.append(f"{column} = %s")
                args.append(value)
        if before is not None:
            where.append("(created_at, id) < (%s, %s)")
            args += [before[0], before[1]]
        with self.store.cursor() as cur:
            cur.execute(
                f"SELECT summary, status FROM retouch_jobs WHERE {' AND '.join(where)} "
                "ORDER BY created_at DESC, id DESC LIMIT %s",
                (*args, limit),
            )
            return [StoredJob(_unpack(r[0]), r[1]) for r in cur.fetchall()]

    def purge(self, cutoff: float) -> int:
        """Remove every gateway's jobs that ended before ``cutoff`` (a dead gateway's
        finished jobs expire too)."""
        with self.store.cursor() as cur:
            cur.execute(
                "DELETE FROM retouch_jobs WHERE status NOT IN ('queued', 'running') "
                "AND completed_at < %s",
                (cutoff,),
            )
            return cur.rowcount

    # ---- caps -----------------------------------------------------------------------------
    @staticmethod
    def _usage(cur: Any, tenant: str | None) -> Usage:
        where, args = ("tenant = %s", (tenant,)) if tenant is not None else ("true", ())
        cur.execute(
            "SELECT count(*) FILTER (WHERE status IN ('queued', 'running')), "
            "coalesce(sum(bytes), 0), "
            "coalesce(sum(bytes) FILTER (WHERE status NOT IN ('queued', 'running')), 0) "
            f"FROM retouch_jobs WHERE {where}",
            args,
        )
        live, retained, finished = cur.fetchone()
        return Usage(int(live), int(retained), int(finished))

    def _until_freed(self, cur: Any, tenant: str | None) -> float:
        """Seconds until the oldest finished job in scope expires (a short wait if none)."""
        where, args = ("AND tenant = %s", (tenant,)) if tenant is not None else ("", ())
        cur.execute(
            f"SELECT min(completed_at) + %s - {NOW} FROM retouch_jobs "
            f"WHERE status NOT IN ('queued', 'running') {where}",
            (self.retention_s, *args),
        )
        left = cur.fetchone()[0]
        return LIVE_RETRY_AFTER_S if left is None else max(1.0, float(left))


class SharedDeliveryJournal:
    """Pending webhook deliveries in ``retouch_deliveries``: the file delivery journal's
    interface, plus :meth:`claim` of a dead gateway's pending ones."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    def write(self, record: dict[str, Any]) -> None:
        with self.store.cursor() as cur:
            cur.execute(
                "INSERT INTO retouch_deliveries (id, gateway, created_at, record) "
                "VALUES (%s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET "
                "gateway = EXCLUDED.gateway, record = EXCLUDED.record",
                (
                    record["id"],
                    self.store.gateway,
                    float(record.get("created_at", 0.0)),
                    pack(record),
                ),
            )

    def delete(self, delivery_id: str) -> None:
        with self.store.cursor() as cur:
            cur.execute("DELETE FROM retouch_deliveries WHERE id = %s", (delivery_id,))

    def load(self) -> list[dict[str, Any]]:
        """This gateway's pending deliveries, oldest first (none at a start: new id)."""
        with self.store.cursor() as cur:
            cur.execute(
                "SELECT record FROM retouch_deliveries WHERE gateway = %s ORDER BY created_at, id",
                (self.store.gateway,),
            )
            return [_unpack(r[0]) for r in cur.fetchall()]

    def claim(self) -> list[dict[str, Any]]:
        """Take the pending deliveries of dead gateways, oldest first."""
        with self.store.cursor() as cur:
            cur.execute(
                "UPDATE retouch_deliveries SET gateway = %(me)s WHERE id IN (SELECT id FROM "
                f"retouch_deliveries WHERE {self.store.dead_gateways_sql()} "
                "ORDER BY created_at LIMIT %(n)s FOR UPDATE SKIP LOCKED) RETURNING record",
                {"me": self.store.gateway, "ttl": self.store.ttl_s, "n": CLAIM_BATCH},
            )
            records = [_unpack(r[0]) for r in cur.fetchall()]
        records.sort(key=lambda r: (float(r.get("created_at", 0.0)), str(r["id"])))
        return records


def _unpack(data: Any) -> dict[str, Any]:
    return as_map(unpack(bytes(data)))
