"""The link signer without a server: key rotation (the newest key signs, every listed key
verifies, a removed key's links are refused), the key file (created 0600, hex lines only)
and the lifetime check."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from retouch.functions.errors import BadRequest
from retouch.platform.jobs.links import LinkSigner, check_public_url, load_keys

OLD, NEW = b"o" * 32, b"n" * 32
BASE = "https://images.example"


def parts(url: str) -> tuple[str, int, str]:
    """(job id, expires, sig) of a link."""
    path, query = url.split("?")
    fields = dict(q.split("=") for q in query.split("&"))
    return path.rsplit("/", 1)[1].split(".")[0], int(fields["expires"]), fields["sig"]


def test_rotation_signs_with_the_newest_and_accepts_every_listed_key() -> None:
    before = LinkSigner((OLD,), BASE).url("a" * 32, "png", 2000, not_after=3000)
    during = LinkSigner((OLD, NEW), BASE)
    during.verify(*parts(before))  # an old link still works while both keys are listed
    fresh = during.url("a" * 32, "png", 2000, not_after=3000)
    assert fresh.startswith(f"{BASE}/v1/images/{'a' * 32}.png?") and fresh != before
    LinkSigner((NEW,), BASE).verify(*parts(fresh))  # signed with the newest key
    with pytest.raises(BadRequest) as refused:
        LinkSigner((NEW,), BASE).verify(*parts(before))  # the old key is gone
    assert refused.value.code == "invalid_signature" and refused.value.field == "sig"


def test_a_link_is_bound_to_its_job_and_expiry() -> None:
    signer = LinkSigner((NEW,), BASE)
    job, expires, sig = parts(signer.url("a" * 32, "png", 2000, not_after=3000))
    for other in (("b" * 32, expires, sig), (job, expires + 1, sig)):
        with pytest.raises(BadRequest):
            signer.verify(*other)


def test_no_link_outlives_its_result() -> None:
    signer = LinkSigner((NEW,), BASE)
    with pytest.raises(ValueError):
        signer.url("a" * 32, "png", 3001, not_after=3000)
    signer.check_lifetime(3000, not_after=3000)
    with pytest.raises(BadRequest) as refused:
        signer.check_lifetime(3001, not_after=3000)
    assert refused.value.code == "link_outlives_result" and refused.value.field == "expires"


def test_key_file_is_created_private_and_parsed_strictly(tmp_path: Path) -> None:
    path = tmp_path / "link-keys"
    (key,) = load_keys(path)
    assert len(key) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_keys(path) == (key,)  # kept across restarts
    path.write_text(f"# rotated\n{OLD.hex()}\n\n{NEW.hex()}\n")
    assert load_keys(path) == (OLD, NEW)
    for bad in ("not-hex\n", "abcd\n", "# only a comment\n"):
        path.write_text(bad)
        with pytest.raises(ValueError, match="link-keys"):
            load_keys(path)


def test_public_url_must_be_an_http_base() -> None:
    assert check_public_url("https://img.example:8443/") == "https://img.example:8443"
    for bad in ("img.example", "ftp://img.example", "https://img.example/?a=1", "http:///x"):
        with pytest.raises(ValueError, match="public_url"):
            check_public_url(bad)
