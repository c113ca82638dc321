"""Outgoing HTTP clients share one TLS context (``platform/fleet/tls.py``): httpx would load the CA
bundle again for every client, ~60 ms of CPU each."""

from __future__ import annotations

import ast
import ssl
from pathlib import Path

import certifi
import pytest

from retouch.platform.fleet import tls
from tests.support import REPO

HTTPX_CALLS = {"Client", "AsyncClient", "get", "post", "put", "delete", "request", "stream"}


@pytest.fixture
def fresh_context():
    tls.tls_context.cache_clear()
    yield
    tls.tls_context.cache_clear()


def test_the_context_verifies_servers_as_httpx_does(fresh_context) -> None:
    ctx = tls.tls_context()
    assert ctx is tls.tls_context()  # built once per process
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.cert_store_stats()["x509_ca"] > 0  # the CA bundle is loaded


def test_ssl_cert_file_is_honoured(fresh_context, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "missing.pem"))
    with pytest.raises(FileNotFoundError):
        tls.tls_context()
    monkeypatch.setenv("SSL_CERT_FILE", certifi.where())
    assert tls.tls_context().cert_store_stats()["x509_ca"] > 0


def test_every_httpx_client_of_the_platform_passes_the_shared_context() -> None:
    missing = []
    for path in sorted((REPO / "platform").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "httpx"
                and node.func.attr in HTTPX_CALLS
                and not any(k.arg == "verify" for k in node.keywords)
            ):
                missing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not missing, f"httpx clients without verify=tls_context(): {missing}"
