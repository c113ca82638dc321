"""Uploaded images (``image`` instead of ``template``), as the gateway takes them.

The gateway checks an upload's declared size (its header: no pixel decoded) against the
pixel limit, decodes it off the event loop within the decode budget
(``platform/api/imagegate.py``), frames it for the function (``platform/jobs/reframe.py``: resized
to the function's resolution, or the crop ``padding_mask_crop`` asks for) and names it by
its owner and the pixels the executor gets: ``upload:`` + a tag of the tenant + a digest of
the tenant, those pixels and their size, both keyed with the server's upload key
(``<data dir>/upload-key``, made once). So the same photo sent as PNG, as lossless WebP or
re-encoded by one tenant gets the same id, its second edit (any mask; with
``padding_mask_crop``, a mask of the same crop box) finds the first one's bake on the
executors (which key an upload's bake by its id, the model's fingerprint and the function's
settings), and so does a crop of a deployed template (the same pixels are the same
ad-hoc template). Another tenant's copy of the same photo is another upload with its own bake:
whether an edit comes back mask-aware, or how fast, must not tell one tenant what another
uploaded. The tag lets the gateway show each tenant its own uploads only; as it is keyed, no
tenant can compute another's ids (to count them in a listing, or to test whether a given
photo is among them). The pixels travel to the executor as a raw RGB8 array.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from retouch.functions.errors import BadRequest
from retouch.functions.imaging import decode_image
from retouch.functions.spec import FunctionSpec
from retouch.functions.wire.executor import ExecutorState
from retouch.platform.state.auth import Principal

PREFIX = "upload:"
ID_HEX = 24  # 96 bits of HMAC-SHA-256: collisions are not a concern at a few images
TAG_HEX = 12  # the owner's tag: which tenant's listing shows the upload
KEY_FILE = "upload-key"
KEY_BYTES = 32


@dataclass(frozen=True)
class Upload:
    """A decoded upload: its RGB8 ``[H, W, 3]`` pixels at the size it was sent."""

    pixels: np.ndarray

    @property
    def size(self) -> tuple[int, int]:
        height, width = self.pixels.shape[:2]
        return width, height


@dataclass(frozen=True)
class UploadNames:
    """Upload ids, keyed with the server's upload key. The key never changes once made:
    an id is the address of an upload's bake on the executors."""

    key: bytes = field(repr=False)

    @classmethod
    def ephemeral(cls) -> UploadNames:
        """A key of this process only (a gateway without a data directory)."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def load(cls, data_dir: Path) -> UploadNames:
        """The key in ``<data dir>/upload-key`` (hex), made (mode 0600) on first start."""
        path = data_dir / KEY_FILE
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return cls(bytes.fromhex(path.read_text().strip()))
        key = secrets.token_bytes(KEY_BYTES)
        with os.fdopen(fd, "w") as f:
            f.write(key.hex() + "\n")
        return cls(key)

    def tag(self, owner: str) -> str:
        """The tenant part of its upload ids (ids neither spell nor reveal tenant names)."""
        return self._mac(f"upload-owner\0{owner}".encode()).hexdigest()[:TAG_HEX]

    def id(self, pixels: np.ndarray, owner: str) -> str:
        """The address of an RGB8 ``[H, W, 3]`` image within ``owner``'s uploads."""
        mac = self._mac(f"upload\0{owner}\0{pixels.shape[1]}x{pixels.shape[0]}\0".encode())
        mac.update(np.ascontiguousarray(pixels, dtype=np.uint8).tobytes())
        return PREFIX + self.tag(owner) + mac.hexdigest()[:ID_HEX]

    def owned_by(self, template_id: str, owner: str) -> bool:
        """Whether an upload id is one of ``owner``'s."""
        return template_id.startswith(PREFIX + self.tag(owner))

    def shown(self, template_id: str, viewer: Principal) -> bool:
        """Whether ``viewer`` may see a template id: a deployed template, or an upload of
        its own (an admin: anyone's)."""
        return (
            not template_id.startswith(PREFIX)
            or viewer.admin
            or self.owned_by(template_id, viewer.tenant)
        )

    def own_uploads(self, doc: dict[str, Any], viewer: Principal) -> dict[str, Any]:
        """A function document with the uploads ``viewer`` may see: its own (admin: all)."""
        doc["uploads"] = {t: s for t, s in doc["uploads"].items() if self.shown(t, viewer)}
        return doc

    def own_state(self, state: ExecutorState, viewer: Principal) -> dict[str, Any]:
        """An executor's report with the uploads ``viewer`` may see (its templates'
        states hold every tenant's)."""
        templates = {
            fn: {t: status for t, status in tpls.items() if self.shown(t, viewer)}
            for fn, tpls in state.templates.items()
        }
        return state.model_copy(update={"templates": templates}).to_wire()

    def own_residency(self, residency: dict[str, str], viewer: Principal) -> dict[str, str]:
        """An executor's ``{"fn/template": tier}`` with the uploads ``viewer`` may see."""
        return {
            key: tier
            for key, tier in residency.items()
            if self.shown(key.partition("/")[2], viewer)
        }

    def _mac(self, message: bytes) -> hmac.HMAC:
        return hmac.new(self.key, message, hashlib.sha256)


def decode_upload(data: bytes, field: str = "image") -> Upload:
    """An uploaded image decoded to RGB8, or a 400 naming ``field``: not an image
    (``undecodable_image``), a bomb (``image_too_large``)."""
    img = decode_image(data, field)
    return Upload(np.asarray(img.convert("RGB"), dtype=np.uint8))


def check_upload(spec: FunctionSpec, field: str = "image") -> None:
    """Refuse (400 naming ``field``) an ad-hoc template (an uploaded image, or a crop of a
    deployed one) for a function that takes none (``uploads_disabled``)."""
    if spec.uploads.max_images == 0:
        raise BadRequest(
            f"function {spec.name!r} does not accept uploaded images (uploads.max_images = 0)",
            field=field,
            code="uploads_disabled",
        )
