"""The server under load and under faults: true streaming, disconnects, injected engine
failures and crashes, timeouts, a full queue and a graceful shutdown. Each test runs the
real server on loopback; the engine is slowed or stopped only through the step hook."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from specdecode import SpeculativeEngine
from specdecode.server import create_app
from specdecode.server.faults import RandomFaults, WorkerCrash
from test_server import MODEL, PROMPT, metric, serving, wait_for

LONG_RUNNING = "w1 w2"  # no end-of-sequence token within 100 greedy tokens of the tiny model
PROMPTS = ["w1 w2 w3", "w4 w5 w4 w5", "w9 w8 w7", "w2 w2 w2 w3", "w10 w11", "w3 w1", "w5 w6 w5", "w7 w7"]


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


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return SpeculativeEngine.from_pretrained(tiny_model_dir)


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
        assert greedy(client, PROMPTS[0]) == expected[PROMPTS[0]]


class CrashAt:
    """A step hook that crashes the engine worker at the given step numbers."""

    def __init__(self, *steps: int):
        self.crash_steps, self.steps = set(steps), 0

    def before_step(self, requests) -> None:
        self.steps += 1
        if self.steps in self.crash_steps:
            raise WorkerCrash(f"injected crash at step {self.steps}")


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
    # a step takes 0.5 s, so 100 tokens (at most 5 a step) cannot be done within the 0.2 s limit
    with serving(create_app(engine, model_name=MODEL, max_request_seconds=0.2, faults=Gate(10**9, delay=0.5))) as url:
        response = httpx.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": LONG_RUNNING, "max_tokens": 100}, timeout=30
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
        gate.opened.set()
        assert running.result().status_code == 200 and waiting.result().status_code == 200
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200


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
        stopping.result()
        assert [a.result() for a in answers] == [expected[p] for p in PROMPTS[:4]]
