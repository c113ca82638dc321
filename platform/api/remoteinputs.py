"""Remote inputs: an ``image`` or ``mask`` given as an ``http(s)`` URL, fetched by the gateway.

Replicate's and fal's users pass images as URLs. Fetching one is a connection the gateway
makes on a client's behalf, so it is **off** unless the operator lists the hosts it may
reach (``retouch serve --fetch-allow``), checked exactly as webhook targets are
(``platform/jobs/allowlist.py``: resolved once, every address checked, the request sent to a
checked address). A fetch follows no redirect, must answer 2xx, uncompressed, within
``timeout_s`` in all, and send at most ``max_bytes`` (what any request body may hold); the bytes then go where the
request's own bytes would, through the same decoding and checks. A job journals the
fetched bytes with its request, so a resumed job never fetches again.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx

from retouch.functions.errors import BadRequest, PayloadTooLarge, Unavailable
from retouch.functions.wire.jobs import parse_target_url
from retouch.platform.api.bodybudget import BodyBudget
from retouch.platform.fleet.tls import tls_context
from retouch.platform.jobs.allowlist import AllowList, pinned
from retouch.platform.jobs.resolver import Resolver

URL_FIELDS = ("image", "mask")
DEFAULT_TIMEOUT_S = 10.0


def is_url(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(("http://", "https://"))


class InputFetcher:
    """Replaces URL-valued ``image``/``mask`` fields of a request body by their bytes."""

    def __init__(
        self,
        allow: AllowList | None,
        max_bytes: int,
        bodies: BodyBudget,
        resolver: Resolver | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.allow = allow  # None: fetching is off
        self.max_bytes = max_bytes
        self.bodies = bodies  # fetched bytes count as body bytes while the request is held
        self.resolver = resolver or Resolver()  # the gateway's one, shared with webhooks
        self.timeout_s = timeout_s
        self._http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        self._http = httpx.AsyncClient(
            timeout=self.timeout_s, follow_redirects=False, verify=tls_context()
        )

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    async def inline(self, body: Any, tenant: str, held: contextlib.ExitStack) -> Any:
        """``body`` with each URL in ``image``/``mask`` replaced by the bytes it names, or in
        its ``input`` (a prediction's); a body that is not a map is left for the request
        parser to refuse. Each fetch reserves its bound (``max_bytes``) in the body budget
        first, held in ``held`` (the request's own stack: until it is answered)."""
        if not isinstance(body, dict):
            return body
        if isinstance(body.get("input"), dict):  # a Replicate prediction's arguments
            return body | {"input": await self.inline(body["input"], tenant, held)}
        urls = {f: body[f] for f in URL_FIELDS if is_url(body.get(f))}
        if not urls:
            return body
        if self.allow is None:
            field = next(iter(urls))
            raise BadRequest(
                f"{field} is a URL, and this server fetches none (retouch serve --fetch-allow); "
                "send the image's bytes (base64 or a data: URI in JSON)",
                field=field,
                code="fetch_disabled",
            )
        held.enter_context(self.bodies.reserve(self.max_bytes * len(urls)))
        return body | {f: await self.fetch(url, f, tenant) for f, url in urls.items()}

    async def fetch(self, raw: str, field: str, tenant: str) -> bytes:
        """The bytes at ``raw``, fetched from a checked address of an allow-listed host."""
        assert self.allow is not None and self._http is not None
        url = parse_target_url(raw, field)
        addresses = await self.allow.addresses(url, self.resolver, tenant, field)
        if not addresses:
            raise BadRequest(f"{field} host does not resolve", field=field, code="fetch_failed")
        failure: Exception | None = None
        try:
            async with asyncio.timeout(self.timeout_s):  # the whole fetch, not each read
                for address in addresses:
                    target, headers, extensions = pinned(url, address)
                    try:
                        return await self._get(target, headers, extensions, field)
                    except httpx.ConnectError as exc:  # the next checked address, if any
                        failure = exc
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise Unavailable(
                f"{field}: {url.host} did not answer within {self.timeout_s:g} s",
                field=field,
                code="fetch_timeout",
            ) from exc
        except httpx.HTTPError as exc:  # a broken answer: protocol error, reset, ...
            raise BadRequest(
                f"{field}: the fetch failed: {type(exc).__name__}: {exc}",
                field=field,
                code="fetch_failed",
            ) from exc
        raise BadRequest(f"{field}: cannot connect: {failure}", field=field, code="fetch_failed")

    async def _get(
        self, target: httpx.URL, headers: dict[str, str], extensions: dict[str, Any], field: str
    ) -> bytes:
        assert self._http is not None
        # identity: the size bound holds for the bytes sent, not for what they inflate to
        headers = headers | {"user-agent": "retouch-fetch", "accept-encoding": "identity"}
        request = self._http.build_request("GET", target, headers=headers, extensions=extensions)
        resp = await self._http.send(request, stream=True)
        try:
            if not 200 <= resp.status_code < 300:
                raise BadRequest(
                    f"{field}: the URL answered HTTP {resp.status_code}",
                    field=field,
                    code="fetch_failed",
                )
            chunks, size = [], 0
            if resp.headers.get("content-encoding", "identity") != "identity":
                raise BadRequest(
                    f"{field}: the URL answered with a content-encoding; fetches take identity",
                    field=field,
                    code="fetch_failed",
                )
            async for chunk in resp.aiter_raw():
                size += len(chunk)
                if size > self.max_bytes:
                    raise PayloadTooLarge(
                        f"{field}: the URL's body exceeds {self.max_bytes} bytes", field=field
                    )
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            await resp.aclose()
