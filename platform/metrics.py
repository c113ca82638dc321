"""Prometheus metrics of the gateway, on a registry of its own (one per gateway instance)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from retouch.functions import wire

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)


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
            "Per-executor engine state at scrape time: batch_overhead_ms_p50, step_ms_p50, batch_mean, plan_sparse_blocks, plan_blocks, load_wait_ms_p50, running, ready, preprocessing, alive",
            ["executor", "quantity"],
            registry=r,
        )
        self.executors = Gauge("retouch_executors_healthy", "Healthy executors", registry=r)
        self.functions = Gauge("retouch_functions", "Deployed functions", registry=r)
        self.pool = Gauge(
            "retouch_pool",
            "Executor pool at scrape time: ready, starting, draining, desired (the autoscaler's "
            "last decision), scale_ups and scale_downs (decisions since start), startup_s_p50 "
            "and startup_s_max (process start to ready, executors the autoscaler started)",
            ["quantity"],
            registry=r,
        )
        self.model_pool = Gauge(
            "retouch_model_pool",
            "Per model pool (--autoscale): ready, starting, draining executors of the model, "
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
            "Gateway queue totals since start: admitted, rejected (429 overloaded), slo_rejected (429 slo_unattainable on arrival), slo_dropped (dropped from the queue, SLO out of reach), would_reject (admission dry run), slo_probes (admitted to re-check a learnt refusal on an idle executor), timed_out, replaced (re-placed after an executor was lost)",
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

    def observe(
        self, function: str, result: wire.InvokeResult, mask_ratio: float, slo_ms: float | None
    ) -> None:
        """One answered invocation: its path, timings, batch and (with an SLO) the outcome;
        ``mask_ratio`` as the gateway measured it (what admission saw)."""
        t = result.timings
        self.invocations.labels(function, result.path.value).inc()
        self.cache_reads.labels(result.cache.found.value).inc()
        if result.path is wire.InvokePath.MASKAWARE:
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
