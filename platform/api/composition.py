"""A gateway composed from ``retouch serve``'s settings: the one place that reads the
config and decides what each part is (its home, alone or shared; the pool and its
provider; the job store, webhook sender and front door; the limits and link keys). The
gateway (``platform/api/gateway.py``) gets the parts built and holds only its routes.
"""

from __future__ import annotations

import logging
import secrets

from retouch.functions.imaging import MAX_PIXELS
from retouch.platform.api.bodybudget import BodyBudget
from retouch.platform.api.config import ServeConfig
from retouch.platform.api.frontdoor import FrontDoor
from retouch.platform.api.gateway import Gateway
from retouch.platform.api.home import Home, LocalHome, SharedHome
from retouch.platform.api.imagegate import DecodeBudget, ImageGate
from retouch.platform.api.limits import GatewayLimits
from retouch.platform.api.metrics import GatewayMetrics
from retouch.platform.api.remoteinputs import InputFetcher
from retouch.platform.api.served import ServedFunctions
from retouch.platform.control.placement import make_placement
from retouch.platform.control.queue import QueueLimits
from retouch.platform.fleet.deployed import DeployedFunction
from retouch.platform.fleet.dispatch import RetryPolicy
from retouch.platform.fleet.pool import ExecutorPool
from retouch.platform.fleet.providers import AttachProvider, LocalProvider, Provider
from retouch.platform.fleet.sleepers import SleepPolicy
from retouch.platform.jobs.allowlist import AllowList
from retouch.platform.jobs.links import LinkSigner, bind_url, check_public_url
from retouch.platform.jobs.retention import RetentionLimits
from retouch.platform.jobs.webhooks import WebhookSender
from retouch.platform.state.auth import load_auth
from retouch.platform.state.catalogue import ModelCatalogue
from retouch.platform.state.statestore import StateStore
from retouch.runtime.executor.app import read_token

log = logging.getLogger(__name__)


def build_gateway(config: ServeConfig) -> Gateway:
    config.data_dir.mkdir(parents=True, exist_ok=True)
    auth = load_auth(config.token_file)
    if not auth.enabled:
        log.warning(
            "no tokens configured: the API is open to anyone who can reach %s:%d",
            config.host,
            config.port,
        )
    retention = RetentionLimits(
        config.max_live_jobs,
        config.max_live_jobs_per_tenant,
        config.max_retained_bytes,
        config.max_retained_bytes_per_tenant,
    )
    pool = make_pool(config)
    home = make_home(config, retention)
    metrics = GatewayMetrics()
    limits = GatewayLimits.resolve(
        config.max_image_pixels or MAX_PIXELS,
        config.decode_memory_bytes,
        config.body_memory_bytes,
        retention,
    )
    bodies = BodyBudget(limits.body_bytes)
    links = LinkSigner(
        home.link_keys(config.link_key_file),
        check_public_url(config.public_url or bind_url(config.host, config.port)),
    )
    webhooks = WebhookSender(
        home.webhook_secret(config.webhook_secret),
        AllowList.parse(config.webhook_allow),
        journal=home.deliveries,
        public_url=links.base_url,
    )
    fetch_allow = (
        AllowList.parse(config.fetch_allow, "--fetch-allow", "fetch_not_allowed")
        if config.fetch_allow
        else None
    )
    functions: dict[str, DeployedFunction] = {}
    door = FrontDoor(
        functions,
        pool.dispatcher,
        metrics,
        home.jobs,
        ImageGate(limits.max_pixels, DecodeBudget(limits.decode_bytes)),
        names=home.uploads,
        retention_s=config.job_retention_s,
        progress_interval_s=config.progress_interval_s,
        notify=webhooks.notify,
        limits=retention,
        links=links,
    )
    return Gateway(
        home=home,
        pool=pool,
        auth=auth,
        served=ServedFunctions(home.registry, pool, metrics, functions),
        door=door,
        webhooks=webhooks,
        inputs=InputFetcher(fetch_allow, config.max_body_bytes, bodies, webhooks.resolver),
        bodies=bodies,
        limits=limits,
        uploads=home.uploads,
        links=links,
        models=ModelCatalogue.load(config.model_catalogue),
        metrics=metrics,
        max_body=config.max_body_bytes,
    )


def make_home(config: ServeConfig, retention: RetentionLimits) -> Home:
    """The shared store's home with ``--state-store``, else the data dir's."""
    if config.state_store is None:
        return LocalHome(config.data_dir)
    state = StateStore(config.state_store, config.state_store_ttl_s).open()
    return SharedHome(state, retention, config.job_retention_s)


def make_pool(config: ServeConfig) -> ExecutorPool:
    """The executor pool: its provider, placement, queue limits and retries."""
    limits = QueueLimits(
        config.max_queued,
        config.max_queued_per_function,
        config.queue_timeout_s,
        admission=config.admission,
        dry_run=config.admission_dry_run,
        margin_quantile=config.admission_quantile,
    )
    return ExecutorPool(
        make_provider(config),
        make_placement(config.placement),
        limits,
        RetryPolicy(config.max_attempts, config.invoke_timeout_s),
        autoscale=config.autoscale or config.autoscale_dry_run,
        autoscale_dry_run=config.autoscale_dry_run,
        drain_timeout_s=config.drain_timeout_s,
        sleep=SleepPolicy(config.sleep_keep_s, config.sleep_host_bytes),
    )


def make_provider(config: ServeConfig) -> Provider:
    """The provider ``--provider`` names (Ray is imported only when chosen). Executors the
    gateway starts accept a per-run internal token; attached ones the token they were
    started with (``--executor-token-file`` or ``$RETOUCH_EXECUTOR_TOKEN``)."""
    if config.provider == "attach":
        return AttachProvider(config.executor_urls, read_token(config.executor_token_file))
    token = secrets.token_urlsafe(32)
    if config.provider == "ray":
        from retouch.platform.fleet.rayprovider import RayProvider

        provider = RayProvider(
            config.data_dir,
            token,
            config.ray_address,
            executor_args=config.executor_args(),
            threads=config.executor.threads,
            head_wait_s=config.ray_wait_s,
        )
        provider.connect()  # before serving: the Ray head may start after the gateway
        return provider
    return LocalProvider(
        config.data_dir,
        token,
        cpu_slots=config.executors,
        executor_args=config.executor_args(),
        threads=config.executor.threads,
        zygote=config.executor_zygote,
    )
