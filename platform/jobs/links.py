"""Signed result links: ``/v1/images/{job id}.{ext}?expires=<unix s>&sig=<hex>``.

A link is fetched without a token, so whoever can sign one can read the result: links are
signed with a key of their own, never the webhook secret (every webhook receiver holds
that one). The keys are a file of hex keys, one a line (``<data dir>/link-keys``, created
with mode 0600 on first start, or ``--link-key-file``): the last line signs, every line is
accepted. Rotation: append a new key, restart; once the longest link lifetime (at most
``--job-retention``) has passed, remove the old line and restart again.

A link never outlives its result: its ``expires`` is capped at the job's retention end
when it is signed, and a link whose ``expires`` lies beyond it is refused when it is
fetched. Its base URL is ``--public-url`` (by default the server's own bind address),
never the request's ``Host`` header, which the client chooses.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from retouch.functions.errors import BadRequest

KEY_FILE = "link-keys"
KEY_BYTES = 32
MIN_KEY_BYTES = 16  # a hand-written key file may hold shorter keys, never guessable ones


def load_keys(path: Path) -> tuple[bytes, ...]:
    """The keys in ``path`` (oldest first); the file is created (0600, one fresh key) if it
    does not exist. A line that is not hex, or shorter than 16 bytes, is refused."""
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(KEY_BYTES) + "\n")
    keys = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            key = bytes.fromhex(line)
        except ValueError:
            raise ValueError(f"{path}:{n}: a link key is hex") from None
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"{path}:{n}: a link key has at least {MIN_KEY_BYTES} bytes")
        keys.append(key)
    if not keys:
        raise ValueError(f"{path}: no link key")
    return tuple(keys)


def check_public_url(url: str) -> str:
    """``url`` without its trailing slash, if it is an absolute http(s) URL without a query
    or fragment (links are ``<url>/v1/images/...``)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"public_url must be an http(s) URL with a host, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"public_url takes no query or fragment, got {url!r}")
    return url.rstrip("/")


def bind_url(host: str, port: int) -> str:
    """The server's own address as a URL (the default ``public_url``)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass(frozen=True)
class LinkSigner:
    """Signs and checks result links with the link keys (the last one signs)."""

    keys: tuple[bytes, ...]
    base_url: str

    def url(self, job_id: str, ext: str, expires: int, not_after: float) -> str:
        """The link to a job's image, valid until ``expires``; a link that would outlive
        the result (``not_after``: its retention end) is refused."""
        if expires > not_after:
            raise ValueError(f"link of job {job_id} would outlive its result")
        sig = _mac(self.keys[-1], job_id, expires)
        return f"{self.base_url}/v1/images/{job_id}.{ext}?expires={expires}&sig={sig}"

    def verify(self, job_id: str, expires: int, sig: str) -> None:
        """Refuse (400 ``invalid_signature``, field ``sig``) a link no listed key signed."""
        given = sig.encode()
        if not any(
            hmac.compare_digest(given, _mac(key, job_id, expires).encode()) for key in self.keys
        ):
            raise BadRequest("invalid image link signature", field="sig", code="invalid_signature")

    @staticmethod
    def check_lifetime(expires: int, not_after: float) -> None:
        """Refuse a link whose ``expires`` lies beyond its result's retention end (one
        signed under another retention setting, or forged with a leaked old key)."""
        if expires > not_after:
            raise BadRequest(
                "this image link outlives its result", field="expires", code="link_outlives_result"
            )


def _mac(key: bytes, job_id: str, expires: int) -> str:
    msg = f"retouch-image-link.v1.{job_id}.{expires}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()
