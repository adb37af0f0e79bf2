"""What clients that never authenticate, or never finish sending, can hold of a real server
on loopback: the key is checked before any body is read, headers and open connections are
capped, and a request that never arrives whole is closed (server/limits.py). Memory is the
server's (this process's) resident set, read from /proc."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from typer.testing import CliRunner

from helpers import SERVED_MODEL as MODEL
from helpers import Gate, free_port, healthy, serving, wait_for
from specdecode import SpeculativeEngine
from specdecode.cli import app as cli_app
from specdecode.errors import InvalidArgumentError
from specdecode.server import create_app
from specdecode.server.config import ServerConfig

KEY = "hostile-test-key"
MIB = 1 << 20


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return SpeculativeEngine.from_pretrained(tiny_model_dir)


def resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir):
    """`specdecode serve` with a key, in a process of its own: its memory is what is measured."""
    port = free_port()
    command = [sys.executable, "-m", "specdecode.cli", "serve", "--target", tiny_model_dir, "--port", str(port)]
    command += ["--api-key", KEY, "--max-header-bytes", str(16 << 10)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: healthy(url), timeout=120)
        yield url, server.pid
    finally:
        server.terminate()
        server.wait(30)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def answer(sock: socket.socket, timeout: float = 10) -> bytes:
    """What the server sends until it closes the connection (b"" if it closes at once). A
    reset counts as closed: a server that closes with bytes of ours unread resets the
    connection, and the kernel may then drop what it had sent."""
    sock.settimeout(timeout)
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


def send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the server closed the connection first: what these tests want
        sock.sendall(data)


def headers(path: str = "/v1/completions", length: int = MIB, key: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode()


def test_a_client_without_the_key_is_refused_before_its_body_is_read(keyed_server):
    url, pid = keyed_server
    before = resident_bytes(pid)
    # headers and the start of a 1 MiB body, then nothing: answered 401 at once, and closed
    stalled = [connect(url) for _ in range(50)]
    for sock in stalled:
        send_quietly(sock, headers() + b" " * 1024)
    replies = [answer(sock) for sock in stalled]
    assert all(r.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in r for r in replies), replies[0][:200]
    # all but the last byte of the body, sent at once: refused or reset, never buffered
    sending = [connect(url) for _ in range(100)]
    with ThreadPoolExecutor(20) as pool:
        list(pool.map(lambda s: send_quietly(s, headers() + b" " * (MIB - 1)), sending))
    assert all(r == b"" or r.startswith(b"HTTP/1.1 401") for r in map(answer, sending))
    grown = resident_bytes(pid) - before
    for sock in stalled + sending:
        sock.close()
    assert grown < 30 * MIB, f"{grown / MIB:.0f} MiB held by 100 unauthenticated 1 MiB bodies"
    # with the key, the same server answers
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_headers_past_the_limit_are_refused_and_closed(keyed_server):
    url, pid = keyed_server
    before = resident_bytes(pid)
    sockets = [connect(url) for _ in range(40)]
    with ThreadPoolExecutor(20) as pool:  # a 4 MB header line each, never ended
        list(pool.map(lambda s: send_quietly(s, b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * (4 * MIB)), sockets))
    replies = [answer(sock) for sock in sockets]
    grown = resident_bytes(pid) - before
    for sock in sockets:
        sock.close()
    assert all(r == b"" or r.startswith(b"HTTP/1.1 400") for r in replies), replies[0][:200]
    assert grown < 30 * MIB, f"{grown / MIB:.0f} MiB held by 40 unfinished 4 MB headers"
    assert httpx.get(f"{url}/health").status_code == 200


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", headers(length=100, key=KEY) + b'{"model": '],
    ids=["nothing", "half the headers", "half the body, with the key"],
)
def test_a_request_that_never_arrives_whole_is_closed_after_the_read_timeout(engine, sent):
    app = create_app(engine, model_name=MODEL, api_key=KEY, read_timeout_s=1.0)
    with serving(app) as url, connect(url) as sock:
        start = time.monotonic()
        send_quietly(sock, sent)
        reply = answer(sock, timeout=15)
        assert time.monotonic() - start < 10
        assert b"200 OK" not in reply


def test_a_slow_answer_is_not_cut_by_the_read_timeout(engine):
    """The deadline is on reading the request: an answer that takes longer is waited for."""
    gate = Gate(open_steps=0)
    app = create_app(engine, model_name=MODEL, read_timeout_s=0.5, faults=gate)
    with serving(app) as url, ThreadPoolExecutor(1) as pool:
        body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 3, "temperature": 0}
        pending = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=30)
        time.sleep(2)
        gate.opened.set()
        assert pending.result().status_code == 200


def test_connections_past_the_limit_are_answered_503_and_closed(engine):
    app = create_app(engine, model_name=MODEL, max_connections=8)
    with serving(app) as url:
        held = [connect(url) for _ in range(8)]
        time.sleep(0.5)  # accepted by the server's loop
        with connect(url) as extra:
            reply = answer(extra)
        assert reply.startswith(b"HTTP/1.1 503") and b"retry-after: 5" in reply.lower()
        for sock in held:
            sock.close()
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200)


@pytest.mark.parametrize("key", ["", "   ", " key", "k\u00e9y"])
def test_an_empty_or_unsendable_api_key_is_refused_at_start_in_one_line(key):
    with pytest.raises(InvalidArgumentError, match="api_key must"):
        ServerConfig(api_key=key)
    result = CliRunner().invoke(cli_app, ["serve", "--target", "/no/such/model", "--api-key", key])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --api-key must"), result.output


def test_the_banner_says_whether_a_key_is_required():
    assert ServerConfig(api_key=KEY).key_note == "API key required"
    assert "no API key" in ServerConfig().key_note
