"""Where each template's activations rest on one executor, as the gateway knows it.

The executor reports its templates' states (after a deploy, a bake or an eviction); in
between, the gateway moves them itself on the events it sees: an invocation placed
(its template prefetched into the host tier, or its bake queued), a result (the template
it read now the host tier's most recent, or baking after a full-path run). The host tier
is an LRU of known capacity, mirrored here so its evictions to disk are known without
asking. Nothing here does I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from enum import StrEnum

from retouch.functions.wire.executor import BakeState, ExecutorState, TemplateStatus
from retouch.functions.wire.invoke import CacheTier, InvokePath, InvokeResult

Key = tuple[str, str]  # (function, template)


class Residency(StrEnum):
    """Where a template's activations are on one executor, as the gateway knows it."""

    DEVICE = "device"  # in the device tier (GPU memory): its steps load no rows
    HOST = "host"
    DISK = "disk"
    BAKING = "baking"
    ABSENT = "absent"


HELD = (Residency.DEVICE, Residency.HOST)  # in memory: no disk load
BAKED = (Residency.DEVICE, Residency.HOST, Residency.DISK)  # baked here: the sparse path


def baked_tier(status: TemplateStatus) -> Residency:
    """The fastest tier a baked template's executor reports it in."""
    if status.device:
        return Residency.DEVICE
    return Residency.HOST if status.host else Residency.DISK


class TemplateTiers(OrderedDict[Key, Residency]):
    """Each template's tier on one executor, least recently used first (event-loop state)."""

    def tier(self, function: str, template: str) -> Residency:
        return self.get((function, template), Residency.ABSENT)

    def observe(self, state: ExecutorState) -> int | None:
        """The tiers the executor reports; the host tier's capacity in templates they
        imply (None: not known from this report)."""
        sizes = []
        for function, templates in state.templates.items():
            for template, status in templates.items():
                key = (function, template)
                if status.state is BakeState.BAKED:
                    tier = baked_tier(status)
                    if status.bytes:
                        sizes.append(status.bytes)
                elif status.state in (BakeState.BAKING, BakeState.QUEUED):
                    tier = Residency.BAKING
                else:
                    tier = Residency.ABSENT
                if tier in HELD:
                    self[key] = tier
                    self.move_to_end(key)
                elif self.get(key) not in HELD or tier is Residency.ABSENT:
                    self[key] = tier
        cache = state.cache
        if cache.host_budget_bytes and (sizes or cache.host_templates):
            each = sum(sizes) / len(sizes) if sizes else cache.host_bytes / cache.host_templates
            return max(1, int(cache.host_budget_bytes // max(1.0, each)))
        return None

    def expect(self, key: Key, capacity: int | None) -> None:
        """Where the template an invocation reads will be once the executor has it: it
        prefetches a template on disk into its host tier on arrival, and queues the bake
        of one it lacks. Learning this only from results let every arrival of a popular
        template during the first one's edit look elsewhere (16 simulated executors
        holding 3 of 48 templates each: host hit rate 0.13)."""
        tier = self.get(key, Residency.ABSENT)
        if tier is Residency.DEVICE:
            self.move_to_end(key)
        elif tier in (Residency.HOST, Residency.DISK):
            self.hosted(key, capacity)
        elif tier is Residency.ABSENT:
            self[key] = Residency.BAKING

    def touch(self, key: Key, result: InvokeResult, capacity: int | None) -> None:
        """An edit read its template: now host-resident (most recent); an edit that ran the
        full path leaves it baking. The host tier's LRU is mirrored to know evictions."""
        if result.path is InvokePath.STOCK:
            self[key] = Residency.BAKING
            return
        if result.cache.tier is CacheTier.DEVICE:
            self[key] = Residency.DEVICE
            self.move_to_end(key)
            return
        self.hosted(key, capacity)

    def hosted(self, key: Key, capacity: int | None) -> None:
        """``key`` is now the host tier's most recent; what the LRU evicts (beyond
        ``capacity`` templates, if known) goes to disk."""
        self[key] = Residency.HOST
        self.move_to_end(key)
        if capacity is None:
            return
        hosted = [k for k, tier in self.items() if tier is Residency.HOST]
        for old in hosted[: max(0, len(hosted) - capacity)]:
            self[old] = Residency.DISK

    def victim(self, capacity: int | None) -> Key | None:
        """The template a load into the host tier would evict (its least recently used),
        or None while the tier has room or its size is unknown."""
        if capacity is None:
            return None
        hosted = [k for k, tier in self.items() if tier is Residency.HOST]
        return hosted[0] if len(hosted) >= capacity else None
