"""A real ``retouch serve`` process on a free loopback port, with tokens configured."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from retouch.platform.api.client import Client
from retouch.platform.api.server import ServerProcess
from tests.support import EXAMPLES

ADMIN = "admin-secret-token"
INVOKE = "invoke-secret-token"
TOKENS = {"RETOUCH_ADMIN_TOKEN": ADMIN, "RETOUCH_INVOKE_TOKEN": INVOKE}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def server(data_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(data_dir, env=TOKENS) as proc:
        yield proc


@pytest.fixture(scope="session")
def tokens() -> dict[str, str]:
    return dict(TOKENS)


@pytest.fixture(scope="session")
def examples() -> Path:
    return EXAMPLES


@pytest.fixture
def invoker(server: ServerProcess) -> Iterator[Client]:
    with Client(server.url, INVOKE) as client:
        yield client


@pytest.fixture
def admin(server: ServerProcess) -> Iterator[Client]:
    with Client(server.url, ADMIN) as client:
        yield client
