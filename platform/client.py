"""Python client of the public API, sync (:class:`Client`) and async (:class:`AsyncClient`).

Both build the same requests (:class:`Call`) and read responses the same way; they differ
only in the httpx transport. Errors come back as the :class:`RetouchError` the server sent.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from retouch.functions import wire
from retouch.functions.errors import RetouchError, Unavailable
from retouch.functions.imaging import encode_mask
from retouch.functions.spec import FunctionSpec, load_spec_file
from retouch.platform.config import default_url

TIMEOUT = httpx.Timeout(600.0, connect=10.0)


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    body: Any = None


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
    name: str, template: str, mask: bytes | np.ndarray, prompt: str, seed: int = 0, **options: Any
) -> Call:
    mask_bytes = encode_mask(mask) if isinstance(mask, np.ndarray) else mask
    req = wire.InvokeRequest(
        template=template, mask=mask_bytes, prompt=prompt, seed=seed, **options
    )
    return Call("POST", f"/v1/functions/{name}/invoke", req.to_wire())


def _headers(token: str | None) -> dict[str, str]:
    headers = {"content-type": "application/msgpack", "accept": "application/msgpack"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    return headers


def _result(resp: httpx.Response) -> Any:
    payload = wire.unpack(resp.content) if resp.content else {}
    if resp.status_code >= 400:
        raise RetouchError.from_wire(resp.status_code, payload)
    return payload


class Client:
    """Synchronous client: ``Client(url, token).invoke("tiny-sd", "shirt", mask, "a red shirt")``."""

    def __init__(
        self, url: str | None = None, token: str | None = None, timeout: httpx.Timeout = TIMEOUT
    ) -> None:
        self.url = (url or default_url()).rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=_headers(token), timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, call: Call) -> Any:
        content = wire.pack(call.body) if call.body is not None else None
        try:
            resp = self._http.request(call.method, call.path, content=content)
        except httpx.TransportError as exc:
            raise Unavailable(f"cannot reach {self.url}: {exc}", code="unreachable") from exc
        return _result(resp)

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
        template: str,
        mask: bytes | np.ndarray,
        prompt: str,
        seed: int = 0,
        **options: Any,
    ) -> wire.InvokeResult:
        return wire.InvokeResult.from_wire(
            self.call(invoke_call(name, template, mask, prompt, seed, **options))
        )


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
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def call(self, call: Call) -> Any:
        content = wire.pack(call.body) if call.body is not None else None
        try:
            resp = await self._http.request(call.method, call.path, content=content)
        except httpx.TransportError as exc:
            raise Unavailable(f"cannot reach {self.url}: {exc}", code="unreachable") from exc
        return _result(resp)

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
        template: str,
        mask: bytes | np.ndarray,
        prompt: str,
        seed: int = 0,
        **options: Any,
    ) -> wire.InvokeResult:
        return wire.InvokeResult.from_wire(
            await self.call(invoke_call(name, template, mask, prompt, seed, **options))
        )
