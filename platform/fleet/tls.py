"""The one TLS context that every outgoing HTTP client of a process shares.

httpx builds a new ``ssl.SSLContext`` for each client it creates (``httpx.Client()``, and
each module-level ``httpx.get``), loading certifi's CA bundle every time: about 60 ms of
CPU on a 2-core VM, against 0.14 ms for a client given a context built once. A readiness
poll every 0.1 s with a new client each time kept about 0.4 of a core busy while the
server it waited for was starting on the same machine; every CLI command, executor link,
remote input fetch and webhook sender paid it too. Every ``httpx`` client in ``platform``
passes ``verify=tls_context()``.

The context is httpx's own default (``httpx.create_ssl_context``: ``SSL_CERT_FILE`` or
``SSL_CERT_DIR`` when set, else certifi's bundle), built on first use and then only read:
an ``SSLContext`` may be shared by threads and clients as long as nobody configures it
further.
"""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    """This process's context for verifying the servers it calls over HTTPS."""
    return httpx.create_ssl_context()
