"""The tests' gateways, forked from one warm process: ``retouch serve``'s imports (numpy,
httpx, pydantic's wire models, starlette, uvicorn and the platform's own modules: about
1.3 s of CPU on the 2-core VM) are paid once per test process instead of once per gateway,
and the suite starts about fifty.

The fork server is the executor zygote's loop (``runtime/executor/zygote.py``) with the
``retouch`` command as its entry; :class:`~retouch.platform.api.server.ServerProcess`
starts its gateways from it where ``RETOUCH_GATEWAY_ZYGOTE`` names its socket
(``tests/conftest.py``). The gateway is the same code, in a process of its own: only the
imports are skipped. It watches the zygote, its parent (``--exit-with-parent``, the pid
the starter reads from the connection), and the zygote stops it when the starter's
connection closes, as for executors (``tests/e2e/test_zygote.py``). Tests of the command
itself (``tests/e2e/test_nothing_left.py``) start it afresh.

``python -m tests.gatewayzygote --socket PATH [--ready-file PATH]``
"""

from __future__ import annotations

from collections.abc import Callable

from retouch.runtime.executor.zygote import run_zygote


def _retouch_main() -> Callable[[list[str]], None]:
    import retouch.platform.api.server  # noqa: F401  (`serve`'s own, imported as it runs)
    from retouch.platform.cli.main import main

    return main


def main(argv: list[str] | None = None) -> None:
    run_zygote("retouch-gateway-zygote", argv, _retouch_main, "retouch")


if __name__ == "__main__":
    main()
