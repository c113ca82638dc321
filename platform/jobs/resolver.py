"""Host name lookups for webhook targets: on threads of their own, each with a deadline, and
at most a few at a time per tenant.

``getaddrinfo`` holds a thread until the system resolver answers, which for a name whose
servers do not answer takes tens of seconds. On asyncio's default pool such lookups would
stall the journal writes and image decodes that share it, for every tenant. Here they run
on a small pool used for nothing else, and a caller stops waiting after ``timeout_s``. A
tenant holds at most ``per_tenant`` of the threads (its further lookups wait, within their
deadline), counted until a lookup really ends rather than when its caller stops waiting
(a blocked thread cannot be interrupted), so one tenant's slow names leave threads for the
others.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from concurrent.futures import Future, ThreadPoolExecutor

from retouch.functions.errors import Unavailable

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

RESOLVER_THREADS = 8
RESOLVER_PER_TENANT = 2  # lookups of one tenant holding a thread at once
RESOLVER_TIMEOUT_S = 5.0


class Resolver:
    """Resolves host names on its own pool; ``close()`` when done."""

    def __init__(
        self,
        threads: int = RESOLVER_THREADS,
        per_tenant: int = RESOLVER_PER_TENANT,
        timeout_s: float = RESOLVER_TIMEOUT_S,
    ) -> None:
        self.per_tenant = per_tenant
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="resolve")
        self._shares: dict[str, asyncio.Semaphore] = {}  # per tenant: threads it may hold

    async def resolve(self, host: str, tenant: str, field: str = "webhook") -> list[Address]:
        """``host``'s addresses (none if it does not resolve or is not a valid name), as
        one of ``tenant``'s lookups; 503 ``webhook_lookup_timeout`` (another ``field``'s:
        ``lookup_timeout``) if no answer came within the deadline, the wait for the
        tenant's share included."""
        share = self._shares.setdefault(tenant, asyncio.Semaphore(self.per_tenant))
        try:
            async with asyncio.timeout(self.timeout_s):
                await share.acquire()
                return await asyncio.wrap_future(self._start(host, share))
        except TimeoutError:
            raise Unavailable(
                f"{field} host {host!r} did not resolve within {self.timeout_s:g} s",
                field=field,
                code="webhook_lookup_timeout" if field == "webhook" else "lookup_timeout",
            ) from None

    def _start(self, host: str, share: asyncio.Semaphore) -> Future[list[Address]]:
        """The lookup on a pool thread; ``share`` (acquired) is released when it ends."""
        loop = asyncio.get_running_loop()
        try:
            lookup = self._pool.submit(_addresses, host)
        except BaseException:
            share.release()
            raise

        def ended(_: Future[list[Address]]) -> None:  # on the lookup's thread
            with contextlib.suppress(RuntimeError):  # the loop is gone: nothing to release
                loop.call_soon_threadsafe(share.release)

        lookup.add_done_callback(ended)
        return lookup

    def close(self) -> None:
        """Stop taking lookups; one still blocked in the system resolver ends on its own."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _addresses(host: str) -> list[Address]:
    """The distinct addresses ``host`` resolves to. ``getaddrinfo`` raises ``OSError`` for a
    name that does not resolve and ``UnicodeError`` (a ``ValueError``) for one IDNA refuses
    (an empty label, a label over 63 characters): both are a name with no address."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return []
    out: list[Address] = []
    for info in infos:
        with contextlib.suppress(ValueError):
            out.append(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]))
    return list(dict.fromkeys(out))
