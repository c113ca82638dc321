"""The function registry in the shared state store: what every gateway serves.

The file registry's interface (``platform/state/registry.py``'s ``FunctionRegistry``), one row
per function name in ``retouch_functions``. Every put and delete takes the next value of
one database sequence as its revision: the generation the executors order operations on
a name by, the same number whichever gateway made the change. A delete leaves its row as
a tombstone (``deleted``), so a gateway following the changes (:meth:`changes`) sees it.
Registry writes hold one advisory lock from taking their revision to their commit, so
revisions commit in order and a follower that has read revision *n* never later meets a
smaller one it skipped.
"""

from __future__ import annotations

import json
import logging

from retouch.functions.errors import RetouchError
from retouch.functions.spec import FunctionSpec, parse_spec
from retouch.functions.wire.codec import as_map, pack, unpack
from retouch.platform.state.registry import Changes, StoredFunction
from retouch.platform.state.statestore import StateStore

log = logging.getLogger(__name__)

REGISTRY_LOCK = 0x72657432  # serialises registry writes: revisions commit in their order


class SharedRegistry:
    """Functions in ``retouch_functions`` (every method blocks: call from a worker thread)."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    def put(self, spec: FunctionSpec, templates: dict[str, bytes]) -> int:
        with self.store.transaction() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (REGISTRY_LOCK,))
            cur.execute(
                "INSERT INTO retouch_functions (name, revision, deleted, spec, templates) "
                "VALUES (%s, nextval('retouch_revision'), false, %s, %s) "
                "ON CONFLICT (name) DO UPDATE SET revision = EXCLUDED.revision, "
                "deleted = false, spec = EXCLUDED.spec, templates = EXCLUDED.templates "
                "RETURNING revision",
                (spec.name, json.dumps(spec.to_dict()), pack(templates)),
            )
            return int(cur.fetchone()[0])

    def delete(self, name: str) -> int | None:
        with self.store.transaction() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (REGISTRY_LOCK,))
            cur.execute(
                "UPDATE retouch_functions SET revision = nextval('retouch_revision'), "
                "deleted = true, spec = NULL, templates = NULL "
                "WHERE name = %s AND NOT deleted RETURNING revision",
                (name,),
            )
            row = cur.fetchone()
            return None if row is None else int(row[0])

    def load_all(self) -> dict[str, StoredFunction]:
        return {s.spec.name: s for s in self.changes(0).stored}

    def changes(self, after: int) -> Changes:
        """Functions stored and deleted with a revision above ``after``."""
        with self.store.cursor() as cur:
            cur.execute(
                "SELECT name, revision, deleted, spec, templates FROM retouch_functions "
                "WHERE revision > %s ORDER BY revision",
                (after,),
            )
            rows = cur.fetchall()
        stored, deleted, latest = [], [], after
        for name, revision, gone, spec, templates in rows:
            latest = max(latest, int(revision))
            if gone:
                deleted.append((name, int(revision)))
                continue
            try:
                pngs = {str(k): bytes(v) for k, v in as_map(unpack(bytes(templates))).items()}
                stored.append(StoredFunction(parse_spec(json.loads(spec)), pngs, int(revision)))
            except (ValueError, TypeError, RetouchError) as exc:  # e.g. a newer gateway's spec
                log.error("function %s (revision %d) is unreadable here: %s", name, revision, exc)
        return Changes(stored, deleted, latest)
