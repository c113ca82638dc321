"""The durable journal of pending webhook deliveries: one record file per delivery in
``<data dir>/webhooks``, written like job records (atomically replaced, fsynced).

A delivery is written before its first attempt and removed once it is delivered or given
up, so whatever is in the folder at start is what a crash left undelivered: the webhook
sender resumes each of them. A ``completed`` delivery is written before its job's final
record (see ``JobStore._finish``), so a job that ended always has its delivery on disk or
already made.
"""

from __future__ import annotations

import re
from typing import Any

from retouch.platform.jobs.journal import RecordFolder

# ``<job id>-<event id>``, or ``<job id>-completed`` (a job completes once, whatever its id)
DELIVERY_ID = re.compile(r"[0-9a-f]{32}-(?:[0-9]{1,18}|completed)")


def check_delivery_id(raw: str) -> str:
    if not DELIVERY_ID.fullmatch(raw):
        raise ValueError(f"not a webhook delivery id: {raw!r}")
    return raw


class DeliveryJournal(RecordFolder):
    """Pending delivery records (call from a worker thread: every method does file I/O)."""

    suffix = ".delivery"
    check_id = staticmethod(check_delivery_id)

    def load(self) -> list[dict[str, Any]]:
        """Every pending record, oldest first (the order they are resumed in)."""
        records = super().load()
        records.sort(key=lambda r: (float(r.get("created_at", 0.0)), str(r["id"])))
        return records
