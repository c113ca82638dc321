"""The executor's template table: a bake nobody wants any more (the function deleted, or
redeployed with other settings) is not run, or stops between its steps, and stores nothing."""

from __future__ import annotations

from pathlib import Path

from retouch.cachestore.store import ActivationStore, StoreConfig, Tier
from retouch.functions.demo.images import template_image
from retouch.functions.spec import parse_spec
from retouch.functions.wire.executor import BakeState
from retouch.runtime.maskaware.editor import BakeCancelled
from retouch.runtime.templates import Template, TemplateCache


def _register(cache: TemplateCache, steps: int) -> Template:
    spec = parse_spec(
        {
            "name": "fn",
            "model": "m",
            "family": "flux-inpaint",
            "resolution": 64,
            "steps": steps,
            "templates": {"t": {"prompt": "a quiet street", "seed": 1}},
        }
    )
    (template,) = cache.register(spec, {"t": template_image((64, 64), seed=1)}, "model-fp", {})
    return template


def _store(path: Path) -> ActivationStore:
    return ActivationStore(StoreConfig(path=path, host_budget_bytes=1 << 26, map_size=1 << 26))


def test_a_redeploy_with_other_settings_leaves_the_old_bake_unwanted(tmp_path: Path) -> None:
    with _store(tmp_path / "c") as store:
        cache = TemplateCache(store)
        old = _register(cache, steps=4)
        assert cache.claim_bake(old) and not cache.unwanted(old)
        same = _register(cache, steps=4)  # same settings, same key: its bake is still wanted
        assert same.key == old.key and not cache.unwanted(old)
        _register(cache, steps=5)  # other settings: the queued bake is not run
        assert cache.unwanted(same)
        ran: list[str] = []
        cache.bake(same, lambda writer: ran.append("recorded"))
        assert ran == [] and same.state is BakeState.UNBAKED
        assert store.tier(same.key) is Tier.NONE


def test_a_deleted_functions_running_bake_stores_nothing(tmp_path: Path) -> None:
    with _store(tmp_path / "c") as store:
        cache = TemplateCache(store)
        template = _register(cache, steps=4)
        assert cache.claim_bake(template)

        def record(writer) -> None:  # a bake whose function is deleted mid-way
            cache.detach("fn")
            assert cache.unwanted(template)
            raise BakeCancelled("stopped between two steps")

        cache.bake(template, record)
        assert template.state is BakeState.UNBAKED and template.error is None
        assert store.tier(template.key) is Tier.NONE
