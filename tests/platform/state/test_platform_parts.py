"""Registry durability, token auth and placement in isolation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from retouch.functions.errors import Forbidden, InvalidSpec, Unauthorized
from retouch.functions.spec import parse_spec
from retouch.platform.control.placement import (
    LeastRequests,
    PlacementRequest,
    RoundRobin,
    make_placement,
)
from retouch.platform.state.auth import Principal, TokenAuth, parse_token_file
from retouch.platform.state.registry import Registry


def _spec(name: str = "fn"):
    return parse_spec(
        {
            "name": name,
            "model": "m",
            "family": "sd-inpaint",
            "resolution": 64,
            "templates": {"a": {"prompt": "x", "seed": 2}},
        }
    )


def test_registry_survives_restart_and_replaces_atomically(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    reg.put(_spec(), {"a": b"png-1"})
    reg.put(_spec(), {"a": b"png-2"})  # redeploy replaces
    reg.put(_spec("other"), {"a": b"png-3"})
    loaded = Registry(tmp_path).load_all()
    assert sorted(loaded) == ["fn", "other"]
    assert loaded["fn"].templates == {"a": b"png-2"} and loaded["fn"].spec == _spec()
    assert reg.delete("fn") and not reg.delete("fn")
    assert sorted(Registry(tmp_path).load_all()) == ["other"]


def test_registry_recovers_an_interrupted_swap(tmp_path: Path) -> None:
    reg = Registry(tmp_path)
    reg.put(_spec(), {"a": b"png"})
    live = tmp_path / "functions" / "fn"
    live.rename(tmp_path / "functions" / ".fn.old")  # crash after moving the old copy away
    (tmp_path / "functions" / ".other-staging").mkdir()  # and a half-written staging folder
    loaded = Registry(tmp_path).load_all()
    assert list(loaded) == ["fn"] and loaded["fn"].templates == {"a": b"png"}
    assert sorted(p.name for p in (tmp_path / "functions").iterdir()) == ["fn"]


def test_token_scopes(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# tokens\nadmin a-token\ninvoke i-token  # comment\n\n")
    auth = TokenAuth(parse_token_file(path))
    auth.authorize("a-token", "admin")
    auth.authorize("a-token", "invoke")
    auth.authorize("i-token", "invoke")
    with pytest.raises(Forbidden):
        auth.authorize("i-token", "admin")
    with pytest.raises(Unauthorized):
        auth.authorize("nope", "invoke")
    with pytest.raises(Unauthorized):
        auth.authorize(None, "invoke")
    assert TokenAuth().authorize(None, "admin") == Principal("anonymous", "admin")  # open
    path.write_text("root x\n")
    with pytest.raises(InvalidSpec):
        parse_token_file(path)


def test_a_token_acts_for_its_tenant(tmp_path: Path) -> None:
    """A token file's third column names the tenant; without one the tenant is derived
    from the token (stable) and does not contain it."""
    path = tmp_path / "tokens"
    path.write_text("invoke i-1 acme\ninvoke i-2 acme\ninvoke lone-token\nadmin a-1 ops\n")
    auth = TokenAuth(parse_token_file(path))
    assert auth.authorize("i-1", "invoke") == auth.authorize("i-2", "invoke")
    assert auth.authorize("i-1", "invoke").tenant == "acme"
    lone = auth.authorize("lone-token", "invoke").tenant
    assert lone == TokenAuth(parse_token_file(path)).authorize("lone-token", "invoke").tenant
    assert "lone-token" not in lone and lone.startswith("t-")
    admin = auth.authorize("a-1", "invoke")
    assert admin.admin and admin.owns("acme") and not auth.authorize("i-1", "invoke").owns(lone)
    for bad in ("invoke tok with space", "invoke tok bad/tenant", "invoke tok " + "x" * 65):
        path.write_text(bad + "\n")
        with pytest.raises(InvalidSpec):
            parse_token_file(path)


@dataclass
class _Exec:
    name: str
    inflight: int


def test_placement_policies() -> None:
    req = PlacementRequest("f", "t", 0.2)
    execs = [_Exec("a", 2), _Exec("b", 0), _Exec("c", 1)]
    assert LeastRequests().choose(execs, req).name == "b"
    rr = RoundRobin()
    assert [rr.choose(execs, req).name for _ in range(4)] == ["a", "b", "c", "a"]
    assert make_placement("least-requests").name == "least-requests"
    with pytest.raises(ValueError):
        make_placement("random")
