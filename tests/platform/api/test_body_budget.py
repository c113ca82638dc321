"""The body budget (no processes): request bodies held at once are bounded in bytes; a
request that does not fit is a 429 before its body is read, and its room comes back once
the request that held it is answered."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from retouch.functions.errors import BadRequest, Overloaded
from retouch.platform.api.bodybudget import BodyBudget

MAX_BODY = 1000


def post(length: str | None) -> Request:
    headers = [] if length is None else [(b"content-length", length.encode())]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers})


def test_bodies_held_at_once_stay_within_the_budget() -> None:
    bodies = BodyBudget(1500)
    with bodies.hold(post("600"), MAX_BODY), bodies.hold(post("600"), MAX_BODY):
        assert bodies.in_use == 1200
        with pytest.raises(Overloaded) as refused, bodies.hold(post("600"), MAX_BODY):
            pass
        assert refused.value.code == "too_many_bodies" and refused.value.status == 429
        with bodies.hold(post("300"), MAX_BODY):  # what still fits is taken
            assert bodies.in_use == 1500
    assert bodies.in_use == 0 and bodies.peak == 1500 and bodies.refused == 1


def test_a_body_of_undeclared_length_reserves_the_most_a_body_may_be() -> None:
    bodies = BodyBudget(1500)
    with bodies.hold(post(None), MAX_BODY):
        assert bodies.in_use == MAX_BODY
        with pytest.raises(Overloaded), bodies.hold(post(None), MAX_BODY):
            pass


def test_the_room_comes_back_when_the_request_fails() -> None:
    bodies = BodyBudget(1000)
    with pytest.raises(RuntimeError), bodies.hold(post("900"), MAX_BODY):
        raise RuntimeError("the request failed")
    with bodies.hold(post("900"), MAX_BODY):
        assert bodies.in_use == 900


def test_a_body_above_the_whole_budget_is_held_alone() -> None:
    bodies = BodyBudget(500)
    with bodies.hold(post("900"), MAX_BODY):
        assert bodies.in_use == 500
        with pytest.raises(Overloaded), bodies.hold(post("1"), MAX_BODY):
            pass
    with bodies.hold(post("900"), MAX_BODY):
        pass


def test_a_malformed_length_is_a_structured_400() -> None:
    with pytest.raises(BadRequest) as bad, BodyBudget(500).hold(post("1_0"), MAX_BODY):
        pass
    assert bad.value.field == "content-length"
