"""The shared state store: PostgreSQL, for several gateways behind one Service.

One gateway keeps its registry, job journal and webhook deliveries in files in its data
dir (``platform/state/registry.py``, ``platform/jobs/journal.py``). Several gateways keep them here
instead (``retouch serve --state-store postgresql://…``), each behind the same interface
(``platform/state/sharedregistry.py``, ``platform/jobs/sharedjournal.py``), so any gateway can read
any job and a survivor re-runs what a dead gateway had accepted.

Which gateway runs a job is a column of its row (``gateway``). Every gateway stamps its
own row in ``retouch_gateways`` every :data:`HEARTBEAT_S`; a gateway whose stamp is older
than ``ttl_s`` is dead, and its unfinished jobs and pending deliveries are taken by
another (``claim``). Liveness is the database's clock, never a gateway's, so a gateway
with a skewed clock neither dies early nor lives forever (job times, as on one gateway,
are the clock of the gateway that records them). A gateway stamps itself on a connection
of its own, so a burst of requests cannot hold up its heartbeat past the TTL. A gateway id
is new at every start: a restarted gateway is a new gateway, and takes its old jobs back as
any survivor would.

The generated secrets that every gateway must share (upload ids, webhook signing, result
links) are kept here too, made once by whichever gateway starts first.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger(__name__)


class StoreUnavailable(OSError):
    """The shared store did not answer (a connection lost, the pool's wait passed): an
    ``OSError``, as a failed write of the file journal is, so callers handle both alike."""


HEARTBEAT_S = 1.0  # how often a gateway stamps its row and looks for orphans
DEFAULT_TTL_S = 10.0  # a gateway silent this long is dead: its jobs are re-run elsewhere
POOL_SIZE = 8
SCHEMA_LOCK = 0x7265746F  # "reto": serialises schema creation among starting gateways
NOW = "extract(epoch from clock_timestamp())"

SCHEMA = """
CREATE TABLE IF NOT EXISTS retouch_gateways (
    id text PRIMARY KEY,
    seen double precision NOT NULL
);
CREATE TABLE IF NOT EXISTS retouch_jobs (
    id text PRIMARY KEY,
    tenant text NOT NULL,
    function text NOT NULL,
    gateway text NOT NULL,
    status text NOT NULL,
    created_at double precision NOT NULL,
    completed_at double precision,
    bytes bigint NOT NULL,
    cancel_requested boolean NOT NULL DEFAULT false,
    record bytea NOT NULL,
    summary bytea NOT NULL
);
CREATE INDEX IF NOT EXISTS retouch_jobs_by_tenant ON retouch_jobs (tenant, created_at DESC, id);
CREATE INDEX IF NOT EXISTS retouch_jobs_live ON retouch_jobs (gateway)
    WHERE status IN ('queued', 'running');
CREATE TABLE IF NOT EXISTS retouch_deliveries (
    id text PRIMARY KEY,
    gateway text NOT NULL,
    created_at double precision NOT NULL,
    record bytea NOT NULL
);
CREATE SEQUENCE IF NOT EXISTS retouch_revision;
CREATE TABLE IF NOT EXISTS retouch_functions (
    name text PRIMARY KEY,
    revision bigint NOT NULL,
    deleted boolean NOT NULL DEFAULT false,
    spec text,
    templates bytea
);
CREATE TABLE IF NOT EXISTS retouch_secrets (
    name text PRIMARY KEY,
    value bytea NOT NULL
);
"""


class StateStore:
    """A pool of connections to the shared PostgreSQL, this gateway's id and liveness.
    Every method blocks (call it from a worker thread, as the journals' callers do)."""

    def __init__(self, url: str, ttl_s: float = DEFAULT_TTL_S, pool_size: int = POOL_SIZE):
        self.url = url
        self.ttl_s = ttl_s
        self.gateway = f"gw-{uuid.uuid4().hex[:12]}"
        try:
            from psycopg_pool import ConnectionPool  # the postgres extra, only when used
        except ImportError:
            raise ConnectionError(
                "--state-store needs PostgreSQL's driver: pip install 'retouch[postgres]'"
            ) from None
        options = {"autocommit": True}
        self._pool = ConnectionPool(
            url, min_size=1, max_size=pool_size, open=False, kwargs=options, timeout=ttl_s
        )
        # the heartbeat's own connection: never waits behind the others
        self._beat = ConnectionPool(
            url, min_size=1, max_size=1, open=False, kwargs=options, timeout=ttl_s
        )

    def open(self, timeout_s: float = 30.0) -> StateStore:
        """Connect (waiting up to ``timeout_s`` for the server), create the tables a first
        gateway needs, and stamp this gateway alive."""
        try:
            self._pool.open(wait=True, timeout=timeout_s)
            self._beat.open(wait=True, timeout=timeout_s)
        except Exception as exc:  # the pool's own timeout, a refused or unknown host
            raise ConnectionError(
                f"cannot reach the state store {redact(self.url)}: {exc}"
            ) from None
        with self.transaction() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
            cur.execute(SCHEMA)
        self.heartbeat()
        log.info("state store %s: this gateway is %s", redact(self.url), self.gateway)
        return self

    def close(self) -> None:
        self._pool.close()
        self._beat.close()

    @contextmanager
    def cursor(self) -> Iterator[psycopg.Cursor]:
        """A cursor in autocommit mode: each statement is its own transaction. A database
        error comes out as :class:`StoreUnavailable`; the caller's own exceptions as they are."""
        with _unavailable(), self._pool.connection() as conn, conn.cursor() as cur:
            yield cur

    @contextmanager
    def transaction(self) -> Iterator[psycopg.Cursor]:
        """A cursor whose statements commit together (or roll back on an exception)."""
        with (
            _unavailable(),
            self._pool.connection() as conn,
            conn.transaction(),
            conn.cursor() as cur,
        ):
            yield cur

    # ---- liveness ------------------------------------------------------------------------
    def heartbeat(self) -> None:
        """Stamp this gateway alive (the database's clock), on its own connection."""
        with _unavailable(), self._beat.connection() as conn, conn.cursor() as cur:
            cur.execute(
                f"INSERT INTO retouch_gateways (id, seen) VALUES (%s, {NOW}) "
                f"ON CONFLICT (id) DO UPDATE SET seen = {NOW}",
                (self.gateway,),
            )

    def leave(self) -> None:
        """A gateway stopping cleanly says so: its unfinished jobs are taken at once."""
        with self.cursor() as cur:
            cur.execute("DELETE FROM retouch_gateways WHERE id = %s", (self.gateway,))

    def dead_gateways_sql(self) -> str:
        """A condition on a row's ``gateway`` column: that gateway is not alive."""
        return (
            "gateway <> %(me)s AND gateway NOT IN (SELECT id FROM retouch_gateways "
            f"WHERE seen > {NOW} - %(ttl)s)"
        )

    def renew(self) -> None:
        """Become a new gateway: after losing the store for longer than the TTL, this
        gateway's jobs may be another's now, and those still named for it are left to be
        claimed as a dead gateway's (by any gateway, this one included)."""
        old, self.gateway = self.gateway, f"gw-{uuid.uuid4().hex[:12]}"
        log.warning("state store: was %s, lost for longer than the TTL; now %s", old, self.gateway)

    def alive_gateways(self) -> list[str]:
        with self.cursor() as cur:
            cur.execute(
                f"SELECT id FROM retouch_gateways WHERE seen > {NOW} - %s ORDER BY id",
                (self.ttl_s,),
            )
            return [row[0] for row in cur.fetchall()]

    # ---- shared secrets ------------------------------------------------------------------
    def secret(self, name: str, nbytes: int = 32) -> bytes:
        """The secret ``name`` every gateway shares: made by the first gateway to ask."""
        with self.cursor() as cur:
            cur.execute(
                "INSERT INTO retouch_secrets (name, value) VALUES (%s, %s) "
                "ON CONFLICT (name) DO NOTHING",
                (name, secrets.token_bytes(nbytes)),
            )
            cur.execute("SELECT value FROM retouch_secrets WHERE name = %s", (name,))
            return bytes(cur.fetchone()[0])


@contextmanager
def _unavailable() -> Iterator[None]:
    """Database errors as :class:`StoreUnavailable` (its cause kept)."""
    import psycopg

    try:
        yield
    except psycopg.Error as exc:
        raise StoreUnavailable(f"the state store failed: {exc}") from exc


def redact(url: str) -> str:
    """The URL without its password, for logs and errors."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    userinfo, _, host = rest.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"
