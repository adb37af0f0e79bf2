"""`specdecode serve --ray`: engine replicas on a real local Ray cluster (started by conftest's
ray_address fixture) behind one OpenAI endpoint, as the single-process server answers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prometheus_client import generate_latest

from helpers import free_port, healthy, serving, wait_for
from specdecode import CacheOptions, SpeculativeEngine
from specdecode.server import create_app
from specdecode.server.loadtest import run_level

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.xdist_group("ray")  # one worker holds the one test cluster

API_KEY = "ray-secret"
PROMPTS = ["w1 w2 w3 w4 w1 w2 w3", "w5 w6 w5 w6 w5", "w7 w8 w9 w7 w8", "w2 w4 w6 w8 w2 w4"]


def replica_names() -> list[str]:
    return sorted(
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith("SERVE_REPLICA::specdecode#")
    )


@pytest.fixture(scope="module")
def ray_server(ray_address, tiny_model_dir, tmp_path_factory):
    """`specdecode serve --ray --replicas 2` (1 CPU each) on the test cluster; its base URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("ray-serve") / "serve.log"
    args = ["serve", "--ray-address", ray_address, "--replicas", "2", "--target", tiny_model_dir, "--port", str(port)]
    args += ["--api-key", API_KEY, "--no-response-cache"]  # repeated prompts are decoded (and drafted) again
    args += ["--fixed-k"]  # adaptive k follows the clock: on a busy machine it may stop drafting (nothing accepted)
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "specdecode.cli", *args], stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        # the command says "serving" once every replica is up (one answering /health is not enough)
        wait_for(lambda: "serving" in log.read_text() or process.poll() is not None, timeout=240)
        assert process.poll() is None, log.read_text()
        deadline = time.monotonic() + 60  # on a loaded machine one probe's second may not be enough
        while not healthy(url):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        assert len(replica_names()) == 2
        yield url
    finally:
        process.send_signal(2)  # SIGINT: the app is deleted, the cluster stays
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def answers(url: str, model: str, stream: bool) -> list[tuple[str, dict | None]]:
    """Greedy completions and chat answers of PROMPTS: (text, speculative stats)."""
    c, results = client(url), []
    for prompt in PROMPTS:
        common = dict(model=model, max_tokens=24, temperature=0)
        if stream:
            chunks = c.completions.create(prompt=prompt, stream=True, **common)
            results.append(("".join(chunk.choices[0].text for chunk in chunks if chunk.choices), None))
            chat = c.chat.completions.create(messages=[{"role": "user", "content": prompt}], stream=True, **common)
            results.append(("".join(ch.choices[0].delta.content or "" for ch in chat if ch.choices), None))
        else:
            completion = c.completions.create(prompt=prompt, **common)
            results.append((completion.choices[0].text, completion.model_extra["speculative"]))
            chat = c.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
            results.append((chat.choices[0].message.content, chat.model_extra["speculative"]))
    return results


def test_replicas_answer_greedy_requests_as_the_single_process_server(ray_server, tiny_model_dir):
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir, cache=CacheOptions(response_cache=False))
    with serving(create_app(engine, model_name=tiny_model_dir)) as single:
        expected = [text for text, _ in answers(single, tiny_model_dir, stream=False)]
    for stream in (False, True):
        got = answers(ray_server, tiny_model_dir, stream)
        assert [text for text, _ in got] == expected, f"stream={stream}"
    stats = [s for _, s in answers(ray_server, tiny_model_dir, stream=False)]
    assert sum(s["drafted_tokens"] for s in stats) > 0 and sum(s["accepted_tokens"] for s in stats) > 0


def test_each_replica_runs_as_many_torch_threads_as_its_cpus(ray_server):
    from ray import serve

    handle = serve.get_deployment_handle("EngineReplica", "specdecode")
    assert handle.broadcast("torch_threads").results(timeout_s=30) == [1, 1]  # --replica-cpus 1 (the default)


def test_replicas_answer_bad_requests_as_the_single_process_server(ray_server, tiny_model_dir):
    keyless = openai.OpenAI(base_url=f"{ray_server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        keyless.completions.create(model=tiny_model_dir, prompt="w1 w2", max_tokens=4)
    with pytest.raises(openai.BadRequestError) as bad:
        client(ray_server).completions.create(model=tiny_model_dir, prompt="w1 w2", max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"
    answer = client(ray_server).completions.create(model=tiny_model_dir, prompt="w1 w2", max_tokens=4, temperature=0)
    assert answer.choices[0].text  # still serving


def test_concurrent_requests_are_spread_over_both_replicas(ray_server, tiny_model_dir):
    c = client(ray_server)

    def ask(i: int) -> str:
        prompt = PROMPTS[i % len(PROMPTS)] + f" w{i % 9 + 1}"
        return c.completions.create(model=tiny_model_dir, prompt=prompt, max_tokens=48, temperature=0).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(ask, range(16)))
    assert all(texts)
    metrics = openai_metrics(ray_server)
    served = {replica: value for replica, value in metrics.items() if value > 0}
    assert len(served) == 2, metrics  # every replica generated tokens, and /metrics shows each by its label


def openai_metrics(url: str) -> dict[str, float]:
    """Tokens generated per replica, from one scrape of /metrics (answered by any replica)."""
    import httpx

    # the server has an API key: /metrics needs it too (serve --metrics-without-key opens it)
    text = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {API_KEY}"}, timeout=30).text
    found = re.findall(r'^specdecode:generation_tokens_total\{replica="([^"]+)"\} (\S+)$', text, re.MULTILINE)
    return {replica: float(value) for replica, value in found}


def test_a_replica_killed_during_a_load_test_loses_no_request_and_comes_back(ray_server, tiny_model_dir):
    before = replica_names()
    victim = before[0]

    killed_at = []

    def kill_soon() -> None:
        time.sleep(0.8)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=False)
        killed_at.append(time.perf_counter())

    killer = threading.Thread(target=kill_soon)
    killer.start()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    start = time.perf_counter()
    result, timings = run_level(client(ray_server), tiny_model_dir, prompts, 8, 120, 1.0)
    ended = time.perf_counter()
    killer.join()
    assert killed_at[0] < ended, "the load test ended before the kill: give it more requests"
    assert ended - start < 120  # none hung (each request's own timeout is 60 s)
    assert result.completed + result.failed == len(prompts)  # every request came back, whole or failed
    assert result.completed > 0
    # a request cut off by the kill fails as the server's fault (5xx) or a broken connection:
    # both retryable (the official client retries them by default), and counted here
    retryable = ("InternalServerError", "APIConnectionError")
    assert all(t.error.startswith(retryable) for t in timings if t.error), result.errors
    wait_for(lambda: len(replica_names()) == 2 and victim not in replica_names(), timeout=120)
    wait_for(lambda: len(openai_metrics(ray_server)) == 2, timeout=60)  # the new replica answers
    again = [t.error for t in run_level(client(ray_server), tiny_model_dir, PROMPTS, 4, 16, 0.0)[1]]
    assert again == [None] * len(PROMPTS)  # the retries succeed


def test_one_scrape_holds_every_replicas_samples_by_label():
    from prometheus_client.parser import text_string_to_metric_families

    from specdecode.server.metrics import ServerMetrics
    from specdecode.server.ray_serve import merged_metrics

    first, second = ServerMetrics("m"), ServerMetrics("m")
    first.generation_tokens.inc(3)
    second.generation_tokens.inc(5)
    texts = [(name, generate_latest(m.registry).decode()) for name, m in (("a", first), ("b", second))]
    merged = merged_metrics(texts).decode()
    assert merged.count("# TYPE ") == texts[0][1].count("# TYPE ")  # one family each, not one per replica
    tokens = next(f for f in text_string_to_metric_families(merged) if f.name == "specdecode:generation_tokens")
    by_replica = {s.labels["replica"]: s.value for s in tokens.samples if s.name.endswith("_total")}
    assert by_replica == {"a": 3.0, "b": 5.0}


def test_autoscaling_options_reach_ray_serve(monkeypatch):
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)  # they would reach the replicas' options too (tests/server/test_ray_tracing_env.py)
    from specdecode.server.config import ServerConfig
    from specdecode.server.ray_serve import Scaling

    config = ServerConfig("m", max_batch_size=8, max_waiting=16)
    fixed = Scaling(replicas=3, replica_cpus=2).deployment_options(config)
    assert fixed["num_replicas"] == 3 and fixed["ray_actor_options"] == {"num_cpus": 2}
    assert fixed["max_ongoing_requests"] == 24 and "autoscaling_config" not in fixed
    scaled = Scaling(2, 1, min_replicas=1, max_replicas=4, target_ongoing_requests=6).deployment_options(config)
    assert scaled["autoscaling_config"] == dict(
        min_replicas=1, max_replicas=4, initial_replicas=2, target_ongoing_requests=6
    )
    assert "num_replicas" not in scaled
