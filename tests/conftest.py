"""Fixtures; the helpers the test files share are in helpers/ (models, stats, services)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from helpers import tiny_llama, tiny_tokenizer
from specdecode.server import ray_cluster

# Ray in the tests stays on loopback (server/ray_cluster.py says why) and authenticates with a
# token of this session's own, never ~/.ray/auth_token (a cluster started by ray.init would
# write one there). Set before any test file imports Ray, which reads them once; every Ray
# process the tests start, and every command they run, inherits them.
RAY_TEST_TOKEN = secrets.token_hex(16)
os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=RAY_TEST_TOKEN)
os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
os.environ["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"  # a test cluster stops at once, with nothing to drain
# the test cluster's Serve controller gives a starting proxy as long as serve.start waits (ray_cluster.py)
os.environ[ray_cluster.PROXY_READY_VARIABLE] = ray_cluster.PROXY_READY_SECONDS


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A saved tiny Llama with a tokenizer: a local model folder, as a user would give."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(seed=0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def ray_address():
    """A real local Ray cluster of 2 CPUs on loopback, started once for the test session (in
    the xdist worker that runs the `ray` group) and stopped at its end; the address that
    `--ray-address` takes. The test process is its driver, so tests can use Ray's own API.
    Always a new cluster of its own (address="local"): never one that an earlier `ray start`
    left recorded on the machine, live or stale, nor one RAY_ADDRESS names."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_start_cluster():
    """`ray start --head` on loopback, as the docs tell an operator to run one on one machine
    (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, --node-ip-address 127.0.0.1; token authentication
    with this session's token), in a temporary directory of its own: the cluster it records
    there (ray/ray_current_cluster) is visible only to commands run with TMPDIR set to it.
    Yields (address, that directory); stopped at the end of the module, by its own process
    (`ray stop` would stop every Ray on the machine)."""
    pytest.importorskip("ray")
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable))
    # short: Ray's socket paths under it must stay within the 107 bytes a Unix socket allows
    folder = tempfile.mkdtemp(prefix="sd-ray-", dir="/tmp")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [ray_bin, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port)]
    args += ["--num-cpus", "2", "--object-store-memory", str(200 << 20), "--include-dashboard", "false"]
    args += ["--disable-usage-stats"]
    log = os.path.join(folder, "ray-start.log")
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        env = os.environ | {"TMPDIR": folder}
        process = subprocess.Popen(args, env=env, stdout=out, stderr=out, start_new_session=True)
    try:
        _wait_for_ray_start(port, process, log)
        yield f"127.0.0.1:{port}", folder
    finally:
        process.send_signal(signal.SIGTERM)  # its processes end with it
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(60)
        with contextlib.suppress(ProcessLookupError):  # whatever of its session is left
            os.killpg(process.pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


def _wait_for_ray_start(port: int, process: subprocess.Popen, log: str, timeout_s: float = 120.0) -> None:
    """Until `ray start` says the cluster runs (its GCS answering alone is not enough)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(log) as f:
            if "Ray runtime started" in f.read():
                return
        if process.poll() is not None:
            break
        time.sleep(0.5)
    with open(log) as f:
        raise AssertionError(f"ray start did not start a cluster on 127.0.0.1:{port}:\n{f.read()}")


if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # two workers share the two cores; tiny models gain nothing from more
