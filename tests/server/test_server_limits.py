"""Hostile inputs and exposure of the server: k without a bound, bodies past the limit under
either HTTP parser, failures while a request is admitted, and what an API key protects.
Each test runs the real server on loopback (raw sockets where a client would refuse to send
the request)."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

from helpers import SERVED_MODEL as MODEL
from helpers import SERVER_PROMPT as PROMPT
from helpers import serving
from specdecode import CacheOptions, SpeculativeEngine
from specdecode.core.adaptive import MAX_SPECULATIVE_TOKENS, AdaptiveK, StepCosts, best_k
from specdecode.errors import InvalidArgumentError
from specdecode.server import create_app

K = 4  # the k every engine here is loaded with (from_pretrained's default)
K_PARAM = "speculative.num_speculative_tokens"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # every request runs the decode loop: a response-cache hit would skip the admission's slot
    return SpeculativeEngine.from_pretrained(tiny_model_dir, cache=CacheOptions(response_cache=False))


def completion(url: str, timeout: float = 30, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0} | fields
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


# --- item 8: k is bounded, per engine and per request ---


def test_k_above_what_the_engine_loaded_is_a_400_naming_the_parameter(engine):
    with serving(create_app(engine, model_name=MODEL)) as url:
        answers = {}
        for k in (K + 1, 200_000, 10**13):
            try:
                response = completion(url, timeout=20, speculative={"num_speculative_tokens": k})
            except httpx.ReadTimeout:
                answers[k] = "no answer in 20 s"
                continue
            error = response.json().get("error") or {}
            answers[k] = (response.status_code, len(response.content), error.get("param"), error.get("message"))
        assert all(a[0] == 400 and a[2] == K_PARAM and f"at most {K} " in a[3] for a in answers.values()), answers
        allowed = completion(url, speculative={"num_speculative_tokens": K})
        assert allowed.status_code == 200 and allowed.json()["speculative"]["num_speculative_tokens"] == K


def test_metrics_have_one_series_per_draft_position_the_engine_can_use(engine):
    with serving(create_app(engine, model_name=MODEL)) as url:
        completion(url, speculative={"num_speculative_tokens": 50})  # refused, or served: never 50 series
        completion(url)
        text = httpx.get(f"{url}/metrics").text
    for name in ("accepted_tokens_per_pos", "draft_tokens_per_pos"):
        positions = re.findall(rf'^specdecode:spec_decode_num_{name}_total\{{position="([^"]+)"\}}', text, re.M)
        assert sorted(positions) == [str(p) for p in range(K)], (name, len(positions))


def test_the_engine_bounds_k_at_load_and_per_call(tiny_model_dir):
    with pytest.raises(InvalidArgumentError, match=f"at most {MAX_SPECULATIVE_TOKENS} ") as error:
        SpeculativeEngine.from_pretrained(tiny_model_dir, num_speculative_tokens=MAX_SPECULATIVE_TOKENS + 1)
    assert error.value.param == "num_speculative_tokens"
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir, num_speculative_tokens=2)
    with pytest.raises(InvalidArgumentError, match="at most 2 ") as error:
        engine.generate("w1 w2", max_new_tokens=4, num_speculative_tokens=3)
    assert error.value.param == "num_speculative_tokens"
    with pytest.raises(InvalidArgumentError, match="at most 2 "):
        engine.generate(["w1 w2"], max_new_tokens=4, num_speculative_tokens=10**13, max_batch_size=8)
    assert engine.generate("w1 w2", max_new_tokens=4, num_speculative_tokens=1)[0].stats.num_speculative_tokens == 1


@pytest.mark.parametrize("command", ["generate", "serve", "batch"])
def test_the_cli_bounds_k_before_loading_anything(command, tmp_path):
    from specdecode.cli import app as cli_app

    (tmp_path / "in.jsonl").write_text("")
    given = {
        "generate": ["w1"],
        "serve": [],
        "batch": [str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")],
    }
    args = [command, *given[command], "--target", "/no/such/model"]
    result = CliRunner().invoke(cli_app, [*args, "-k", str(MAX_SPECULATIVE_TOKENS + 1)])
    assert result.exit_code == 2 and f"at most {MAX_SPECULATIVE_TOKENS}" in result.output, result.output


def test_choosing_k_reads_each_position_a_bounded_number_of_times():
    """The policy runs for every sequence every step: its work must grow with k, not k^2."""
    reads = 0

    class Counted(list):
        def __getitem__(self, index):
            nonlocal reads
            found = super().__getitem__(index)
            reads += len(found) if isinstance(index, slice) else 1
            return found

        def __iter__(self):
            nonlocal reads
            for item in super().__iter__():
                reads += 1
                yield item

    k = 2_000
    acceptance = Counted([0.9] * k)
    chosen = best_k(acceptance, 0.001, lambda n: 0.01 + 0.0001 * n)
    assert 0 < chosen <= k and reads <= 4 * (k + 1), reads
    # nothing measured yet: the most k, but never past the bound, whatever the caller asks
    assert AdaptiveK(StepCosts()).choose(10 * MAX_SPECULATIVE_TOKENS) == MAX_SPECULATIVE_TOKENS


def test_estimating_a_step_cost_does_not_scan_every_measured_size():
    """The policy estimates k + 1 forward sizes per step; a batch measures up to batch x (k + 1)."""
    scanned = 0

    class Counted(dict):
        def __iter__(self):
            nonlocal scanned
            for key in super().__iter__():
                scanned += 1
                yield key

    costs = StepCosts()
    costs.seconds = Counted({n: 0.001 * n for n in range(2, 1002, 2)})  # 500 sizes: 2, 4, ..., 1000
    estimates = [costs.estimate(n) for n in range(1, 1100, 10)]
    assert estimates[:3] == [0.002, pytest.approx(0.011), pytest.approx(0.021)] and estimates[-1] == 1.0
    assert scanned <= 500, scanned  # one sort of the sizes, not two scans per estimate
    costs.record(1001, 2.0)  # a new size is seen by the next estimate
    assert costs.estimate(1000.5) == pytest.approx(1.5)


class FailsAdmitting:
    """Makes one stage of admitting a request raise MemoryError for the prompt POISON."""

    def __init__(self, engine, stage: str, monkeypatch):
        self.engine, self.hits = engine, 0
        target = {"sequence": engine, "cache lookup": engine.caches, "decoder.add": engine.decoder}[stage]
        name = {"sequence": "sequence", "cache lookup": "answer", "decoder.add": "add"}[stage]
        original = getattr(target, name)

        def failing(seq_or_ids, *args, **kwargs):
            ids = seq_or_ids if isinstance(seq_or_ids, list) else seq_or_ids.prompt_ids
            if ids == POISON_IDS:
                self.hits += 1
                if name == "add":  # as decoder.add does with a huge k: its slot taken, then the failure
                    original(seq_or_ids, *args, **kwargs)
                    engine.decoder.active.remove(seq_or_ids)
                raise MemoryError("no memory for this request")
            return original(seq_or_ids, *args, **kwargs)

        monkeypatch.setattr(target, name, failing)


POISON = "w6 w6 w6"
POISON_IDS = [8, 8, 8]


@pytest.mark.parametrize("stage", ["sequence", "cache lookup", "decoder.add"])
def test_a_failure_while_admitting_a_request_is_answered_and_frees_its_slot(tiny_model_dir, stage, monkeypatch):
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir)  # its response cache on: the lookup runs
    assert engine.encode(POISON) == POISON_IDS and engine.response_cache is not None
    fault = FailsAdmitting(engine, stage, monkeypatch)
    app = create_app(engine, model_name=MODEL, max_batch_size=1)
    worker = app.state.worker
    with serving(app) as url:
        failed = completion(url, timeout=20, prompt=POISON)
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_failure", failed.text
        assert fault.hits == 1
        assert completion(url, timeout=20).status_code == 200  # the one slot is free again
        assert not worker.decoder.active and worker.metrics.worker_restarts._value.get() == 0
        slots = worker.decoder.slots
        assert len(slots._free) == len(slots.slots), "a slot was taken and never given back"


# --- item 9: the body limit holds on the bytes read, whatever the framing ---

LIMIT = 1024


@contextlib.contextmanager
def serving_with(app, http: str):
    """Run app under uvicorn with this HTTP parser (h11 or httptools) on a free loopback port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=http, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        threading.Event().wait(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def raw_request(port: int, head: str, body: bytes) -> tuple[int, bytes]:
    """Send exactly these bytes; the status code and the body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
        conn.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := conn.recv(65536):
                received += chunk
                if b"\r\n\r\n" in received and _complete(received):
                    break
    status_line, _, rest = received.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _complete(received: bytes) -> bool:
    head, _, body = received.partition(b"\r\n\r\n")
    length = re.search(rb"content-length: *(\d+)", head, re.I)
    return length is not None and len(body) >= int(length.group(1))


def chunked(data: bytes, size: int = 4096) -> bytes:
    pieces = [data[i : i + size] for i in range(0, len(data), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def padded_body(size: int) -> bytes:
    """A valid completion request of `size` bytes (spaces after the JSON)."""
    text = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    return text + b" " * (size - len(text))


HEAD = "POST /v1/completions HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/json\nConnection: close\n"


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_the_body_limit_holds_whatever_the_framing(engine, http):
    app = create_app(engine, model_name=MODEL, max_body_bytes=LIMIT)
    big, small = padded_body(50_000), padded_body(LIMIT)
    with serving_with(app, http) as port:
        # both framings at once: a parser may follow the chunks while the header says 10 bytes
        status, body = raw_request(port, HEAD + "Content-Length: 10\nTransfer-Encoding: chunked\n", chunked(big))
        assert status in (400, 413), (http, status, body[:200])  # refused: never read and answered
        if status == 413:
            assert json.loads(body)["error"]["code"] == "body_too_large"
        status, body = raw_request(port, HEAD + "Transfer-Encoding: chunked\n", chunked(big))
        assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large", (http, status)
        status, _ = raw_request(port, HEAD + f"Content-Length: {len(big)}\n", big)
        assert status == 413, (http, status)
        for framing, data in ((f"Content-Length: {len(small)}\n", small), ("Transfer-Encoding: chunked\n", None)):
            status, body = raw_request(port, HEAD + framing, data if data is not None else chunked(small, 100))
            assert status == 200 and json.loads(body)["choices"], (http, framing, status, body[:200])


# --- item 16: with an API key, only /health is open ---

KEY = "secret"
BEARER = {"authorization": f"Bearer {KEY}"}


def test_with_an_api_key_only_health_is_open(engine):
    with serving(create_app(engine, model_name=MODEL, api_key=KEY)) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        for path in ("/metrics", "/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect", "/v1/models"):
            refused = httpx.get(f"{url}{path}")
            assert refused.status_code in (401, 404), (path, refused.status_code)
            assert "specdecode" not in refused.text and "paths" not in refused.text, path
        assert httpx.get(f"{url}/metrics", headers=BEARER).text.startswith("# HELP")
        assert "/v1/completions" in httpx.get(f"{url}/openapi.json", headers=BEARER).json()["paths"]
        assert httpx.get(f"{url}/metrics").json()["error"]["code"] == "invalid_api_key"


def test_metrics_open_without_the_key_only_when_asked(engine):
    with serving(create_app(engine, model_name=MODEL, api_key=KEY, metrics_without_key=True)) as url:
        assert httpx.get(f"{url}/metrics").status_code == 200
        assert httpx.get(f"{url}/openapi.json").status_code == 401
        assert httpx.get(f"{url}/v1/models").status_code == 401


def test_without_an_api_key_docs_and_metrics_stay_open(engine):
    with serving(create_app(engine, model_name=MODEL)) as url:
        for path in ("/metrics", "/openapi.json", "/docs", "/health"):
            assert httpx.get(f"{url}{path}").status_code == 200, path


def test_serve_passes_metrics_without_key_to_the_app(tiny_model_dir, monkeypatch):
    from fastapi.testclient import TestClient

    import specdecode.server as server_module
    from specdecode.cli import app as cli_app

    served = []
    monkeypatch.setattr(server_module, "run_server", lambda app, host, port: served.append(app))
    for flag, status in (([], 401), (["--metrics-without-key"], 200)):
        args = ["serve", "--target", tiny_model_dir, "--api-key", KEY, "--no-response-cache", *flag]
        result = CliRunner().invoke(cli_app, args)
        assert result.exit_code == 0, result.output
        assert "API key required" in result.output  # the banner says a key is needed
        assert TestClient(served[-1]).get("/metrics").status_code == status, flag
