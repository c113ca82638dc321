"""The device tier's bookkeeping (on CPU memory): promotion, LRU eviction that spares held
templates, and a drop that refuses a copy of the old activations still in flight."""

from __future__ import annotations

import threading

import torch

from retouch.cachestore.devicetier import DeviceTier


class Source:
    """A host-tier handle stand-in: 2 steps of one 4 KiB tensor, plus step -1."""

    def __init__(self, value: float, gate: threading.Event | None = None) -> None:
        self.tensors = {
            (s, "b", "k"): torch.full((1, 64, 16), value + s, dtype=torch.float32)
            for s in (-1, 0, 1)
        }
        self.gate = gate
        self.released = False
        self.meta = {"function": "f"}

    def slots(self):
        if self.gate is not None:
            self.gate.wait(10)
        return list(self.tensors)

    def get(self, step, block, name):
        return self.tensors[(step, block, name)]

    def release(self):
        self.released = True


STEP_BYTES = 64 * 16 * 4  # one step's tensor


def test_promote_evict_and_keep_held_templates() -> None:
    tier = DeviceTier(torch.device("cpu"), budget=2 * 2 * STEP_BYTES)  # two templates
    sources = {k: Source(i * 10.0) for i, k in enumerate("abc")}
    for key in "ab":
        tier.promote(key, lambda k=key: sources[k])
        tier.wait()
    held = tier.acquire("a")
    assert held is not None and torch.equal(held.get(1, "b", "k"), sources["a"].get(1, "b", "k"))
    assert sources["a"].released  # the copier gives its host handle back
    tier.promote("c", lambda: sources["c"])  # room is made by evicting "b", not the held "a"
    tier.wait()
    assert tier.acquire("b") is None and tier.acquire("c") is not None
    assert tier.usage()["device_evictions"] == 1
    assert tier.keys() == {"a", "c"}  # what the executor reports as device-resident
    held.release()


def test_a_template_that_cannot_fit_evicts_nothing() -> None:
    tier = DeviceTier(torch.device("cpu"), budget=3 * STEP_BYTES)
    tier.promote("a", lambda: Source(1.0))
    tier.wait()
    held = tier.acquire("a")  # held: it cannot make room
    tier.promote("b", lambda: Source(2.0))
    tier.wait()
    assert tier.acquire("b") is None and tier.usage()["device_skips"] == 1
    assert tier.usage()["device_templates"] == 1 and tier.usage()["device_evictions"] == 0
    held.release()


def test_drop_refuses_a_copy_of_old_activations_in_flight() -> None:
    tier = DeviceTier(torch.device("cpu"), budget=1 << 20)
    gate = threading.Event()
    tier.promote("t", lambda: Source(1.0, gate))  # the copy of the old bake waits
    tier.drop("t")  # re-baked meanwhile
    tier.promote("t", lambda: Source(5.0))  # the new bake may be promoted at once
    gate.set()
    tier.wait()
    resident = tier.acquire("t")
    assert resident is not None and float(resident.get(0, "b", "k")[0, 0, 0]) == 5.0
    resident.release()
    tier.close()
