"""Session-wide set-up: one shared folder for built demo models and device profiles, so
every ``retouch serve`` a test starts reuses them instead of rebuilding and re-profiling.
Under pytest-xdist the workers share it too (both are written atomically: a model is built
into a temporary folder renamed into place, a profile written beside and replaced)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from retouch.runtime.reproducibility import set_switches
from tests.postgres import PostgresServer, bin_dir
from tests.support import REPO, WAIT_S, wait_for

# The suite runs with deterministic mode's switches (docs/maskaware.md, "Exactness and
# reproducibility"), set before anything computes: every test process and the executors it
# starts (which inherit them) choose kernels independently of the weights' alignment.
set_switches(os.environ)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # The test processes (one per core) share the machine: each server's executors and each
    # test process run one torch thread, and OpenMP threads sleep rather than spin while they
    # wait (spinning threads of two processes on two cores took CPU from the work itself).
    os.environ.setdefault("RETOUCH_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True, scope="session")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's base is <run>/popen-gwN
        shared = tmp_path_factory.getbasetemp().parent / "shared"
        shared.mkdir(exist_ok=True)
    else:
        shared = tmp_path_factory.mktemp("shared")
    os.environ["RETOUCH_SHARED_DIR"] = str(shared)  # read by `retouch serve` (ServeConfig)
    # Hub ids resolve from this cache only (never the user's, never the network).
    os.environ["HF_HUB_CACHE"] = str(shared / "hub")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("RETOUCH_LOG_LEVEL", "WARNING")
    return shared


# The fork servers the tests' processes start from, each by the variable that names it.
ZYGOTES = {
    # every server's CPU executors (read by `retouch serve`): 7-8 s of imports a start
    "RETOUCH_EXECUTOR_ZYGOTE": "retouch.runtime.executor.zygote",
    # every ServerProcess's gateway (read by ServerProcess): about 1.3 s of imports a start
    "RETOUCH_GATEWAY_ZYGOTE": "tests.gatewayzygote",
}


@dataclass
class _Zygote:
    process: subprocess.Popen
    folder: Path

    @property
    def socket(self) -> Path:
        return self.folder / "zygote.sock"

    @classmethod
    def start(cls, folder: Path, module: str) -> _Zygote:
        ready = ["--ready-file", str(folder / "ready")]
        with (folder / "zygote.log").open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", module, "--socket", str(folder / "zygote.sock"), *ready],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=REPO,  # where `tests` is a package, wherever pytest was started
            )  # fmt: skip
        return cls(process, folder)

    def started(self) -> bool:
        assert self.process.poll() is None, (self.folder / "zygote.log").read_text()[-3000:]
        return (self.folder / "ready").exists()


@pytest.fixture(autouse=True, scope="session")
def zygotes(
    tmp_path_factory: pytest.TempPathFactory, shared_dir: Path
) -> Iterator[dict[str, Path]]:
    """The CPU executors of every server the tests start, and the gateways they start as
    ServerProcess, fork from warm processes (``runtime/executor/zygote.py``,
    ``tests/gatewayzygote.py``): each start skips the imports. Started after the environment
    above is set (a zygote's import-time variables are the tests'), both at once, and waited
    for: a server started before its zygote has imported would start afresh
    (``--executor-zygote`` and ServerProcess fall back when the socket does not answer),
    paying the imports again beside the zygote."""
    started = {
        var: _Zygote.start(tmp_path_factory.mktemp(module.rsplit(".", 1)[-1]), module)
        for var, module in ZYGOTES.items()
    }
    try:
        for var, zygote in started.items():
            wait_for(f"the imports of {ZYGOTES[var]}", zygote.started, WAIT_S, 0.05)
            os.environ[var] = str(zygote.socket)
        yield {var: zygote.socket for var, zygote in started.items()}
    finally:
        for var, zygote in started.items():
            os.environ.pop(var, None)
            zygote.process.terminate()
            zygote.process.wait(timeout=30)


@pytest.fixture(scope="session")
def executor_zygote(zygotes: dict[str, Path]) -> Path:
    return zygotes["RETOUCH_EXECUTOR_ZYGOTE"]


@pytest.fixture(scope="session")
def models_dir(shared_dir: Path) -> Path:
    """Demo models are built into this folder once per session."""
    return shared_dir / "models"


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL server for this test process (``make test`` installs Debian's
    postgresql when it is missing; elsewhere the tests that need it are skipped, saying why)."""
    programs = bin_dir()
    if programs is None:
        pytest.skip("no PostgreSQL server installed (make test installs Debian's postgresql)")
    pytest.importorskip("psycopg", reason="the postgres extra is not installed")
    server = PostgresServer(programs).start()
    try:
        yield server
    finally:
        server.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The end-to-end modules (real servers and executors: the longest files) first, the
    rest in their order after them. Under ``--dist loadfile`` a file runs on one worker, so
    a long file scheduled last leaves the other worker idle while it runs; with the long
    ones first, the many short files fill the gaps at the end. Stable: a module's tests keep
    their order (a module's fixtures rely on it)."""
    items.sort(key=lambda item: 0 if "e2e" in item.path.parts else 1)
