"""Allow-lists of the hosts the gateway may connect to on a client's behalf, and the
connection to a checked address.

Webhook targets (``--webhook-allow``) and remote ``image``/``mask`` inputs
(``--fetch-allow``) name URLs the gateway connects to: a client must not make it reach
hosts inside the server's network (or cloud metadata addresses). Entries are host names
(exact) or IP networks (``10.0.0.0/8``, ``192.168.1.7``); a name not listed must resolve
only to addresses inside a listed network. The check is the connection's: the host is
resolved once (``platform/jobs/resolver.py``: threads of its own, a deadline, a share per
tenant), every address checked, and the request sent to a checked address with the URL's
``Host`` and TLS server name (:func:`pinned`), so a name cannot resolve elsewhere between
the check and the connection.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from retouch.functions.errors import BadRequest
from retouch.functions.wire.jobs import parse_target_url
from retouch.platform.jobs.resolver import Address, Resolver

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class AllowList:
    """Hosts the server may connect to: host names and IP networks. ``option`` names the
    setting in refusals, ``code`` is theirs."""

    hosts: frozenset[str] = frozenset({"localhost"})
    networks: tuple[Network, ...] = (
        ipaddress.ip_network("127.0.0.0/8"),
        ipaddress.ip_network("::1/128"),
    )
    option: str = "--webhook-allow"
    code: str = "webhook_not_allowed"

    @classmethod
    def parse(
        cls,
        entries: Iterable[str],
        option: str = "--webhook-allow",
        code: str = "webhook_not_allowed",
    ) -> AllowList:
        hosts, networks = set(), []
        for entry in (e.strip() for e in entries):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                hosts.add(entry.lower().rstrip("."))
        return cls(frozenset(hosts), tuple(networks), option, code)

    def describe(self) -> list[str]:
        return sorted(self.hosts) + [str(n) for n in self.networks]

    async def check(
        self, raw: str, resolver: Resolver, tenant: str, field: str = "webhook"
    ) -> None:
        """At submission: refuse (400 ``code`` on ``field``) a target outside; a listed
        name passes without resolving (it may resolve later)."""
        url = parse_target_url(raw, field)
        if host_of(url) not in self.hosts:
            await self.addresses(url, resolver, tenant, field)

    async def addresses(
        self, url: httpx.URL, resolver: Resolver, tenant: str, field: str = "webhook"
    ) -> list[Address]:
        """The addresses a connection may go to, resolved once (as ``tenant``'s lookup)
        and each checked: a listed name's, or a literal's or unlisted name's that are all
        inside a listed network (else 400 ``code`` on ``field``)."""
        host = host_of(url)
        try:
            addresses: list[Address] = [ipaddress.ip_address(host)]
        except ValueError:
            addresses = await resolver.resolve(host, tenant, field)
            if host in self.hosts:
                return addresses
        if addresses and all(any(a in n for n in self.networks) for a in addresses):
            return addresses
        raise BadRequest(
            f"{field} host {host!r} is not in the server's allow-list "
            f"({', '.join(self.describe()) or 'empty'}); see retouch serve {self.option}",
            field=field,
            code=self.code,
        )


def host_of(url: httpx.URL) -> str:
    """The URL's host in ASCII (IDNA), lowercase, without a trailing dot."""
    return url.raw_host.decode("ascii").lower().rstrip(".")


def pinned(url: httpx.URL, address: Address) -> tuple[httpx.URL, dict[str, str], dict[str, Any]]:
    """A request to ``address`` (a checked one) as if to the URL's host: the URL to send to,
    the ``Host`` header and the TLS server name (so certificates are still checked against
    the host) — the socket goes to the address, nothing resolves the name again."""
    headers = {"host": url.netloc.decode("ascii")}
    extensions = {"sni_hostname": host_of(url)} if url.scheme == "https" else {}
    return url.copy_with(host=str(address)), headers, extensions
