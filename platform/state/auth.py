"""Bearer tokens with scopes and tenants: ``admin`` deploys and deletes, ``invoke`` invokes
and reads; every token acts for one tenant, the owner of what it submits.

Tokens come from a token file (one ``<scope> <token> [tenant]`` line each, ``#`` comments)
or the environment (``RETOUCH_ADMIN_TOKEN``, ``RETOUCH_INVOKE_TOKEN``). A token without a
tenant column is its own tenant, named by a hash of the token (never the token itself, which
would otherwise show up in job documents and logs). With no token configured the API is
open, which is only sensible on loopback (``retouch serve`` warns about it), and everything
belongs to the one tenant ``anonymous``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from retouch.functions.errors import Forbidden, InvalidSpec, Unauthorized

SCOPES = ("admin", "invoke")
ENV = {"admin": "RETOUCH_ADMIN_TOKEN", "invoke": "RETOUCH_INVOKE_TOKEN"}
IMPLIES = {"admin": {"admin", "invoke"}, "invoke": {"invoke"}}
ANONYMOUS = "anonymous"  # the one tenant of an open API (no tokens configured)
TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # what a token file may name
TENANT_RULE = "1-64 ASCII letters, digits, '.', '_' or '-', starting with a letter or digit"


@dataclass(frozen=True)
class Principal:
    """Who a request acts for: the tenant that owns what it creates, and its token's scope.
    ``admin`` sees (and may cancel) every tenant's jobs."""

    tenant: str
    scope: str

    @property
    def admin(self) -> bool:
        return self.scope == "admin"

    def owns(self, tenant: str) -> bool:
        """Whether this principal may see and act on something ``tenant`` owns."""
        return self.admin or tenant == self.tenant


OPEN = Principal(ANONYMOUS, "admin")  # an open API: one tenant, every scope


@dataclass(frozen=True)
class Grant:
    """What one configured token is: its scope and its tenant."""

    scope: str
    tenant: str


def token_tenant(token: str) -> str:
    """The tenant of a token whose line names none: stable, and not the token."""
    return "t-" + hashlib.sha256(token.encode()).hexdigest()[:12]


@dataclass
class TokenAuth:
    tokens: dict[str, Grant] = field(default_factory=dict)  # token -> its grant

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    def authorize(self, token: str | None, scope: str) -> Principal:
        """The request's principal; 401 for a missing/unknown token, 403 for one without
        ``scope``."""
        if not self.enabled:
            return OPEN
        if token is None:
            raise Unauthorized("a bearer token is required", code="missing_token")
        grant = self._grant_of(token)
        if grant is None:
            raise Unauthorized("unknown bearer token", code="invalid_token")
        if scope not in IMPLIES[grant.scope]:
            raise Forbidden(f"this token lacks the {scope!r} scope", code="insufficient_scope")
        return Principal(grant.tenant, grant.scope)

    def _grant_of(self, token: str) -> Grant | None:
        found = None
        for known, grant in self.tokens.items():  # compare all: no early exit timing signal
            if hmac.compare_digest(known.encode(), token.encode()):
                found = grant
        return found


def load_auth(token_file: Path | None) -> TokenAuth:
    tokens: dict[str, Grant] = {}
    for scope, var in ENV.items():
        if os.environ.get(var):
            tokens[os.environ[var]] = Grant(scope, token_tenant(os.environ[var]))
    if token_file is not None:
        tokens.update(parse_token_file(token_file))
    return TokenAuth(tokens)


def parse_token_file(path: Path) -> dict[str, Grant]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InvalidSpec(
            f"cannot read token file {path}: {exc.strerror}", field="token_file"
        ) from exc
    tokens = {}
    for n, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3) or parts[0] not in SCOPES:
            raise InvalidSpec(
                f"{path}:{n}: expected '<admin|invoke> <token> [tenant]'", field="token_file"
            )
        tenant = parts[2] if len(parts) == 3 else token_tenant(parts[1])
        if not TENANT.fullmatch(tenant):
            raise InvalidSpec(
                f"{path}:{n}: a tenant is {TENANT_RULE}",
                field="token_file",
            )
        tokens[parts[1]] = Grant(parts[0], tenant)
    return tokens
