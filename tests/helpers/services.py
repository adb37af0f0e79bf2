"""Servers and services run for real on loopback by the tests: the app under uvicorn in a
thread, Redis and Prometheus processes, and the gates and faults that steer a running worker."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time

import uvicorn

from specdecode.server.faults import WorkerCrash
from specdecode.server.limits import uvicorn_config

# --- the server, run for real on loopback (test_server.py, test_server_faults.py, test_loadtest.py) ---

SERVED_MODEL = "tiny"
SERVER_PROMPT = "w1 w2 w3 w1 w2"


@contextlib.contextmanager
def serving(app):
    """Run `app` with uvicorn in a thread on a free port, under the limits `specdecode serve`
    runs it with (its config's: server/limits.py); yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound here and handed over: no race for the port
    server = uvicorn.Server(uvicorn_config(app, app.state.server.config, "127.0.0.1", 0, "warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        threading.Event().wait(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        deadline.wait(0.02)
    raise AssertionError("condition not reached in time")


class Gate:
    """A step hook that lets `open_steps` steps through, then holds every step until opened;
    `delay` slows each step down."""

    def __init__(self, open_steps: int = 0, delay: float = 0.0):
        self.open_steps, self.delay = open_steps, delay
        self.opened = threading.Event()
        self.steps = 0

    def before_step(self, requests) -> None:
        self.steps += 1
        if self.steps > self.open_steps:
            self.opened.wait(30)
        time.sleep(self.delay)

    def after_forward(self, requests) -> None:
        pass


class CrashAt:
    """A step hook that crashes the engine worker at the given step numbers."""

    def __init__(self, *steps: int):
        self.crash_steps, self.steps = set(steps), 0

    def before_step(self, requests) -> None:
        self.steps += 1
        if self.steps in self.crash_steps:
            raise WorkerCrash(f"injected crash at step {self.steps}")

    def after_forward(self, requests) -> None:
        pass


# --- real services on loopback (Redis), started and stopped by the tests ---


def openai_client(url: str):
    """The official client for a server's base URL, failing at once rather than retrying."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def redis_server(port: int | None = None):
    """A real redis-server on a free loopback port, nothing saved to disk; yields its URL.
    Missing binary: a failure under CI (the project's setup installs it), a skip elsewhere."""
    import shutil
    import subprocess

    import pytest

    binary = shutil.which("redis-server")
    if binary is None:
        message = "redis-server is not installed (make setup installs Debian's redis-server as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    port = port or free_port()
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        import redis

        client = redis.Redis.from_url(url, socket_timeout=0.5)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        yield url
    finally:
        process.terminate()
        process.wait(10)


@contextlib.contextmanager
def prometheus_server(targets: list[str], tmp_path, scrape_interval: str = "1s"):
    """A real Prometheus on a free loopback port scraping `targets` ("host:port", their
    /metrics) every scrape_interval, its storage in tmp_path; yields its URL once it is ready.
    Missing binary: a failure under CI (the project's setup installs it), a skip elsewhere."""
    import shutil
    import subprocess

    import httpx
    import pytest

    binary = shutil.which("prometheus")
    if binary is None:
        message = "prometheus is not installed (make setup installs Debian's prometheus as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"global:\n  scrape_interval: {scrape_interval}\n  evaluation_interval: {scrape_interval}\n"
        "scrape_configs:\n  - job_name: specdecode\n"
        f"    scrape_interval: {scrape_interval}\n    scrape_timeout: {scrape_interval}\n"
        f"    static_configs:\n      - targets: [{', '.join(repr(t) for t in targets)}]\n"
    )
    command = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 - written while it runs, closed below
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(500):
            if process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        else:
            raise RuntimeError("prometheus did not become ready")
        yield url
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def healthy(url: str) -> bool:
    """Whether a server at url (http://HOST:PORT) answers /health with 200 yet."""
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
