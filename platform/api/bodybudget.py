"""The request bodies the gateway holds at once, bounded in bytes.

A body is read whole before it is decoded, its decodes may then wait for the decode budget
(``platform/api/imagegate.py``), and a caller that waits for its answer (``POST .../invoke``,
``POST /v1/images/edits``) keeps its body until it has it. Unbounded, that is connections x
``--max-body-bytes``. So each request with a body reserves its declared length
(``content-length``; ``--max-body-bytes`` when it declares none, as a chunked one) out of
the body budget before a byte of it is read, and holds it until it is answered. A request
that does not fit is refused at once, nothing read: ``429 too_many_bodies``. A durable job's
payload, once accepted, is bounded by the retention caps instead (``platform/jobs/retention.py``).
Images the gateway fetches for a request (``platform/api/remoteinputs.py``) reserve their bound
(``--max-body-bytes`` each) the same way, before they are fetched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from starlette.requests import Request

from retouch.functions.errors import Overloaded
from retouch.runtime import requestparams

RETRY_AFTER_S = 1  # bodies in flight are answered within seconds


@dataclass
class BodyBudget:
    """A byte count of the request bodies held now, refused past ``capacity``. A body above
    the whole capacity reserves all of it (it is then held alone)."""

    capacity: int
    in_use: int = 0
    peak: int = 0  # the most held at once since start
    refused: int = 0  # requests refused for want of room, since start

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise ValueError(f"body budget must be positive, got {self.capacity}")

    @contextlib.contextmanager
    def hold(self, request: Request, max_body: int) -> Iterator[None]:
        """Hold ``request``'s body's share while the block runs, or raise a 429 at once."""
        declared = request.headers.get("content-length")
        nbytes = requestparams.integer(declared, "content-length", 0, 2**62, max_body)
        with self.reserve(min(nbytes, max_body)):
            yield

    @contextlib.contextmanager
    def reserve(self, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` while the block runs (a body, or the images fetched for one), or
        raise a 429 at once."""
        nbytes = min(nbytes, self.capacity)
        if self.in_use + nbytes > self.capacity:
            self.refused += 1
            raise Overloaded(
                "the gateway holds as many request bodies as it may; retry shortly",
                code="too_many_bodies",
                retry_after_s=RETRY_AFTER_S,
            )
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)
        try:
            yield
        finally:
            self.in_use -= nbytes
