"""Python client of the public API, sync (:class:`Client`) and async (:class:`AsyncClient`).

Both build the same requests (:class:`Call`) and read responses the same way; they differ
only in the httpx transport. Errors come back as the :class:`RetouchError` the server sent.
``submit()`` returns a job handle (:class:`Job` / :class:`AsyncJob`): ``status()``,
``wait()``, ``events()`` (the server-sent events) and ``cancel()``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from retouch.functions.errors import Canceled, GatewayTimeout, RetouchError, Unavailable
from retouch.functions.imaging import encode_mask
from retouch.functions.spec import FunctionSpec, load_spec_file
from retouch.functions.wire.codec import pack, unpack
from retouch.functions.wire.invoke import InvokeRequest, InvokeResult
from retouch.functions.wire.jobs import JobEvent, JobStatus
from retouch.platform.api.config import default_url
from retouch.platform.fleet.tls import tls_context
from retouch.platform.jobs import sse

TIMEOUT = httpx.Timeout(600.0, connect=10.0)


WAIT_CHUNK_S = 60  # the longest Prefer: wait=N the server honours
BAKE_DONE = frozenset({"baked", "failed"})  # template states that end a bake wait


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    body: Any = None
    headers: dict[str, str] | None = None


def deploy_call(spec: FunctionSpec, images: dict[str, bytes]) -> Call:
    return Call("PUT", f"/v1/functions/{spec.name}", {"spec": spec.to_dict(), "templates": images})


def read_spec_file(path: Path) -> tuple[FunctionSpec, dict[str, bytes]]:
    """A TOML spec and its template image files, ready to upload."""
    spec, paths = load_spec_file(path)
    images = {}
    for tid, image_path in paths.items():
        try:
            images[tid] = image_path.read_bytes()
        except OSError as exc:
            raise RetouchError(
                f"cannot read template image {image_path}: {exc.strerror}",
                field=f"templates.{tid}.image",
                code="invalid_spec",
            ) from exc
    return spec, images


def invoke_call(
    name: str,
    template: str | None,
    mask: bytes | np.ndarray,
    prompt: str,
    seed: int | None = 0,
    **options: Any,
) -> Call:
    """``template=None, image=<encoded image bytes>`` edits an uploaded image instead;
    ``seed=None``: the gateway draws one (the result says which)."""
    mask_bytes = encode_mask(mask) if isinstance(mask, np.ndarray) else mask
    req = InvokeRequest(
        template=template, mask=mask_bytes, prompt=prompt, seed=seed or 0, **options
    )
    body = req.to_wire()
    if seed is None:
        del body["seed"]
    return Call("POST", f"/v1/functions/{name}/invoke", body)


def invoke_results(body: Any) -> list[InvokeResult]:
    """An invoke's answer as its list of results: one result, or (for
    ``num_images_per_prompt`` > 1) ``{"results": [...]}``."""
    if isinstance(body, dict) and "results" in body:
        return [InvokeResult.from_wire(r) for r in body["results"]]
    return [InvokeResult.from_wire(body)]


def _one_image(options: dict[str, Any]) -> None:
    if options.get("num_images_per_prompt", 1) != 1:
        raise ValueError("invoke returns one image: use invoke_images for several")


def job_call(
    name: str,
    template: str | None,
    mask: bytes | np.ndarray,
    prompt: str,
    seed: int | None = 0,
    webhook: str | None = None,
    webhook_events: list[str] | None = None,
    **options: Any,
) -> Call:
    body = invoke_call(name, template, mask, prompt, seed, **options).body
    if webhook is not None:
        body["webhook"] = webhook
    if webhook_events is not None:
        body["webhook_events"] = list(webhook_events)
    return Call("POST", f"/v1/functions/{name}/jobs", body)


def job_status_call(job_id: str, wait_s: float | None = None) -> Call:
    headers = {"prefer": f"wait={wait_s:g}"} if wait_s is not None else None
    return Call("GET", f"/v1/jobs/{job_id}", headers=headers)


def job_outcome(doc: dict[str, Any]) -> InvokeResult:
    """The result of a finished job document, or the error it ended with."""
    status = doc["status"]
    if status == JobStatus.SUCCEEDED:
        return InvokeResult.from_wire(doc["result"])
    if status == JobStatus.CANCELED:
        raise Canceled(f"job {doc['id']} was canceled", field="id")
    error = doc.get("error") or {}
    raise RetouchError.from_wire(int(error.get("status", 500)), {"error": error})


def _wait_chunk(deadline: float | None) -> float:
    if deadline is None:
        return WAIT_CHUNK_S
    left = deadline - time.monotonic()
    if left <= 0:
        raise GatewayTimeout("the job did not finish in time", code="wait_timeout")
    return min(WAIT_CHUNK_S, max(0.0, round(left, 3)))


class Job:
    """A submitted job: ``status()``, ``wait()``, ``events()``, ``cancel()``."""

    def __init__(self, client: Client, doc: dict[str, Any]) -> None:
        self.client = client
        self.doc = doc
        self.id: str = doc["id"]

    def status(self) -> dict[str, Any]:
        """The job document, fresh from the server."""
        self.doc = self.client.call(job_status_call(self.id))
        return self.doc

    def wait(self, timeout: float | None = None) -> InvokeResult:
        """Block until the job ends; its result, or the error it failed with
        (:class:`~retouch.functions.errors.Canceled` when canceled)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not JobStatus(self.doc["status"]).terminal:
            self.doc = self.client.call(job_status_call(self.id, _wait_chunk(deadline)))
        return job_outcome(self.doc)

    def events(self, after: int = 0) -> Iterator[JobEvent]:
        """The job's server-sent events from ``after`` on, until it ends."""
        return self.client.job_events(self.id, after)

    def cancel(self) -> dict[str, Any]:
        self.doc = self.client.call(Call("POST", f"/v1/jobs/{self.id}/cancel"))
        return self.doc


class AsyncJob:
    """:class:`Job` for :class:`AsyncClient`: the same methods, awaited."""

    def __init__(self, client: AsyncClient, doc: dict[str, Any]) -> None:
        self.client = client
        self.doc = doc
        self.id: str = doc["id"]

    async def status(self) -> dict[str, Any]:
        self.doc = await self.client.call(job_status_call(self.id))
        return self.doc

    async def wait(self, timeout: float | None = None) -> InvokeResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not JobStatus(self.doc["status"]).terminal:
            self.doc = await self.client.call(job_status_call(self.id, _wait_chunk(deadline)))
        return job_outcome(self.doc)

    def events(self, after: int = 0) -> AsyncIterator[JobEvent]:
        return self.client.job_events(self.id, after)

    async def cancel(self) -> dict[str, Any]:
        self.doc = await self.client.call(Call("POST", f"/v1/jobs/{self.id}/cancel"))
        return self.doc


WEBHOOK_SECRET_CALL = Call("GET", "/v1/webhooks/secret")


def _jobs_call(status: str | None, function: str | None, limit: int) -> Call:
    query = [f"limit={limit}"]
    if status:
        query.append(f"status={status}")
    if function:
        query.append(f"function={function}")
    return Call("GET", "/v1/jobs?" + "&".join(query))


def _headers(token: str | None) -> dict[str, str]:
    headers = {"content-type": "application/msgpack", "accept": "application/msgpack"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    return headers


def _result(resp: httpx.Response) -> Any:
    payload = unpack(resp.content) if resp.content else {}
    if resp.status_code >= 400:
        raise RetouchError.from_wire(resp.status_code, payload)
    return payload


class Client:
    """Synchronous client: ``Client(url, token).invoke("tiny-sd", "shirt", mask, "a red shirt")``."""

    def __init__(
        self, url: str | None = None, token: str | None = None, timeout: httpx.Timeout = TIMEOUT
    ) -> None:
        self.url = (url or default_url()).rstrip("/")
        self._http = httpx.Client(
            base_url=self.url, headers=_headers(token), timeout=timeout, verify=tls_context()
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, call: Call) -> Any:
        content = pack(call.body) if call.body is not None else None
        try:
            resp = self._http.request(call.method, call.path, content=content, headers=call.headers)
        except httpx.TransportError as exc:
            raise Unavailable(f"cannot reach {self.url}: {exc}", code="unreachable") from exc
        return _result(resp)

    def submit(
        self,
        name: str,
        template: str | None,
        mask: bytes | np.ndarray,
        prompt: str,
        seed: int | None = 0,
        **options: Any,
    ) -> Job:
        """Submit an async job (``webhook=``, ``webhook_events=`` and the invoke options)."""
        return Job(self, self.call(job_call(name, template, mask, prompt, seed, **options)))

    def job(self, job_id: str) -> Job:
        """A handle on an existing job (fetches its document)."""
        return Job(self, self.call(job_status_call(job_id)))

    def jobs(
        self, status: str | None = None, function: str | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        return self.call(_jobs_call(status, function, limit))["jobs"]

    def webhook_secret(self) -> bytes:
        """This token's tenant's webhook signing key (for ``webhooks.verify``)."""
        return self.call(WEBHOOK_SECRET_CALL)["secret"].encode()

    def job_events(self, job_id: str, after: int = 0) -> Iterator[JobEvent]:
        headers = {"accept": sse.MEDIA_TYPE, "last-event-id": str(after)}
        try:
            with self._http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as resp:
                if resp.status_code >= 400:
                    _result(httpx.Response(resp.status_code, content=resp.read()))
                yield from sse.parse(resp.iter_lines())
        except httpx.TransportError as exc:
            raise Unavailable(f"cannot reach {self.url}: {exc}", code="unreachable") from exc

    def deploy(
        self,
        spec: FunctionSpec,
        images: dict[str, bytes],
        wait: bool = True,
        timeout: float = 600.0,
    ) -> dict[str, Any]:
        doc = self.call(deploy_call(spec, images))
        return self.wait_ready(spec.name, timeout) if wait else doc

    def deploy_file(self, path: Path, wait: bool = True, timeout: float = 600.0) -> dict[str, Any]:
        return self.deploy(*read_spec_file(path), wait=wait, timeout=timeout)

    def wait_ready(self, name: str, timeout: float = 600.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            doc = self.get(name)
            if doc["status"] != "deploying":
                return doc
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"{name} still deploying after {timeout:.0f} s", code="deploy_timeout"
                )
            time.sleep(0.2)

    def wait_baked(
        self,
        name: str,
        timeout: float = 1800.0,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, Any]:
        """Until every template is baked (or failed to bake), so the function's first
        edits are mask-aware; at once when no executor runs mask-aware."""
        if not any(
            (e.get("state") or {}).get("maskaware", True) for e in self.executors()["executors"]
        ):
            return self.get(name)
        deadline = time.monotonic() + timeout
        last = None
        while True:
            doc = self.get(name)
            states = [t["state"] for t in doc["templates"].values()]
            done = sum(s in BAKE_DONE for s in states)
            if on_progress is not None and (done, len(states)) != last:
                on_progress(states.count("baked"), len(states))
                last = (done, len(states))
            if done == len(states) or doc["status"] != "ready":
                return doc
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"{name}: templates still baking after {timeout:.0f} s", code="bake_timeout"
                )
            time.sleep(0.5)

    def list(self) -> list[dict[str, Any]]:
        return self.call(Call("GET", "/v1/functions"))["functions"]

    def get(self, name: str) -> dict[str, Any]:
        return self.call(Call("GET", f"/v1/functions/{name}"))

    def delete(self, name: str) -> dict[str, Any]:
        return self.call(Call("DELETE", f"/v1/functions/{name}"))

    def executors(self) -> dict[str, Any]:
        return self.call(Call("GET", "/v1/executors"))

    def invoke(
        self,
        name: str,
        template: str | None,
        mask: bytes | np.ndarray,
        prompt: str,
        seed: int | None = 0,
        **options: Any,
    ) -> InvokeResult:
        """Edit ``template``, or an uploaded image: ``template=None, image=<bytes>``."""
        _one_image(options)
        return InvokeResult.from_wire(
            self.call(invoke_call(name, template, mask, prompt, seed, **options))
        )

    def invoke_images(
        self,
        name: str,
        template: str | None,
        mask: bytes | np.ndarray,
        prompt: str,
        seed: int | None = 0,
        num_images_per_prompt: int = 1,
        **options: Any,
    ) -> list[InvokeResult]:
        """``num_images_per_prompt`` edits of one request (image i with seed ``seed + i``)."""
        call = invoke_call(
            name, template, mask, prompt, seed, num_images_per_prompt=num_images_per_prompt,
            **options,
        )  # fmt: skip
        return invoke_results(self.call(call))


class AsyncClient:
    """Asynchronous client with the same methods as :class:`Client`, awaited."""

    def __init__(
        self, url: str | None = None, token: str | None = None, timeout: httpx.Timeout = TIMEOUT
    ) -> None:
        self.url = (url or default_url()).rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=_headers(token),
            timeout=timeout,
            limits=httpx.Limits(max_connections=None),
            verify=tls_context(),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def call(self, call: Call) -> Any:
        content = pack(call.body) if call.body is not None else None
        try:
            resp = await self._http.request(
                call.method, call.path, content=content, headers=call.headers
            )
        except httpx.TransportError as exc:
            raise Unavailable(f"cannot reach {self.url}: {exc}", code="unreachable") from exc
        return _result(resp)

    async def submit(
        self,
        name: str,
        template: str | None,
        mask: bytes | np.ndarray,
        prompt: str,
        seed: int | None = 0,
        **options: Any,
    ) -> AsyncJob:
        return AsyncJob(
            self, await self.call(job_call(name, template, mask, prompt, seed, **options))
        )

    async def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, await self.call(job_status_call(job_id)))

    async def jobs(
        self, status: str | None = None, function: str | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        return (await self.call(_jobs_call(status, function, limit)))["jobs"]

    async def webhook_secret(self) -> bytes:
        """This token's tenant's webhook signing key (for ``webhooks.verify``)."""
        return (await self.call(WEBHOOK_SECRET_CALL))["secret"].encode()

    async def job_events(self, job_id: str, after: int = 0) -> AsyncIterator[JobEvent]:
        headers = {"accept": sse.MEDIA_TYPE, "last-event-id": str(after)}
        parser = sse.Parser()
        try:
            async with self._http.stream(
                "GET", f"/v1/jobs/{job_id}/events", headers=headers
            ) as resp:
                if resp.status_code >= 400:
                    _result(httpx.Response(resp.status_code, content=await resp.aread()))
                async for line in resp.aiter_lines():
                    for event in parser.feed(line):
                        yield event
        except httpx.TransportError as exc:
            raise Unavailable(f"cannot reach {self.url}: {exc}", code="unreachable") from exc

    async def deploy(
        self,
        spec: FunctionSpec,
        images: dict[str, bytes],
        wait: bool = True,
        timeout: float = 600.0,
    ) -> dict[str, Any]:
        doc = await self.call(deploy_call(spec, images))
        return await self.wait_ready(spec.name, timeout) if wait else doc

    async def wait_ready(self, name: str, timeout: float = 600.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            doc = await self.get(name)
            if doc["status"] != "deploying":
                return doc
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"{name} still deploying after {timeout:.0f} s", code="deploy_timeout"
                )
            await asyncio.sleep(0.2)

    async def list(self) -> list[dict[str, Any]]:
        return (await self.call(Call("GET", "/v1/functions")))["functions"]

    async def get(self, name: str) -> dict[str, Any]:
        return await self.call(Call("GET", f"/v1/functions/{name}"))

    async def delete(self, name: str) -> dict[str, Any]:
        return await self.call(Call("DELETE", f"/v1/functions/{name}"))

    async def invoke(
        self,
        name: str,
        template: str | None,
        mask: bytes | np.ndarray,
        prompt: str,
        seed: int | None = 0,
        **options: Any,
    ) -> InvokeResult:
        _one_image(options)
        return InvokeResult.from_wire(
            await self.call(invoke_call(name, template, mask, prompt, seed, **options))
        )
