"""Start (or attach to) the Ray cluster, deploy the replicas, and build the ingress's side of
the model: its tokenizer and chat template, without its weights.

`ClusterLauncher` is `kiln serve --replicas N`'s counterpart of `start_engine`. A local cluster
(no --ray-address) belongs to this process and goes with it; on a cluster it attached to,
shutting down removes only its own Serve application.
"""

from __future__ import annotations

import logging
import os
import time

from kiln.cluster.engine import ClusterEngine
from kiln.cluster.messages import ReplicaReport
from kiln.cluster.options import ClusterError, ClusterOptions
from kiln.cluster.replica import KilnReplica
from kiln.runtime.engine.bootstrap import EngineOptions
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.models.loader import ModelInfo, describe_model

log = logging.getLogger("kiln")

ROUTER = "kiln.cluster.router.PrefixAwareRouter"
# A replica takes as many requests as are sent: its own scheduler queues them, and Serve's
# rejection (a full replica) would only hide the load from the router.
MAX_ONGOING_REQUESTS = 4096


class Cluster:
    """The Ray connection and this ingress's Serve application."""

    def __init__(self, options: ClusterOptions):
        import ray
        from ray import serve

        self.options = options
        self.owns_ray = options.ray_address is None and not ray.is_initialized()
        # No usage report: kiln's clusters may have no way out (CI has PyPI only).
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        t0 = time.perf_counter()
        if not ray.is_initialized():
            # A local cluster leaves a core to this process (HTTP, tokenizing, the replicas'
            # streams) where there are more cores than replicas.
            # "local": a cluster of its own, even where `ray start` left one to find.
            cores = os.cpu_count() or 1
            ray.init(address=options.ray_address or "local", include_dashboard=False,
                     logging_level=logging.WARNING,
                     num_cpus=max(options.replicas, cores - 1) if self.owns_ray else None)
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        # kiln's own Sanic app is the HTTP server: Serve's proxy is not started.
        serve.start(proxy_location="Disabled")
        self.handle = None
        self.current: ClusterEngine | None = None
        log.info("[kiln]  Ray %s in %.1f s (%s)", "started" if self.owns_ray else "attached",
                 time.perf_counter() - t0, options.ray_address or "local")

    def deploy(self, model: str, engine: EngineOptions, capacity_blocks: int) -> None:
        """Deploy (or redeploy, for another model) the replicas and wait until every one has
        loaded the model. On an application that exists, Serve replaces its replicas."""
        import ray
        from ray import serve
        from ray.serve.config import RequestRouterConfig
        from ray.serve.schema import LoggingConfig

        n = self.options.replicas
        resources = ray.cluster_resources()
        cpus = max(1, int(resources.get("CPU", 1)) // n)
        gpus = min(1.0, resources.get("GPU", 0) / n)
        if 0 < gpus < 1 and engine.kv_cache_tokens is None:
            # Each replica would size its KV pool from the GPU's free memory, which the
            # others are filling at the same time.
            raise ClusterError(f"--replicas {n} on {resources['GPU']:g} GPUs: the replicas "
                               "would share a GPU; give each its KV pool with "
                               "--kv-cache-tokens, or run one replica per GPU")
        app = serve.deployment(KilnReplica, name="KilnReplica").options(
            num_replicas=n, max_ongoing_requests=MAX_ONGOING_REQUESTS,
            ray_actor_options={"num_cpus": cpus, "num_gpus": gpus},
            request_router_config=RequestRouterConfig(
                request_router_class=ROUTER,
                request_router_kwargs={"capacity_blocks": capacity_blocks,
                                       "imbalance": self.options.imbalance}),
            health_check_period_s=2, health_check_timeout_s=30,
            graceful_shutdown_timeout_s=5, graceful_shutdown_wait_loop_s=0.5,
            logging_config=LoggingConfig(log_level="WARNING", enable_access_log=False),
        ).bind(model, engine)
        t0 = time.perf_counter()
        self.handle = serve.run(app, name=self.options.app_name, route_prefix=None)
        log.info("[kiln]  %d replicas of %s up in %.1f s (%d CPUs%s each)", n, model,
                 time.perf_counter() - t0, cpus, f", {gpus:g} GPU" if gpus else "")

    def reports(self) -> list[ReplicaReport]:
        return self.handle.broadcast("report").results(timeout_s=60)

    def release(self, engine: ClusterEngine) -> None:
        """An engine is done: the cluster goes with the engine serving now (a model switch
        releases the old engine after the new one took over the application)."""
        if engine is not self.current:
            return
        self.current = None
        self.stop()

    def stop(self) -> None:
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        if self.owns_ray:  # the whole local cluster: every replica process with it
            ray.shutdown()
        else:
            serve.delete(self.options.app_name)
        log.info("[kiln]  Cluster stopped")


class ClusterLauncher:
    """`kiln serve --replicas N`'s counterpart of bootstrap.start_engine: each call loads a
    model on the replicas behind a new ClusterEngine. The first starts (or attaches to) the
    cluster; a later one, a model switch, replaces the replicas of the same application."""

    def __init__(self, engine: EngineOptions, options: ClusterOptions):
        self.engine, self.options = engine, options
        self.cluster: Cluster | None = None

    def __call__(self, model: str) -> tuple[ModelInfo, ClusterEngine]:
        info = describe_model(model)  # a model no replica could load fails here, first
        if self.cluster is None:
            self.cluster = Cluster(self.options)
        capacity = EngineConfig.build(info.ctx_len, info.max_prefill_len,
                                      ctx_len=self.engine.ctx_len,
                                      kv_cache_tokens=self.engine.kv_cache_tokens).num_blocks
        self.cluster.deploy(model, self.engine, capacity)
        self.cluster.current = ClusterEngine(self.cluster, info, self.cluster.reports())
        return info, self.cluster.current
