"""A real ``retouch serve`` process on a free loopback port, with tokens configured."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from retouch.platform.client import Client
from retouch.platform.server import ServerProcess

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
    return Path(__file__).resolve().parents[2] / "deploy" / "examples"


@pytest.fixture
def invoker(server: ServerProcess) -> Iterator[Client]:
    with Client(server.url, INVOKE) as client:
        yield client


@pytest.fixture
def admin(server: ServerProcess) -> Iterator[Client]:
    with Client(server.url, ADMIN) as client:
        yield client


@pytest.fixture(scope="session")
def loadgen() -> ModuleType:
    """``loadgen.py`` beside this file (threads of invocations, a polling wait): the
    importlib import mode puts no test folder on ``sys.path``, so it is loaded by path."""
    spec = importlib.util.spec_from_file_location("loadgen", Path(__file__).with_name("loadgen.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
