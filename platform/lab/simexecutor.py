"""A simulated executor's state: its batch, host tier, adapter sets and worker lines,
and the rules the real engine and store follow on them (LRU host tier, adapter turns).
The events that change this state over time are the simulation's (``simulator.py``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from retouch.platform.control.cluster import ExecutorView
from retouch.platform.lab.simworkload import Job


@dataclass
class WorkerLine:
    """An executor's pre (or post) worker processes: as many encodes (decodes) at once as
    there are workers (0: no limit); the others wait in line, each with its work and what
    follows it."""

    workers: int
    busy: int = 0
    waiting: deque[tuple[float, Callable[[], None]]] = field(default_factory=deque)


@dataclass(eq=False)
class SimExecutor:
    """What the policy sees (name, inflight, slots, view) and the simulated engine."""

    name: str
    view: ExecutorView
    slots: int
    inflight: int = 0
    running: list[Job] = field(default_factory=list)
    ready: deque[Job] = field(default_factory=deque)  # encoded, waiting to join
    stepping: bool = False
    busy_s: float = 0.0
    started_at: float = 0.0
    stopped_at: float | None = None
    draining: bool = False  # chosen for scale-down: no new work, stops once idle
    asleep_since: float | None = None  # asleep (simsleep.py): no work, no device held
    slept_s: float = 0.0  # asleep in all, before the current sleep
    host: OrderedDict[str, None] = field(default_factory=OrderedDict)  # host tier, LRU first
    bakes: deque[tuple[str, float]] = field(default_factory=deque)  # (template, queued at)
    loads: dict[str, float] = field(default_factory=dict)  # template -> when its load ends
    encoders: WorkerLine = field(default_factory=lambda: WorkerLine(0))  # its pre workers
    decoders: WorkerLine = field(default_factory=lambda: WorkerLine(0))  # its post workers
    adapters: OrderedDict[str, None] = field(default_factory=OrderedDict)  # on device, LRU first
    adapter_loads: dict[str, float] = field(default_factory=dict)  # set -> when its load ends
    adapter_users: dict[str, int] = field(default_factory=dict)  # set -> invocations bound
    applied: str = ""  # the adapter set whose weights the model runs with ("": none)

    def host_insert(self, template: str, capacity: int) -> None:
        """``template`` into the host tier, evicting the least recently used beyond
        ``capacity`` templates (0: no limit)."""
        self.host[template] = None
        self.host.move_to_end(template)
        while capacity and len(self.host) > capacity:
            gone, _ = self.host.popitem(last=False)
            self.loads.pop(gone, None)

    def bind_adapter(self, job: Job, now: float, load_s: float, resident: int) -> bool:
        """``job``'s adapter set here: held (its load may still be under way: it waits for
        the same load) or loaded from disk from ``now`` on (``load_s``), the least recently
        used sets not in use evicted beyond ``resident``; the executor reports its sets when
        they change. True when the set's load starts here."""
        adapter_set = job.request.adapter_set
        if not adapter_set:
            return False
        self.adapter_users[adapter_set] = self.adapter_users.get(adapter_set, 0) + 1
        if adapter_set in self.adapters:
            self.adapters.move_to_end(adapter_set)
            job.adapter_s = max(0.0, self.adapter_loads.get(adapter_set, 0.0) - now)
            return False
        job.adapter_s = load_s
        self.adapters[adapter_set] = None
        self.adapter_loads[adapter_set] = now + load_s
        idle = [s for s in self.adapters if not self.adapter_users.get(s)]
        for gone in idle[: max(0, len(self.adapters) - resident)]:
            del self.adapters[gone]
            self.adapter_loads.pop(gone, None)
        self.view.observe_adapters(list(self.adapters))
        return True

    def release_adapter(self, job: Job) -> None:
        """``job``'s steps are done: its set may be evicted once no other invocation uses
        it."""
        adapter_set = job.request.adapter_set
        if adapter_set:
            self.adapter_users[adapter_set] -= 1

    def next_group(self, mixed: bool) -> list[Job]:
        """The batch group that steps next: every running invocation in mixed batching,
        else the running invocations of one adapter set. The sets take turns in the order
        they joined, from the one after the set applied now (the first, once the applied
        set's group has left)."""
        if mixed:
            return list(self.running)
        order = list(dict.fromkeys(j.request.adapter_set for j in self.running))
        turn = order[0]
        if len(order) > 1 and self.applied in order:
            turn = order[(order.index(self.applied) + 1) % len(order)]
        return [j for j in self.running if j.request.adapter_set == turn]


def victims(active: list[SimExecutor], count: int) -> list[SimExecutor]:
    """A scale-down's executors: least predicted work first, newest first among equals (a
    cold cache is the cheapest to lose)."""
    ranked = sorted(active, key=lambda e: (e.view.work_s(), -e.started_at))
    return ranked[: min(count, len(active))]
