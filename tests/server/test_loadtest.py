"""`specdecode loadtest` against the real server on loopback (tiny model)."""

from __future__ import annotations

import contextlib

import httpx
from rich.console import Console
from typer.testing import CliRunner

from helpers import SERVED_MODEL as MODEL
from helpers import CrashAt, metric, serving, wait_for
from specdecode import CacheOptions, SpeculativeEngine
from specdecode.cli import app as cli_app
from specdecode.server import create_app, loadtest
from specdecode.server.faults import RandomFaults
from specdecode.server.loadtest import run_loadtest, server_metrics, started_server

PROMPTS = ["w1 w2 w3", "w4 w5 w4 w5", "w9 w8 w7", "w2 w2 w2 w3", "w10 w11", "w3 w1", "w5 w6 w5", "w7 w7"]


def test_levels_report_throughput_latency_and_greedy_equality(tiny_model_dir):
    # no caches: with them, level 4 would be answered from level 1's answers
    engine = SpeculativeEngine.from_pretrained(
        tiny_model_dir, cache=CacheOptions(response_cache=False, draft_store=False)
    )
    with serving(create_app(engine, model_name=MODEL)) as url:
        one, four = run_loadtest(f"{url}/v1", MODEL, PROMPTS * 2, [1, 4], max_tokens=10)
        counters = server_metrics(f"{url}/v1")
    assert one.completed == four.completed == 16 and one.failed == four.failed == 0
    # the requests went once more before the levels, untimed: no level met a cold server
    assert sum(v for k, v in counters.items() if k.startswith("request_success_total")) == 3 * 16
    assert four.identical_to_one_at_a_time == four.compared_to_one_at_a_time == 16
    assert four.speedup_vs_one_at_a_time > 0 and one.output_tokens == four.output_tokens > 0
    assert 0 < four.ttft_p50_s <= four.ttft_p99_s and 0 < four.e2e_p50_s <= four.e2e_p99_s


class Faults:
    """Transient step failures at random, and two worker crashes at fixed steps."""

    def __init__(self):
        self.random, self.crashes = RandomFaults(transient=0.15, seed=4), CrashAt(5, 20)

    def before_step(self, requests) -> None:
        self.crashes.before_step(requests)
        self.random.before_step(requests)

    def after_forward(self, requests) -> None:
        self.random.after_forward(requests)


def test_no_request_is_lost_or_hung_under_faults_and_disconnects(tiny_model_dir):
    """A small version of the 500-request run in the closing note."""
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir)
    with serving(create_app(engine, model_name=MODEL, faults=Faults())) as url:
        (level,) = run_loadtest(
            f"{url}/v1", MODEL, PROMPTS * 8, [8], max_tokens=12, disconnect_rate=0.2, timeout_s=60, warm_up=False
        )
        assert level.completed + level.disconnected + level.failed == 64
        assert level.disconnected > 0 and level.completed > 0
        # a request may fail only by an injected fault that persisted through its retries; none timed out
        assert not level.errors or all("injected" in e for e in level.errors), level.errors
        wait_for(lambda: metric(httpx.get(f"{url}/metrics").text, "specdecode:num_requests_running") == 0)
        counters = server_metrics(f"{url}/v1")
    assert counters["engine_worker_restarts_total"] == 2 and counters["engine_step_retries_total"] > 0


def test_loadtest_refuses_bad_options():
    runner = CliRunner()
    for args in (
        ["--concurrency", "1,x"],
        ["--concurrency", "0"],
        ["--disconnect-rate", "2"],
        ["--requests", "0"],
        ["--url", "http://127.0.0.1:9/v1", "--inject-faults", "0.1,0"],
        ["--url", "http://127.0.0.1:9/v1", "--dtype", "bfloat16"],
        ["--dtype", "fp8"],
    ):
        result = runner.invoke(cli_app, ["loadtest", *args])
        assert result.exit_code == 2 and "error" in result.output, args


def test_url_with_or_without_v1_and_a_clear_error_when_nothing_answers(tiny_model_dir):
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir)
    with serving(create_app(engine, model_name=MODEL)) as url:
        for given in (url, f"{url}/", f"{url}/v1"):
            with started_server(given, "unused", 1, None, Console()) as (api_base, model):
                assert (api_base, model) == (f"{url}/v1", MODEL)
    result = CliRunner().invoke(cli_app, ["loadtest", "--url", "http://127.0.0.1:9", "--requests", "1"])
    assert result.exit_code == 2 and "no OpenAI-compatible server answered" in result.output
    assert "Traceback" not in result.output


def test_a_keyed_server_is_load_tested_with_its_key_and_named_without_it(tiny_model_dir):
    """--url with --api-key reaches /v1 and the keyed /metrics; without the key (or with a wrong
    one) the run stops in one line that names --api-key."""
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir)
    with serving(create_app(engine, model_name=MODEL, api_key="sesame")) as url:
        with started_server(url, "unused", 1, None, Console(), api_key="sesame") as (api_base, model):
            (level,) = run_loadtest(api_base, model, PROMPTS[:2], [1], max_tokens=4, api_key="sesame")
            counters = server_metrics(api_base, "sesame")
        assert (
            level.completed == 2
            and level.failed == 0
            and sum(v for k, v in counters.items() if k.startswith("request_success_total")) >= 2
        )
        for key in ([], ["--api-key", "wrong"]):
            result = CliRunner().invoke(cli_app, ["loadtest", "--url", url, "--requests", "1", *key], env={})
            assert result.exit_code == 2 and "--api-key" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(cli_app, ["loadtest", "--api-key", "sesame"])
    assert result.exit_code == 2 and "--api-key is for a running server's --url" in result.output


def test_a_running_server_s_caches_are_named_and_the_server_started_here_has_none(tiny_model_dir, monkeypatch):
    """Every level sends the same requests: a server whose response cache answers the later
    levels is named in a warning, one without caches is not; the server loadtest starts runs
    without them."""
    runner = CliRunner()
    args = ["loadtest", "--requests", "2", "--concurrency", "1,2", "--max-tokens", "4"]
    for options, warned in ((CacheOptions(), True), (CacheOptions(response_cache=False, draft_store=False), False)):
        engine = SpeculativeEngine.from_pretrained(tiny_model_dir, cache=options)
        with serving(create_app(engine, model_name=MODEL)) as url:
            result = runner.invoke(cli_app, [*args, "--url", url])
        assert result.exit_code == 0, result.output
        said = " ".join(result.output.split())  # as one line, however the console wrapped it
        assert ("--no-response-cache --no-draft-store --no-prefix-cache" in said) is warned, result.output
    started = []
    monkeypatch.setattr(loadtest, "serve_process", lambda args, **_: started.append(args) or _no_server())
    with started_server(None, "a-model", 4, None, Console()):
        pass
    assert {"--no-response-cache", "--no-draft-store", "--no-prefix-cache"} <= set(started[0])


@contextlib.contextmanager
def _no_server():
    yield "http://127.0.0.1:9/v1"
