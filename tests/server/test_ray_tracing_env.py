"""serve --ray hands its OTEL_* variables to every replica: on a cluster started by `ray start`,
a replica's process has that command's environment, not the driver's (checked on Ray 2.60: a
variable set only in the driver read as unset in a replica, and as set with runtime_env)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("ray")

from specdecode.server.config import ServerConfig  # noqa: E402
from specdecode.server.ray_serve import Scaling  # noqa: E402 - only where Ray is installed

CONFIG = ServerConfig(target="tiny")


@pytest.fixture
def no_otel(monkeypatch):
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_the_otel_variables_of_the_command_travel_to_every_replica(no_otel):
    no_otel.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    no_otel.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    no_otel.setenv("OTEL_SERVICE_NAME", "specdecode-ray")
    no_otel.setenv("NOT_OTEL_SECRET", "stays here")
    for scaling in (Scaling(replicas=2, replica_cpus=1.5), Scaling(min_replicas=1, max_replicas=4)):
        actor = scaling.deployment_options(CONFIG)["ray_actor_options"]
        assert actor["runtime_env"] == {
            "env_vars": {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_SERVICE_NAME": "specdecode-ray",
            }
        }
        assert actor["num_cpus"] == scaling.replica_cpus


def test_without_otel_variables_the_replicas_get_no_runtime_env(no_otel):
    no_otel.setenv("NOT_OTEL_SECRET", "stays here")
    actor = Scaling(replicas=2).deployment_options(CONFIG)["ray_actor_options"]
    assert actor == {"num_cpus": 1.0}  # no runtime_env: replicas start as before
