"""`specdecode serve --ray`: N engine replicas on a Ray cluster behind one OpenAI endpoint.

Each replica is the single-process server's app (create_app over its own SpeculativeEngine
and continuous-batching worker), built on its replica from a ServerConfig; Ray Serve's proxy
routes each request to a replica (fewest ongoing requests of two sampled), restarts a replica
whose actor died or whose engine thread stopped (check_health), and scales between
--min-replicas and --max-replicas when asked. The decode loop never leaves its replica: a
network hop per step would cost more than speculation saves.

/metrics on any replica answers every replica's metrics, each sample labelled `replica`, so
one scrape sees the whole deployment (sum by the label for totals). Each replica traces as
the OTEL_* variables of the `serve --ray` command ask (passed to it in its runtime_env) and
exports its own spans; a client's traceparent passes through Serve's proxy to the replica.
Replicas share the cross-request draft store and response cache only through --cache-url
(Redis): each replica connects to that URL itself; without it each keeps its own in-process
cache.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from specdecode.errors import SpecDecodeError
from specdecode.server.app import app_from_config
from specdecode.server.config import ServerConfig
from specdecode.server.ray_cluster import set_threads

APP_NAME = "specdecode"


@dataclass(frozen=True)
class Scaling:
    replicas: int = 1
    replica_cpus: float = 1.0
    min_replicas: int | None = None  # either set: autoscaling between them, from `replicas`
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # per replica, that the autoscaler aims for

    def deployment_options(self, config: ServerConfig) -> dict:
        actor_options: dict = {"num_cpus": self.replica_cpus}
        if otel := otel_variables():
            # on a cluster from `ray start`, a replica has that command's environment, not
            # this process's: OTEL_EXPORTER_OTLP_ENDPOINT set here alone would trace nothing
            actor_options["runtime_env"] = {"env_vars": otel}
        options = dict(
            ray_actor_options=actor_options,
            # the replica's own queue (429 beyond max_waiting) decides; Ray only routes
            max_ongoing_requests=config.max_batch_size + config.max_waiting,
            health_check_period_s=5,
        )
        if self.min_replicas is None and self.max_replicas is None:
            return options | dict(num_replicas=self.replicas)
        autoscaling = dict(
            min_replicas=self.min_replicas if self.min_replicas is not None else 1,
            max_replicas=self.max_replicas if self.max_replicas is not None else self.replicas,
            initial_replicas=self.replicas,
        )
        if self.target_ongoing_requests is not None:
            autoscaling["target_ongoing_requests"] = self.target_ongoing_requests
        return options | dict(autoscaling_config=autoscaling)

    @property
    def most_replicas(self) -> int:
        return max(self.replicas, self.max_replicas or 0)


def otel_variables() -> dict[str, str]:
    """This process's OTEL_* variables: how each replica is to trace (tracing.py reads them)."""
    return {name: value for name, value in os.environ.items() if name.startswith("OTEL_")}


@serve.deployment(name="EngineReplica")
@serve.ingress()
class EngineReplica:
    """One engine and its worker, serving the OpenAI routes of create_app."""

    def __init__(self, config: ServerConfig, replica_cpus: float):
        set_threads(replica_cpus)
        context = serve.get_replica_context()
        self.replica = context.replica_tag
        self._deployment = (context.deployment, context.app_name)
        self.server_app = app_from_config(config, metrics_text=self.every_replicas_metrics)  # `app` is Serve's own

    def __serve_build_asgi_app__(self):
        return self.server_app

    def check_health(self) -> None:
        if not self.server_app.state.worker.alive:  # Ray Serve restarts the replica
            raise RuntimeError("the engine thread of this replica stopped")

    def torch_threads(self) -> int:
        import torch

        return torch.get_num_threads()

    def metrics_text(self) -> tuple[str, str]:
        return self.replica, generate_latest(self.server_app.state.metrics.registry).decode()

    async def every_replicas_metrics(self) -> bytes:
        handle = serve.get_deployment_handle(*self._deployment)
        answers = await handle.broadcast("metrics_text").results_async(timeout_s=10, return_exceptions=True)
        # a replica that is starting or has just died is left out of this scrape
        return merged_metrics([a for a in answers if isinstance(a, tuple)])


def merged_metrics(texts: list[tuple[str, str]]) -> bytes:
    """One exposition of several replicas' metrics (replica, text), every sample labelled with
    its replica: families must not repeat in one exposition, so samples are regrouped."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            merged.samples += [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
    registry = CollectorRegistry()
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def serve_until_signalled(config: ServerConfig, scaling: Scaling, on_ready: Callable[[], None]) -> None:
    """Start Serve's HTTP proxy on the config's host and port and the replicas, call on_ready once every replica
    is up, and serve until SIGINT or SIGTERM; then take the app down (other apps on the
    cluster stay). A signal during start-up takes it down too: replicas must not outlive the
    command that started them."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        app = EngineReplica.options(**scaling.deployment_options(config)).bind(config, scaling.replica_cpus)
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as error:  # Serve's message holds every replica's traceback
            reason = str(error).strip().splitlines()[-1] if str(error).strip() else "unknown"
            raise SpecDecodeError(
                f"the replicas did not start ({reason}); their logs are under /tmp/ray/session_latest/logs/serve"
            ) from None
        on_ready()
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
