"""Bearer tokens with scopes: ``admin`` deploys and deletes, ``invoke`` invokes and reads.

Tokens come from a token file (one ``<scope> <token>`` pair per line, ``#`` comments) or the
environment (``RETOUCH_ADMIN_TOKEN``, ``RETOUCH_INVOKE_TOKEN``). With no token configured the
API is open, which is only sensible on loopback; ``retouch serve`` warns about it.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path

from retouch.functions.errors import Forbidden, InvalidSpec, Unauthorized

SCOPES = ("admin", "invoke")
ENV = {"admin": "RETOUCH_ADMIN_TOKEN", "invoke": "RETOUCH_INVOKE_TOKEN"}
IMPLIES = {"admin": {"admin", "invoke"}, "invoke": {"invoke"}}


@dataclass
class TokenAuth:
    tokens: dict[str, str] = field(default_factory=dict)  # token -> scope

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    def authorize(self, token: str | None, scope: str) -> None:
        """Raise 401 for a missing/unknown token, 403 for one without ``scope``."""
        if not self.enabled:
            return
        if token is None:
            raise Unauthorized("a bearer token is required", code="missing_token")
        granted = self._scope_of(token)
        if granted is None:
            raise Unauthorized("unknown bearer token", code="invalid_token")
        if scope not in IMPLIES[granted]:
            raise Forbidden(f"this token lacks the {scope!r} scope", code="insufficient_scope")

    def _scope_of(self, token: str) -> str | None:
        found = None
        for known, scope in self.tokens.items():  # compare all: no early exit timing signal
            if hmac.compare_digest(known.encode(), token.encode()):
                found = scope
        return found


def load_auth(token_file: Path | None) -> TokenAuth:
    tokens: dict[str, str] = {}
    for scope, var in ENV.items():
        if os.environ.get(var):
            tokens[os.environ[var]] = scope
    if token_file is not None:
        tokens.update(parse_token_file(token_file))
    return TokenAuth(tokens)


def parse_token_file(path: Path) -> dict[str, str]:
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
        if len(parts) != 2 or parts[0] not in SCOPES:
            raise InvalidSpec(f"{path}:{n}: expected '<admin|invoke> <token>'", field="token_file")
        tokens[parts[1]] = parts[0]
    return tokens
