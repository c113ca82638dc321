"""What a job's ``output`` link points at: ``GET /v1/images/{id}.{ext}?expires=&sig=``.

Every succeeded durable job has an ``output`` (the job document, its events and webhooks,
Replicate-style predictions and OpenAI's ``response_format=url`` all give it): a link the
gateway signed with its link key (``platform/jobs/links.py``), fetched without a token, valid
until it expires and never past the result's retention end. So no stream or webhook
carries image bytes: a client fetches the image once, from here.
"""

from __future__ import annotations

import re
import time

from starlette.requests import Request
from starlette.responses import Response

from retouch.functions.errors import NotFound
from retouch.platform.jobs.store import JobStore
from retouch.platform.state.auth import OPEN
from retouch.runtime import requestparams

NAME = re.compile(r"([0-9a-f]{32})\.(png|webp|raw)")
MEDIA_TYPES = {"png": "image/png", "webp": "image/webp"}  # raw: RGB8 rows, octet-stream
MAX_EXPIRES = 2**40  # a Unix time (year 36812): bounds the digits a link's expires may have


async def serve_output(jobs: JobStore, request: Request) -> Response:
    """The image a signed link names: a signature no link key made is 400, an expired link
    or a result gone (retention, or never there) 404."""
    m = NAME.fullmatch(request.path_params["name"])
    if m is None or jobs.links is None:
        raise NotFound("no such image", field="name", code="image_not_found")
    job_id = m.group(1)
    expires = requestparams.integer(request.query_params.get("expires"), "expires", 0, MAX_EXPIRES)
    jobs.links.verify(job_id, expires, request.query_params.get("sig", ""))
    if expires < time.time():
        raise NotFound("this image link has expired", field="expires", code="link_expired")
    try:
        job = await jobs.get(job_id, OPEN)  # the link's signature is the authorization
    except NotFound as exc:
        raise NotFound("the image is gone", field="name", code="image_not_found") from exc
    jobs.links.check_lifetime(expires, job.retained_until(jobs.retention_s))
    result = (await jobs.document(job)).get("result")
    if result is None:
        raise NotFound("the image is gone", field="name", code="image_not_found")
    return Response(
        bytes(result["image"]),
        media_type=MEDIA_TYPES.get(result["format"], "application/octet-stream"),
        headers={"cache-control": "private, max-age=3600"},
    )
