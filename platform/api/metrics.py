"""What the gateway reports: its Prometheus metrics (a registry of its own, one per gateway
instance), with the pool's own summaries (``fleet/report.py``) behind ``/metrics``.

Counters and histograms are fed as invocations end (:meth:`GatewayMetrics.observe`);
everything else is read at scrape time (``export_*``) from the parts that own it: the
executors' engines, the fleet, the dispatcher's queue and admission, jobs and webhooks."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from retouch.functions.wire.executor import AdapterStats, ExecutorState
from retouch.functions.wire.invoke import InvokePath, InvokeResult
from retouch.functions.wire.jobs import JobStatus
from retouch.platform.api.bodybudget import BodyBudget
from retouch.platform.api.imagegate import ImageGate
from retouch.platform.fleet.report import PoolReport
from retouch.platform.jobs.job import Job
from retouch.platform.jobs.webhooks import WebhookStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
QUEUE_EVENTS = (
    "rejected",
    "timed_out",
    "replaced",
    "refused",
    "admitted",
    "slo_rejected",
    "slo_dropped",
    "would_reject",
    "slo_probes",
)


@dataclass
class GatewayMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.invocations = Counter(
            "retouch_invocations", "Invocations answered", ["function", "path"], registry=r
        )
        self.errors = Counter(
            "retouch_errors", "Requests answered with an error", ["code", "status"], registry=r
        )
        self.latency = Histogram(
            "retouch_invocation_seconds",
            "End-to-end invocation latency at the gateway",
            ["function"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.run = Histogram(
            "retouch_invocation_run_seconds",
            "Executor run time of an invocation",
            ["function"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "retouch_invocation_queue_seconds",
            "Executor queue time of an invocation",
            ["function"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "retouch_gateway_overhead_seconds",
            "Gateway time per invocation outside the executor (total - queue - run)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=r,
        )
        self.mask_ratio = Histogram(
            "retouch_mask_ratio",
            "Mask ratio of invocations",
            buckets=(0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0),
            registry=r,
        )
        self.cache_reads = Counter(
            "retouch_template_reads",
            "Invocations by where their template's activations were when the invocation reached its executor, before the prefetch that starts then: host, disk, none (the full path); host / all is placement's template hit rate (retouch_prefetch_wait_seconds: what the reads then waited)",
            ["tier"],
            registry=r,
        )
        self.prefetch_wait = Histogram(
            "retouch_prefetch_wait_seconds",
            "Time an invocation waited for its template to become host-resident after it was due to run",
            buckets=(0.0001, 0.001, 0.01, 0.05, 0.1, 0.5, 1, 5),
            registry=r,
        )
        self.pre = Histogram(
            "retouch_invocation_pre_seconds",
            "Pre-processing (text/VAE encode) of an invocation",
            ["function"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.post = Histogram(
            "retouch_invocation_post_seconds",
            "Post-processing (VAE decode, image encoding) of an invocation",
            ["function"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.steps = Counter(
            "retouch_denoising_steps",
            "Denoising steps taken by invocations",
            ["function"],
            registry=r,
        )
        self.interruptions = Counter(
            "retouch_interruptions",
            "Non-denoising work the engine ran while an invocation was in its batch",
            ["function"],
            registry=r,
        )
        self.batch_size = Histogram(
            "retouch_batch_size",
            "Running batch size seen by each denoising step of an invocation",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
            registry=r,
        )
        self.engine = Gauge(
            "retouch_engine",
            "Per-executor engine state at scrape time: batch_overhead_ms_p50, step_ms_p50, batch_mean, plan_sparse_blocks, plan_blocks, load_wait_ms_p50, running, ready, preprocessing, alive; graph_layouts, graph_captures, graph_request_captures, graph_replays, graph_eager_steps, graph_over_budget, padded_tokens (totals since the executor started), graph_bytes, graph_budget_bytes",
            ["executor", "quantity"],
            registry=r,
        )
        self.adapter_events = Counter(
            "retouch_adapter_events",
            "LoRA adapter work in the executors: read (a file read, converted and its layers "
            "built, in the background), load (a file injected into a denoiser, between steps), swap (a step "
            "ran another adapter set than the step before), mixed_step (a step whose rows ran "
            "their own adapter sets' updates, no swap), eviction (a set unloaded for the "
            "adapter byte budget)",
            ["executor", "event"],
            registry=r,
        )
        self.adapter_seconds = Counter(
            "retouch_adapter_seconds",
            "Time the executors spent on LoRA adapters: read and build (background), inject and swap "
            "(the engine thread, between steps)",
            ["executor", "stage"],
            registry=r,
        )
        self._adapters_seen: dict[str, AdapterStats] = {}
        self.startup = Gauge(
            "retouch_executor_startup_seconds",
            "Each executor's start by phase (runtime/startup.py): process, store, workers, "
            "listening, first_edit (model empty); weights, profile, graphs per model",
            ["executor", "model", "phase"],
            registry=r,
        )
        self.executors = Gauge("retouch_executors_healthy", "Healthy executors", registry=r)
        self.functions = Gauge("retouch_functions", "Deployed functions", registry=r)
        self.pool = Gauge(
            "retouch_pool",
            "Executor pool at scrape time: ready, starting, draining, sleeping, waking, desired "
            "(the autoscaler's last decision), scale_ups and scale_downs (decisions since "
            "start), startup_s_p50, startup_s_max and startup_s_last (process start to ready, "
            "executors the autoscaler started cold), wakes, wake_s_p50, wake_s_max and "
            "wake_s_last (sleepers it woke: wake to ready), sleeping_host_bytes (what the "
            "sleepers hold of host memory)",
            ["quantity"],
            registry=r,
        )
        self.model_pool = Gauge(
            "retouch_model_pool",
            "Per model pool (--autoscale): ready, starting, draining, sleeping, waking executors "
            "of the model, "
            "desired (its autoscaler's last decision), scale_ups and scale_downs (decisions "
            "since start), no_device (ticks whose scale-up found no free device)",
            ["model", "quantity"],
            registry=r,
        )
        self.queue_length = Gauge(
            "retouch_queue_length", "Invocations waiting in the gateway for a slot", registry=r
        )
        self.queue_events = Gauge(
            "retouch_queue_events",
            "Gateway queue totals since start: admitted, rejected (429 overloaded), slo_rejected (429 slo_unattainable on arrival), slo_dropped (dropped from the queue, SLO out of reach), would_reject (admission dry run), slo_probes (admitted to re-check a learnt refusal on an idle executor), timed_out, replaced (re-placed after an executor was lost), refused (queued again after an executor shared with other gateways refused it as full)",
            ["event"],
            registry=r,
        )
        self.placement = Gauge(
            "retouch_placement",
            "Control plane at scrape time: decision_ms_p50/p99 (a placement choice), admission_ms_p50/p99 (an SLO check), prediction_error_p50/p90 (|predicted - actual| / actual completion, recent invocations)",
            ["quantity"],
            registry=r,
        )
        self.slo = Counter(
            "retouch_slo",
            "Completed invocations of functions with an SLO: met or missed",
            ["function", "outcome"],
            registry=r,
        )

        self.jobs = Gauge(
            "retouch_jobs",
            "Jobs held by the gateway, by status (at scrape time)",
            ["status"],
            registry=r,
        )
        self.webhooks = Gauge(
            "retouch_webhook_deliveries",
            "Webhook deliveries since start: outcome delivered or failed (by event), retried, dropped",
            ["event", "outcome"],
            registry=r,
        )
        self.decodes = Gauge(
            "retouch_image_decodes",
            "Image decodes (uploads, masks) at scrape time: decoded (since start), budget_bytes, "
            "reserved_bytes (decodes in flight), peak_reserved_bytes, waited (decodes that "
            "queued for the budget, since start)",
            ["quantity"],
            registry=r,
        )
        self.bodies = Gauge(
            "retouch_request_bodies",
            "Request bodies held at scrape time: budget_bytes, held_bytes, peak_held_bytes, "
            "refused (429 too_many_bodies, since start)",
            ["quantity"],
            registry=r,
        )

    def observe(
        self, function: str, result: InvokeResult, mask_ratio: float, slo_ms: float | None
    ) -> None:
        """One answered invocation: its path, timings, batch and (with an SLO) the outcome;
        ``mask_ratio`` as the gateway measured it (what admission saw)."""
        t = result.timings
        self.invocations.labels(function, result.path.value).inc()
        self.cache_reads.labels(result.cache.found.value).inc()
        if result.path is InvokePath.MASKAWARE:
            self.prefetch_wait.observe(result.cache.wait_ms / 1e3)
        self.latency.labels(function).observe(t.total_ms / 1e3)
        self.run.labels(function).observe(t.run_ms / 1e3)
        self.queue.labels(function).observe(t.queue_ms / 1e3)
        self.overhead.observe(max(0.0, t.total_ms - t.run_ms - t.queue_ms) / 1e3)
        self.mask_ratio.observe(mask_ratio)
        if slo_ms is not None:
            self.slo.labels(function, "met" if t.total_ms <= slo_ms else "missed").inc()
        self.pre.labels(function).observe(t.pre_ms / 1e3)
        self.post.labels(function).observe(t.post_ms / 1e3)
        self.steps.labels(function).inc(result.engine.steps)
        self.interruptions.labels(function).inc(result.engine.interruptions)
        for size in result.engine.batch_sizes:
            self.batch_size.observe(size)

    def export_engine(self, state: ExecutorState) -> None:
        """Per-step figures live in the executors; they are read at scrape time."""
        engine = state.engine
        values = {
            "batch_overhead_ms_p50": engine.batch_overhead_ms_p50,
            "step_ms_p50": engine.step_ms_p50,
            "batch_mean": engine.batch_mean,
            "load_wait_ms_p50": engine.load_wait_ms_p50,
            "plan_sparse_blocks": engine.plan_sparse_blocks,
            "plan_blocks": engine.plan_blocks,
            "running": engine.running,
            "ready": engine.ready,
            "preprocessing": engine.preprocessing,
            "alive": float(engine.alive),
            # mask-aware steps from graphs: totals since the executor started
            "graph_layouts": engine.graph_layouts,
            "graph_captures": engine.graph_captures,
            "graph_replays": engine.graph_replays,
            "graph_request_captures": engine.graph_request_captures,
            "graph_eager_steps": engine.graph_eager_steps,
            "graph_over_budget": engine.graph_over_budget,
            "graph_bytes": engine.graph_bytes,
            "graph_budget_bytes": engine.graph_budget_bytes,
            "padded_tokens": engine.padded_tokens,
        }
        for quantity, value in values.items():
            if value is not None:
                self.engine.labels(state.name, quantity).set(float(value))

    def export_startup(self, state: ExecutorState) -> None:
        for phase, ms in state.startup_ms.items():
            self.startup.labels(state.name, "", phase).set(ms / 1e3)
        for model, phases in state.model_startup_ms.items():
            for phase, ms in phases.items():
                self.startup.labels(state.name, model, phase).set(ms / 1e3)

    def export_adapters(self, state: ExecutorState) -> None:
        """The executor's adapter counters, added as they grew since the last scrape (an
        executor that restarted counts from zero again)."""
        now = state.adapter_stats
        seen = self._adapters_seen.get(state.name, AdapterStats())
        if now.loads < seen.loads or now.reads < seen.reads or now.swaps < seen.swaps:
            seen = AdapterStats()  # a new executor process under the same name
        self._adapters_seen[state.name] = now
        events = {
            "read": now.reads - seen.reads,
            "load": now.loads - seen.loads,
            "swap": now.swaps - seen.swaps,
            "mixed_step": now.mixed_steps - seen.mixed_steps,
            "eviction": now.evictions - seen.evictions,
        }
        for event, grew in events.items():
            if grew > 0:
                self.adapter_events.labels(state.name, event).inc(grew)
        stages = {
            "read": now.read_ms - seen.read_ms,
            "inject": now.inject_ms - seen.inject_ms,
            "swap": now.swap_ms - seen.swap_ms,
        }
        for stage, grew_ms in stages.items():
            if grew_ms > 0:
                self.adapter_seconds.labels(state.name, stage).inc(grew_ms / 1e3)

    def export_jobs(self, jobs: Iterable[Job], webhooks: WebhookStats) -> None:
        counts = dict.fromkeys(JobStatus, 0)
        for job in jobs:
            if job.durable:
                counts[job.status] += 1
        for status, n in counts.items():
            self.jobs.labels(status.value).set(n)
        for event, n in webhooks.delivered.items():
            self.webhooks.labels(event, "delivered").set(n)
        for event, n in webhooks.failed.items():
            self.webhooks.labels(event, "failed").set(n)
        self.webhooks.labels("", "retried").set(webhooks.retried)
        self.webhooks.labels("", "dropped").set(webhooks.dropped)

    def export_decodes(self, gate: ImageGate) -> None:
        budget = gate.budget
        self.decodes.labels("decoded").set(gate.decoded)
        self.decodes.labels("budget_bytes").set(budget.capacity)
        self.decodes.labels("reserved_bytes").set(budget.in_use)
        self.decodes.labels("peak_reserved_bytes").set(budget.peak)
        self.decodes.labels("waited").set(budget.waited)

    def export_bodies(self, bodies: BodyBudget) -> None:
        self.bodies.labels("budget_bytes").set(bodies.capacity)
        self.bodies.labels("held_bytes").set(bodies.in_use)
        self.bodies.labels("peak_held_bytes").set(bodies.peak)
        self.bodies.labels("refused").set(bodies.refused)

    def export_pool(self, report: PoolReport) -> None:
        """The pool, its model pools, the gateway queue and the placement figures."""
        self.executors.set(sum(e.healthy for e in report.fleet.executors))
        for quantity, value in report.pool_summary().items():
            self.pool.labels(quantity).set(value)
        for model, summary in report.model_pool_summaries().items():
            for quantity, value in summary.items():
                self.model_pool.labels(model, quantity).set(value)
        queue = report.dispatcher.queue
        self.queue_length.set(len(queue))
        for event in QUEUE_EVENTS:
            self.queue_events.labels(event).set(getattr(queue.stats, event))
        for quantity, value in report.placement_summary().items():
            self.placement.labels(quantity).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def latency_summary(self) -> dict[str, int | float | None]:
        """Invocations answered and their end-to-end latency p50/p95 (seconds, None before
        the first), over every function: the web page's dashboard, which reads the API
        (``/v1/executors``) and not the metrics listener."""
        buckets: dict[float, float] = {}
        count = 0.0
        for family in self.latency.collect():
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
        ordered = sorted(buckets.items())
        return {
            "invocations": int(count),
            "p50_s": _histogram_quantile(ordered, 0.5),
            "p95_s": _histogram_quantile(ordered, 0.95),
        }


def _histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """A quantile from cumulative ``(le, count)`` buckets, interpolated within its bucket
    as Prometheus' ``histogram_quantile`` does (None: no observation)."""
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return None
    rank, low, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return low
            width = count - below
            return low + (le - low) * ((rank - below) / width if width else 1.0)
        low, below = le, count
    return low
