"""Upload ids (no processes): keyed with the server's upload key, so the same photo is one
id within one tenant's uploads, another in another's, and no tenant can compute another
tenant's ids (nor its tag) without the key; the key outlives a restart."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import numpy as np

from retouch.platform.api.uploads import KEY_FILE, PREFIX, TAG_HEX, UploadNames
from retouch.platform.state.auth import Principal

ALICE, BOB = Principal("alice", "invoke"), Principal("bob", "invoke")
ADMIN = Principal("ops", "admin")


def pixels(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)


def test_an_id_is_its_owners_and_its_pixels() -> None:
    names = UploadNames(b"k" * 32)
    a = names.id(pixels(), "alice")
    assert a == names.id(pixels().copy(), "alice") and a.startswith(PREFIX + names.tag("alice"))
    assert a != names.id(pixels(2), "alice")
    assert names.id(pixels(), "bob") != a and names.tag("bob") != names.tag("alice")


def test_without_the_key_no_id_nor_tag_can_be_computed() -> None:
    names, other = UploadNames(b"k" * 32), UploadNames(b"q" * 32)
    assert names.id(pixels(), "alice") != other.id(pixels(), "alice")
    unkeyed = hashlib.sha256(b"upload-owner\0alice").hexdigest()[:TAG_HEX]
    assert names.tag("alice") != unkeyed


def test_each_tenant_is_shown_its_own_uploads_and_every_template() -> None:
    names = UploadNames.ephemeral()
    mine = names.id(pixels(), "alice")
    assert names.shown(mine, ALICE) and not names.shown(mine, BOB) and names.shown(mine, ADMIN)
    assert names.shown("street", BOB)  # a deployed template is everyone's


def test_the_key_is_made_once_and_kept(tmp_path: Path) -> None:
    first = UploadNames.load(tmp_path)
    assert stat.S_IMODE((tmp_path / KEY_FILE).stat().st_mode) == 0o600
    again = UploadNames.load(tmp_path)
    assert again.id(pixels(), "alice") == first.id(pixels(), "alice")
