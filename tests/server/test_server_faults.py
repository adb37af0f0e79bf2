"""The server under load and under faults: true streaming, disconnects, injected engine
failures and crashes, timeouts, a full queue and a graceful shutdown. Each test runs the
real server on loopback; the engine is slowed or stopped only through the step hook."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from helpers import SERVED_MODEL as MODEL
from helpers import SERVER_PROMPT as PROMPT
from helpers import CrashAt, Gate, healthy, metric, serving, wait_for
from specdecode import CacheOptions, SpeculativeEngine
from specdecode.server import create_app
from specdecode.server.faults import RandomFaults

LONG_RUNNING = "w1 w2"  # no end-of-sequence token within 100 greedy tokens of the tiny model
PROMPTS = ["w1 w2 w3", "w4 w5 w4 w5", "w9 w8 w7", "w2 w2 w2 w3", "w10 w11", "w3 w1", "w5 w6 w5", "w7 w7"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # every request runs the decode loop (a response-cache hit would take no step to fault)
    return SpeculativeEngine.from_pretrained(tiny_model_dir, cache=CacheOptions(response_cache=False))


@pytest.fixture(scope="module")
def expected(engine):
    return {p: engine.generate(p, max_new_tokens=12, temperature=0)[0].text for p in PROMPTS}


def new_client(url: str, timeout: float = 30) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def greedy(client: openai.OpenAI, prompt: str, max_tokens: int = 12) -> str:
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


def test_text_streams_while_the_request_is_still_running(engine, expected):
    gate = Gate(open_steps=2)
    with serving(create_app(engine, model_name=MODEL, faults=gate)) as url:
        stream = new_client(url).completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True
        )
        chunks = iter(stream)
        first = next(chunks).choices[0].text
        # the engine is held after two steps: the request cannot have finished yet
        assert first and metric(httpx.get(f"{url}/metrics").text, "specdecode:num_requests_running") == 1
        gate.opened.set()
        assert first + "".join(c.choices[0].text for c in chunks) == expected[PROMPTS[0]]


def test_a_client_that_disconnects_mid_stream_frees_its_slot(engine, expected):
    with serving(create_app(engine, model_name=MODEL, max_batch_size=1, faults=Gate(10**9, delay=0.02))) as url:
        body = {"model": MODEL, "prompt": LONG_RUNNING, "max_tokens": 100, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
            next(response.iter_lines())  # one event, then hang up
        # the only slot is free again: the next request is served, and the first was counted as aborted
        assert greedy(new_client(url), PROMPTS[1]) == expected[PROMPTS[1]]
        aborted = 'specdecode:request_success_total{finished_reason="abort"}'
        wait_for(lambda: metric(httpx.get(f"{url}/metrics").text, aborted) == 1)


def test_a_client_that_disconnects_while_waiting_frees_its_place(engine, expected):
    with serving(create_app(engine, model_name=MODEL, max_batch_size=1, faults=Gate(10**9, delay=0.1))) as url:
        body = {"model": MODEL, "prompt": LONG_RUNNING, "max_tokens": 100, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.3)
        aborted = 'specdecode:request_success_total{finished_reason="abort"}'
        wait_for(lambda: metric(httpx.get(f"{url}/metrics").text, aborted) == 1)
        assert greedy(new_client(url), PROMPTS[2]) == expected[PROMPTS[2]]


def test_transient_step_failures_are_retried_and_nobody_notices(engine, expected):
    with serving(create_app(engine, model_name=MODEL, faults=RandomFaults(transient=0.3, seed=1))) as url:
        client = new_client(url)
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(lambda p: greedy(client, p), PROMPTS)) == [expected[p] for p in PROMPTS]
        assert metric(httpx.get(f"{url}/metrics").text, "specdecode:engine_step_retries_total") > 0


def test_a_request_that_always_fails_fails_alone(engine, expected):
    poisoned = "w6 w6 w6"
    with serving(create_app(engine, model_name=MODEL, faults=RandomFaults(poison=poisoned))) as url:
        client = new_client(url)
        with ThreadPoolExecutor(8) as pool:
            bad = pool.submit(
                httpx.post, f"{url}/v1/completions", json={"model": MODEL, "prompt": poisoned}, timeout=30
            )
            assert list(pool.map(lambda p: greedy(client, p), PROMPTS)) == [expected[p] for p in PROMPTS]
        assert bad.result().status_code == 500 and bad.result().json()["error"]["code"] == "engine_failure"
        # no internals in the answer: a request id to find them in the log
        message = bad.result().json()["error"]["message"]
        assert "injected" not in message and "RuntimeError" not in message and re.search(r"req-[0-9a-f]{16}", message)
        assert greedy(client, PROMPTS[0]) == expected[PROMPTS[0]]


def test_a_crashed_worker_restarts_and_resumes_every_request(engine, expected):
    """Two crashes while eight requests run: each resumes from its accepted tokens to exactly its greedy answer."""
    with serving(create_app(engine, model_name=MODEL, faults=CrashAt(3, 6))) as url:
        client = new_client(url)
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(lambda p: greedy(client, p), PROMPTS)) == [expected[p] for p in PROMPTS]
        assert metric(httpx.get(f"{url}/metrics").text, "specdecode:engine_worker_restarts_total") == 2
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_request_in_too_many_crashes_fails_instead_of_looping(engine, expected):
    with serving(create_app(engine, model_name=MODEL, faults=CrashAt(1, 2, 3))) as url:
        with pytest.raises(openai.InternalServerError, match="crashed 3 times"):
            greedy(new_client(url), PROMPTS[0])
        assert greedy(new_client(url), PROMPTS[1]) == expected[PROMPTS[1]]


def test_a_request_past_the_time_limit_gets_a_clear_error(engine):
    # a step takes 0.5 s, so 100 tokens (at most 5 a step) cannot be done within the 0.2 s limit; greedy, since
    # a sampled answer may end at its first step (OpenAI's default temperature is 1)
    with serving(create_app(engine, model_name=MODEL, max_request_seconds=0.2, faults=Gate(10**9, delay=0.5))) as url:
        response = httpx.post(
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": LONG_RUNNING, "max_tokens": 100, "temperature": 0},
            timeout=30,
        )
        assert response.status_code == 504 and response.json()["error"]["code"] == "request_timeout"
        assert "limit" in response.json()["error"]["message"]


def test_full_queue_answers_429_and_recovers(engine):
    gate = Gate()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    app = create_app(engine, model_name=MODEL, max_waiting=1, max_batch_size=1, faults=gate)
    with serving(app) as url, ThreadPoolExecutor(2) as pool:
        running = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=20)
        wait_for(lambda: metric(httpx.get(f"{url}/metrics").text, "specdecode:num_requests_running") == 1)
        waiting = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=20)
        wait_for(lambda: metric(httpx.get(f"{url}/metrics").text, "specdecode:num_requests_waiting") == 1)
        refused = httpx.post(f"{url}/v1/completions", json=body)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        assert refused.headers["retry-after"] == "1"
        gate.opened.set()
        assert running.result().status_code == 200 and waiting.result().status_code == 200
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200


def _hang_up_while_queued(url: str, body: dict) -> None:
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(f"{url}/v1/completions", json=body, timeout=2)


def test_clients_that_hang_up_while_queued_leave_the_queue_at_once(engine):
    gate = Gate()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    app = create_app(engine, model_name=MODEL, max_waiting=4, max_batch_size=1, faults=gate)
    waiting = lambda: metric(httpx.get(f"{url}/metrics").text, "specdecode:num_requests_waiting")  # noqa: E731
    with serving(app) as url, ThreadPoolExecutor(8) as pool:
        running = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=30)
        wait_for(lambda: metric(httpx.get(f"{url}/metrics").text, "specdecode:num_requests_running") == 1)
        leavers = [pool.submit(_hang_up_while_queued, url, body) for _ in range(4)]
        wait_for(lambda: waiting() == 4)
        for leaver in leavers:
            leaver.result()
        wait_for(lambda: waiting() == 0)  # the running request has not moved: they left
        # four new clients take the places; a fifth is refused, told when to come back
        queued = [pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=30) for _ in range(4)]
        wait_for(lambda: waiting() == 4)
        refused = httpx.post(f"{url}/v1/completions", json=body)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        gate.opened.set()
        assert [r.result().status_code for r in [running, *queued]] == [200] * 5
        assert gate.steps > 0 and waiting() == 0


def test_graceful_shutdown_finishes_the_requests_in_flight(engine, expected):
    app = create_app(engine, model_name=MODEL, faults=Gate(10**9, delay=0.05))
    with serving(app) as url, ThreadPoolExecutor(4) as pool:
        client = new_client(url)
        answers = [pool.submit(greedy, client, p) for p in PROMPTS[:4]]
        wait_for(lambda: metric(httpx.get(f"{url}/metrics").text, "specdecode:num_requests_running") == 4)
        stopping = pool.submit(app.state.worker.stop)  # what uvicorn's shutdown runs
        wait_for(lambda: app.state.worker._stopping)
        refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers["retry-after"] == "5"
        stopping.result()
        assert [a.result() for a in answers] == [expected[p] for p in PROMPTS[:4]]


def test_a_non_streaming_client_that_hangs_up_as_its_request_finishes_crashes_nothing(engine, expected):
    """The client's Future is cancelled while its last step runs; completing it must not crash
    the engine loop (before: InvalidStateError, a restart, and every request's crash count up)."""
    gate = Gate(open_steps=0)
    with serving(create_app(engine, model_name=MODEL, faults=gate)) as url:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.3)  # held in its only step; hangs up
        time.sleep(1.5)  # the server notices the disconnect and cancels the request's Future
        gate.opened.set()  # the step runs and finishes the request it holds
        assert greedy(new_client(url), PROMPTS[1]) == expected[PROMPTS[1]]
        metrics = httpx.get(f"{url}/metrics").text
        assert metric(metrics, "specdecode:engine_worker_restarts_total") == 0


def test_steps_that_fail_after_the_forward_are_retried_to_the_exact_answers(engine, expected):
    """Every second forward fails once it has run (verdicts not yet taken): retried, each
    request still gets exactly its greedy answer. (How many steps the requests take depends on
    how they batch and what was accepted, so the faults are counted, not assumed from a step
    count: 12 tokens take a prefill and at least one decoding step, so there is one at least.)"""

    class FailAfterForward:
        def __init__(self):
            self.forwards = self.faults = 0

        def before_step(self, requests) -> None:
            pass

        def after_forward(self, requests) -> None:
            self.forwards += 1
            if self.forwards % 2 == 0:
                self.faults += 1
                raise RuntimeError("injected fault after the forward")

    hook = FailAfterForward()
    with serving(create_app(engine, model_name=MODEL, faults=hook)) as url:
        client = new_client(url)
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(lambda p: greedy(client, p), PROMPTS)) == [expected[p] for p in PROMPTS]
        assert hook.faults >= 1
        assert metric(httpx.get(f"{url}/metrics").text, "specdecode:engine_step_retries_total") == hook.faults


def test_a_second_sigint_stops_the_server_at_once(tiny_model_dir):
    """`specdecode serve` with slow steps and a queue of long requests: the first SIGINT starts
    a graceful shutdown (which would take minutes here); the second exits within seconds."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "specdecode.cli", "serve", "--target", tiny_model_dir, "--port", str(port)]
    command += ["--max-batch-size", "1", "--inject-faults", "0,0,0.2"]  # 0.2 s a step
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: healthy(url), timeout=60)
        body = {"model": tiny_model_dir, "prompt": LONG_RUNNING, "max_tokens": 100, "temperature": 0}
        with ThreadPoolExecutor(3) as pool:
            held = [pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60) for _ in range(3)]
            wait_for(lambda: metric(httpx.get(f"{url}/metrics").text, "specdecode:num_requests_running") == 1)
            server.send_signal(signal.SIGINT)
            time.sleep(0.5)
            server.send_signal(signal.SIGINT)
            assert server.wait(timeout=10) is not None
            outcomes = [f.exception() or f.result().status_code for f in held]
        assert all(o != 200 for o in outcomes)  # failed or cut off, not answered after the second signal
    finally:
        server.kill()
        server.wait()
