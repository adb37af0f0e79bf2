"""Joining a Ray cluster (`--ray-address`) or starting one on this machine, for `serve --ray`
and `batch --ray`, and checking that the replicas asked for fit before anything starts.

Ray is an optional extra (`pip install specdecode[ray]`): this module and the two that use it
(ray_serve.py, ray_batch.py) are imported only when a command asks for Ray.

On one machine every Ray connection stays on loopback. Ray replaces 127.0.0.1 (in an address
it is given, and as the address of the processes it starts) by the machine's network address,
so that other nodes could reach them; a cluster started with `ray start --head
--node-ip-address 127.0.0.1` and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 listens on loopback only
and could then not be joined at 127.0.0.1. Ray keeps loopback where that variable is 0.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

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


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
LOOPBACK_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # 0: Ray keeps loopback addresses as they are
# Serve's controller restarts a proxy not ready within this variable's seconds (5 by default),
# while serve.start waits 60 s for one: on a loaded machine a proxy's process takes longer than
# 5 s to start, and each restart starts it over until serve.start gives up. Given the whole 60 s,
# the first proxy is waited for (an operator's own setting is kept).
PROXY_READY_VARIABLE = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
PROXY_READY_SECONDS = "60"


def connect(address: str | None) -> None:
    """Join the cluster at address ("auto": the one started on this node by `ray start`), or,
    with no address, start a Ray of this machine's CPUs that ends with this process; never a
    cluster that an earlier `ray start` left recorded on the machine (or RAY_ADDRESS names)."""
    ray = require_ray()
    if ray.is_initialized():
        return
    if address not in (None, "auto"):
        _check_reachable(address)
    if address is None or address == "auto" or is_loopback(address):
        _stay_on_loopback()
    if address is not None and is_loopback(address):
        _send_this_machines_token()
    if address is None:  # the Ray started here: its Serve controller reads the environment it starts in
        os.environ.setdefault(PROXY_READY_VARIABLE, PROXY_READY_SECONDS)
    try:
        ray.init(
            address="local" if address is None else address,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SpecDecodeError(
            f"could not join a Ray cluster at {address or 'this machine'}: {first_line}; start one with "
            "`ray start --head` and pass --ray-address auto (on its node) or HOST:6379; a cluster with token "
            "authentication needs its token here too (RAY_AUTH_MODE=token, and RAY_AUTH_TOKEN or ~/.ray/auth_token)"
        ) from None


def is_loopback(address: str) -> bool:
    host = address.removeprefix("ray://").rpartition(":")[0]
    return host in LOOPBACK_HOSTS


def _stay_on_loopback() -> None:
    """Keep Ray's addresses on this machine as they are (see the module's docstring), unless the
    operator set the variable. Ray reads it once, when it is imported: the environment is for the
    processes it starts from here, the constant for this one (Ray may be imported already)."""
    if LOOPBACK_VARIABLE in os.environ:
        return
    os.environ[LOOPBACK_VARIABLE] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and hasattr(constants, "ENABLE_RAY_CLUSTER"):
        constants.ENABLE_RAY_CLUSTER = False


def _send_this_machines_token() -> None:
    """Ray (2.60) sends its authentication token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token) to a cluster it finds on this machine itself ("auto"), but to an address
    it is given only with RAY_AUTH_MODE=token, so a token-authenticated `ray start` cluster
    refused `--ray-address 127.0.0.1:PORT`. A loopback address is this machine: do as "auto"
    does. (Nothing changes where RAY_AUTH_MODE is set, or where no token is found; a cluster
    without authentication accepts a client that sends one.)"""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


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
