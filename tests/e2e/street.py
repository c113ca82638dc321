"""A small function for tests that need one served: ``tiny-sd`` with its ``street``
template only, few steps, deployed and ready."""

from __future__ import annotations

import dataclasses
from typing import Any

from retouch.platform.api.client import Client, read_spec_file
from tests.support import EXAMPLES

from .conftest import ADMIN


def deploy_street(url: str, name: str, steps: int, **changes: Any) -> None:
    """Deploy ``name`` (``changes`` replace spec fields) and wait until it is ready."""
    spec, images = read_spec_file(EXAMPLES / "tiny-sd.toml")
    spec = dataclasses.replace(
        spec, name=name, steps=steps, templates={"street": spec.templates["street"]}, **changes
    )
    with Client(url, ADMIN) as admin:
        assert admin.deploy(spec, {"street": images["street"]})["status"] == "ready"
