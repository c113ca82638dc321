"""Uploaded images (``image`` instead of ``template``), as the gateway takes them.

The gateway checks an upload's declared size (its header: no pixel decoded) against the
function and the pixel limit, decodes it off the event loop within the decode budget
(``platform/imagegate.py``), and names it by its owner and its content: ``upload:`` + a tag
of the tenant + a hash of the tenant, the decoded pixels and their size. So the same photo
sent as PNG, as lossless WebP or re-encoded by one tenant gets the same id, and the
executors (which key an upload's bake by its id, the model's fingerprint and the function's
settings) find its bake. Another tenant's copy of the same photo is another upload with its
own bake: whether an edit comes back mask-aware, or how fast, must not tell one tenant what
another uploaded. The tag lets the gateway show each tenant its own uploads only. The pixels
travel to the executor as a raw RGB8 array.
"""

from __future__ import annotations

import hashlib

import numpy as np

from retouch.functions import wire
from retouch.functions.errors import BadRequest
from retouch.functions.imaging import declared_size, decode_image
from retouch.functions.spec import FunctionSpec

PREFIX = "upload:"
ID_HEX = 24  # 96 bits of SHA-256: collisions are not a concern at a few images per function
TAG_HEX = 12  # the owner's tag: which tenant's listing shows the upload


def owner_tag(owner: str) -> str:
    """The tenant part of its upload ids (a hash: ids do not spell tenant names)."""
    return hashlib.sha256(f"upload-owner\0{owner}".encode()).hexdigest()[:TAG_HEX]


def upload_id(pixels: np.ndarray, owner: str) -> str:
    """The address of an RGB8 ``[H, W, 3]`` image within ``owner``'s uploads."""
    digest = hashlib.sha256(f"{owner}\0{pixels.shape[1]}x{pixels.shape[0]}\0".encode())
    digest.update(np.ascontiguousarray(pixels, dtype=np.uint8).tobytes())
    return PREFIX + owner_tag(owner) + digest.hexdigest()[:ID_HEX]


def owned_by(template_id: str, owner: str) -> bool:
    """Whether an upload id is one of ``owner``'s."""
    return template_id.startswith(PREFIX + owner_tag(owner))


def check_upload(spec: FunctionSpec, size: tuple[int, int], field: str = "image") -> None:
    """Refuse (400 naming ``field``) an upload to a function that takes none
    (``uploads_disabled``) or of another size than the function's resolution
    (``image_size_mismatch``); ``size`` is the one its header declares, so nothing is
    decoded for a refusal."""
    if spec.uploads.max_images == 0:
        raise BadRequest(
            f"function {spec.name!r} does not accept uploaded images (uploads.max_images = 0)",
            field=field,
            code="uploads_disabled",
        )
    if size != (spec.width, spec.height):
        raise BadRequest(
            f"image is {size[0]}x{size[1]}, function {spec.name!r} edits "
            f"{spec.width}x{spec.height} images",
            field=field,
            code="image_size_mismatch",
        )


def decode_upload(
    spec: FunctionSpec, data: bytes, owner: str, field: str = "image"
) -> tuple[str, wire.RawArray]:
    """(id, RGB8 pixels) of an uploaded image, or a 400 naming ``field``: not an image
    (``undecodable_image``), a bomb (``image_too_large``), or refused by
    :func:`check_upload` (from its header, before any pixel is decoded)."""
    check_upload(spec, declared_size(data, field), field)
    img = decode_image(data, field)
    pixels = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return upload_id(pixels, owner), wire.RawArray.of(pixels)
