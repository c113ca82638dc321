"""Model families: the one place that knows what differs between diffusers pipelines.

Each family is one module here exposing ``FAMILY``, an object of a :class:`Family`
subclass: which pipeline class it loads and how, which components a pre/post worker leaves
out, how it binds to a loaded pipeline (a :class:`FamilyModel`: the prepare / step / decode
split and the block wrappers, attached as declared attention processors, module wrappers
and hooks), the row layout of its cached tensors, its FLOP formulas and its token grid.
The two base classes (:mod:`retouch.runtime.families.base`) are the protocol and hold what
the inpaint families share. Everything else asks the family object; nothing outside this
package compares family names or pipeline classes.

Adding a family: write ``<family>.py`` with its ``FAMILY``, add its torch-free row to
``retouch.functions.families`` and its module name to :data:`MODULES` below
(``docs/architecture.md``, "Model families", has the steps).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence

from retouch.runtime.families.base import Family, FamilyModel

__all__ = ["MODULES", "Family", "FamilyModel", "family", "names"]

# Registrations: the modules of this package that define a family (``FAMILY``).
MODULES = (
    "sd_inpaint",
    "sdxl_inpaint",
    "flux_inpaint",
    "sd3_inpaint",
    "flux_fill",
    "flux_kontext",
    "flux2_klein",
    "qwen_image",
    "qwen_image_edit",
    "z_image",
)


@functools.cache
def _registry() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for module in MODULES:
        family = importlib.import_module(f"{__name__}.{module}").FAMILY
        found[family.name] = family
    return found


def family(name: str) -> Family:
    """The family named ``name``; ``ValueError`` if none is registered."""
    try:
        return _registry()[name]
    except KeyError:
        raise ValueError(f"no runtime family {name!r}; registered: {names()}") from None


def names() -> Sequence[str]:
    return tuple(_registry())
