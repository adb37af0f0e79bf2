"""Joining a Ray cluster (`--ray-address`) or starting one on this machine, for `serve --ray`
and `batch --ray`, and checking that the replicas asked for fit before anything starts.

Ray is an optional extra (`pip install specdecode[ray]`): this module and the two that use it
(ray_serve.py, ray_batch.py) are imported only when a command asks for Ray.
"""

from __future__ import annotations

import logging
import os
import socket

from specdecode.errors import InvalidArgumentError, SpecDecodeError


def require_ray():
    try:
        import ray
    except ImportError:
        raise SpecDecodeError("Ray is not installed: pip install 'specdecode[ray]' (or drop --ray)") from None
    return ray


def check_replicas(replicas: int, replica_cpus: float) -> None:
    """The numbers alone, before connecting to anything."""
    if replicas < 1:
        raise InvalidArgumentError(f"--replicas must be at least 1, got {replicas}", "replicas")
    if not replica_cpus > 0:
        raise InvalidArgumentError(f"--replica-cpus must be positive, got {replica_cpus}", "replica_cpus")


def connect(address: str | None) -> None:
    """Join the cluster at address ("auto": the one started on this node by `ray start`), or,
    with no address, start a Ray of this machine's CPUs that ends with this process."""
    ray = require_ray()
    if ray.is_initialized():
        return
    if address not in (None, "auto"):
        _check_reachable(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SpecDecodeError(
            f"could not join a Ray cluster at {address or 'this machine'}: {first_line}; start one with "
            "`ray start --head` and pass --ray-address auto (on its node) or HOST:6379"
        ) from None


def check_fits(replicas: int, replica_cpus: float) -> None:
    """Replicas that could never all be placed would wait for ever: refuse them at once."""
    ray = require_ray()
    cpus = ray.cluster_resources().get("CPU", 0)
    if replicas * replica_cpus > cpus:
        raise InvalidArgumentError(
            f"--replicas {replicas} x --replica-cpus {replica_cpus:g} needs {replicas * replica_cpus:g} CPUs; the "
            f"Ray cluster has {cpus:g}: ask for fewer replicas or CPUs each, or add nodes",
            "replicas",
        )


def set_threads(replica_cpus: float) -> None:
    """A replica's torch threads: its CPU share (more would fight its neighbours for cores)."""
    import torch

    threads = max(1, int(replica_cpus))
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds with one line, where ray.init would retry for a minute."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgumentError(f"--ray-address takes HOST:PORT or auto, got '{address}'", "ray_address")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise SpecDecodeError(
            f"no Ray cluster answers at {address} ({error.strerror or error}); start one with `ray start --head` "
            "or check --ray-address"
        ) from None
