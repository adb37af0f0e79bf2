"""Observability: OpenTelemetry traces (span tree, GenAI and speculative attributes, the
client's traceparent, OTLP and console export from `specdecode serve`, Redis calls against a
real redis-server), the GenAI metrics beside the vLLM-style ones (each request counted once),
the estimated speedup over target-only, the counters under injected faults, and the shipped
Grafana dashboard: every panel's PromQL run against a real Prometheus that scraped the real
server under load (and the per-replica panels against a Ray-shaped /metrics), with negative
controls that must come back empty."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families

from helpers import SERVED_MODEL as MODEL
from helpers import CrashAt, Gate, free_port, prometheus_server, redis_server, serving, wait_for
from specdecode import CacheOptions, SpeculativeEngine
from specdecode.errors import InvalidArgumentError
from specdecode.server import create_app
from specdecode.server import tracing as tracing_module
from specdecode.server.faults import RandomFaults, TransientFault, WorkerCrash
from specdecode.server.tracing import Tracing

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "specdecode.json"
PROMPTS = ["w1 w2 w3", "w4 w5 w4 w5", "w9 w8 w7", "w2 w2 w2 w3", "w10 w11", "w3 w1", "w5 w6 w5", "w7 w7"]
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACE_ID, PARENT_SPAN_ID = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
POISONED = "w6 w6 w6"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # every request runs the decode loop (a response-cache hit would take no step to fault or count);
    # k fixed: adaptive k follows the clock, and on a busy machine it may stop drafting
    from specdecode import DrafterOptions

    options = DrafterOptions(adaptive=False)
    return SpeculativeEngine.from_pretrained(tiny_model_dir, cache=CacheOptions(response_cache=False), options=options)


def new_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(client: openai.OpenAI, prompt: str, max_tokens: int = 12) -> str:
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


# --- traces ---


@pytest.fixture(scope="module")
def traced(tiny_model_dir):
    """A server whose spans go to memory, each as it ends (an engine of its own: it runs
    while other tests' servers run theirs)."""
    exporter = InMemorySpanExporter()
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir)
    with serving(create_app(engine, model_name=MODEL, tracing=Tracing.to(exporter, batch=False))) as url:
        yield url, exporter


def trace_of(exporter: InMemorySpanExporter, route: str) -> dict:
    """The spans of the last request to route, by name, once its HTTP span has ended."""
    servers = lambda: [  # noqa: E731
        s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER and s.attributes["http.route"] == route
    ]
    wait_for(lambda: servers())
    server = servers()[-1]
    spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == server.context.trace_id]
    by_name = defaultdict(list)
    for span in spans:
        by_name[span.name].append(span)
    return {"server": server, "all": spans} | {name: found[0] for name, found in by_name.items()}


def assert_generation_tree(trace: dict, generation_name: str) -> None:
    """server -> generation -> queue, prefill, decode, in time order, nothing else in the trace."""
    server, generation = trace["server"], trace[generation_name]
    assert generation.parent.span_id == server.context.span_id and generation.kind == SpanKind.INTERNAL
    phases = [trace[name] for name in ("queue", "prefill", "decode")]
    assert all(p.parent.span_id == generation.context.span_id for p in phases)
    assert generation.start_time == phases[0].start_time and phases[-1].end_time == generation.end_time
    assert all(a.end_time == b.start_time for a, b in zip(phases, phases[1:]))
    assert server.start_time <= generation.start_time and generation.end_time <= server.end_time
    assert len(trace["all"]) == 5  # no span per token, nor per streamed chunk


def test_a_request_is_one_span_tree_under_the_clients_traceparent(traced):
    url, exporter = traced
    exporter.clear()
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, headers={"traceparent": TRACEPARENT}).json()
    trace = trace_of(exporter, "/v1/completions")
    server, generation, decode = trace["server"], trace[f"text_completion {MODEL}"], trace["decode"]
    # the client's traceparent is the parent of the request's span
    assert server.context.trace_id == TRACE_ID and server.parent.span_id == PARENT_SPAN_ID and server.parent.is_remote
    assert_generation_tree(trace, f"text_completion {MODEL}")
    stats, usage = response["speculative"], response["usage"]
    assert dict(generation.attributes) == {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "specdecode",
        "gen_ai.request.model": MODEL,
        "gen_ai.response.model": MODEL,
        "gen_ai.request.temperature": 0.0,
        "gen_ai.request.max_tokens": 12,
        "gen_ai.response.finish_reasons": (response["choices"][0]["finish_reason"],),
        "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "specdecode.stream": False,
        "specdecode.drafter": "auto",
        "specdecode.k_max": 4,
        "specdecode.k_policy": stats["k_policy"],
        "specdecode.mean_k": stats["mean_k"],
        "specdecode.drafted_tokens": stats["drafted_tokens"],
        "specdecode.accepted_tokens": stats["accepted_tokens"],
        "specdecode.acceptance_rate": stats["acceptance_rate"],
        "specdecode.mean_accepted_length": stats["mean_accepted_length"],
        "specdecode.target_forwards": stats["target_forwards"],
        "specdecode.cached": False,
    }
    # the decode steps, aggregated: one event per draft length, their steps adding up to the forwards
    lengths = {
        e.attributes["specdecode.k"]: e.attributes["specdecode.steps"]
        for e in decode.events
        if e.name == "draft_length"
    }
    sources = {
        e.attributes["specdecode.drafter"]: e.attributes["specdecode.accepted_tokens"]
        for e in decode.events
        if e.name == "drafter_source"
    }
    assert sources == {name: accepted for name, (_, accepted) in stats["drafted_by_source"].items()}
    assert lengths == {int(k): n for k, n in stats["drafted_histogram"].items()}
    assert decode.attributes["specdecode.steps"] == stats["target_forwards"] == sum(lengths.values())
    assert generation.status.status_code == StatusCode.UNSET and server.status.status_code == StatusCode.UNSET

    # control: without a traceparent the request starts a trace of its own
    httpx.post(f"{url}/v1/completions", json=body)
    wait_for(lambda: len([s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]) == 2)
    fresh = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER][-1]
    assert fresh.parent is None and fresh.context.trace_id != TRACE_ID


def test_a_streamed_chat_request_is_one_span_tree_however_many_chunks(traced):
    url, exporter = traced
    exporter.clear()
    chunks = list(
        new_client(url).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "w1 w2"}],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    trace = trace_of(exporter, "/v1/chat/completions")
    assert_generation_tree(trace, f"chat {MODEL}")
    generation = trace[f"chat {MODEL}"]
    assert len(chunks) > 10  # streamed chunk by chunk: still five spans
    assert generation.attributes["gen_ai.operation.name"] == "chat" and generation.attributes["specdecode.stream"]
    assert generation.attributes["gen_ai.usage.output_tokens"] == chunks[-1].usage.completion_tokens == 16
    assert generation.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert trace["prefill"].end_time <= trace["decode"].start_time


def test_a_failed_request_has_an_error_span_with_the_exception(engine):
    exporter = InMemorySpanExporter()
    app = create_app(
        engine, model_name=MODEL, faults=RandomFaults(poison=POISONED), tracing=Tracing.to(exporter, batch=False)
    )
    with serving(app) as url:
        response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": POISONED}, timeout=30)
        assert response.status_code == 500
        trace = trace_of(exporter, "/v1/completions")
    generation = trace[f"text_completion {MODEL}"]
    assert generation.status.status_code == StatusCode.ERROR and "poisoned" in generation.status.description
    assert generation.attributes["error.type"] == "RuntimeError"
    (event,) = [e for e in generation.events if e.name == "exception"]
    assert event.attributes["exception.type"] == "RuntimeError" and "poisoned" in event.attributes["exception.message"]
    # it failed in its first step, the prefill: that phase is marked, no decode phase began
    assert trace["prefill"].status.status_code == StatusCode.ERROR and "decode" not in trace
    assert trace["queue"].status.status_code == StatusCode.UNSET
    assert trace["server"].status.status_code == StatusCode.ERROR  # a 500
    assert "gen_ai.usage.output_tokens" not in generation.attributes


def test_a_response_cache_hit_has_no_prefill_or_decode_span(tiny_model_dir):
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir, dtype="bfloat16")  # the response cache is on
    exporter = InMemorySpanExporter()
    with serving(create_app(engine, model_name=MODEL, tracing=Tracing.to(exporter, batch=False))) as url:
        first, again = (greedy(new_client(url), PROMPTS[2]) for _ in range(2))
        trace = trace_of(exporter, "/v1/completions")
    generation = trace[f"text_completion {MODEL}"]
    assert first == again and generation.attributes["specdecode.cached"]
    assert generation.attributes["gen_ai.usage.output_tokens"] > 0
    assert {s.name for s in trace["all"]} == {"POST /v1/completions", generation.name, "queue"}


CAPTURE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"


def span_strings(spans) -> str:
    """Every string a backend would receive of these spans: names, attribute values, event
    names and attributes, status descriptions."""

    def values(attributes) -> list[str]:
        found = []
        for value in (attributes or {}).values():
            found += [str(v) for v in value] if isinstance(value, tuple | list) else [str(value)]
        return found

    strings = []
    for span in spans:
        strings += [span.name, span.status.description or ""] + values(span.attributes)
        for event in span.events:
            strings += [event.name] + values(event.attributes)
    return "\n".join(strings)


def content_trace(engine, exporter, body: dict, route: str = "/v1/completions") -> tuple[httpx.Response, dict]:
    exporter.clear()
    with serving(create_app(engine, model_name=MODEL, tracing=Tracing.to(exporter, batch=False))) as url:
        response = httpx.post(f"{url}{route}", json={"model": MODEL} | body, timeout=30)
        return response, trace_of(exporter, route)


def test_spans_hold_no_request_or_response_content_unless_the_operator_opts_in(engine, monkeypatch):
    """The GenAI conventions' rule: prompts, completions and errors that quote them are opt-in
    content (OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT), never sent by default."""
    monkeypatch.delenv(CAPTURE_CONTENT, raising=False)
    # an id of 7 digits: no port or other number of a span holds it by chance (a client port 59990 held "999")
    bad_ids, prompt = [17, 4242424, 23], "w7 w3 w9 w5"
    exporter = InMemorySpanExporter()
    refused, trace = content_trace(engine, exporter, {"prompt": bad_ids})
    assert refused.status_code == 400 and "4242424" in refused.json()["error"]["message"]  # the client is told
    generation = trace[f"text_completion {MODEL}"]
    assert generation.attributes["error.type"] == "InvalidArgumentError"
    exported = span_strings(trace["all"])
    assert "4242424" not in exported, exported
    served, trace = content_trace(engine, exporter, {"prompt": prompt, "max_tokens": 8, "temperature": 0})
    text = served.json()["choices"][0]["text"]
    exported = span_strings(trace["all"])
    assert len(text.split()) > 2 and text not in exported and prompt not in exported, exported
    assert "gen_ai.input.messages" not in trace[f"text_completion {MODEL}"].attributes
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0}
    served, trace = content_trace(engine, exporter, chat, "/v1/chat/completions")
    answer = served.json()["choices"][0]["message"]["content"]
    exported = span_strings(trace["all"])
    assert answer not in exported and prompt not in exported, exported

    # opted in: the messages as the conventions record them, and the errors as they were raised
    monkeypatch.setenv(CAPTURE_CONTENT, "true")
    _, trace = content_trace(engine, exporter, {"prompt": bad_ids})
    assert "4242424" in trace[f"text_completion {MODEL}"].status.description
    _, trace = content_trace(engine, exporter, {"prompt": prompt, "max_tokens": 8, "temperature": 0})
    attributes = trace[f"text_completion {MODEL}"].attributes
    (given,) = json.loads(attributes["gen_ai.input.messages"])
    assert given["role"] == "user" and given["parts"] == [{"type": "text", "content": prompt}]
    (output,) = json.loads(attributes["gen_ai.output.messages"])
    assert output["parts"] == [{"type": "text", "content": text}] and output["finish_reason"] == "length"
    _, trace = content_trace(engine, exporter, chat, "/v1/chat/completions")
    attributes = trace[f"chat {MODEL}"].attributes
    assert json.loads(attributes["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": prompt}]}
    ]
    assert json.loads(attributes["gen_ai.output.messages"])[0]["parts"][0]["content"] == answer


def redis_spans(spans) -> list:
    return [s for s in spans if s.attributes.get("db.system") == "redis"]


def descends_from(span, ancestor, spans) -> bool:
    by_id = {s.context.span_id: s for s in spans}
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        if span is ancestor:
            return True
    return False


def test_redis_calls_are_client_spans_in_the_trace_of_the_request_that_made_them(tiny_model_dir):
    with redis_server() as redis_url:
        # bfloat16: the response cache is on; "auto" drafts from the draft store too
        engine = SpeculativeEngine.from_pretrained(tiny_model_dir, dtype="bfloat16", cache=CacheOptions(url=redis_url))
        create_app(engine, model_name=MODEL)  # tracing off: the client is left alone
        assert not hasattr(engine.cache_backend.client.execute_command, "__wrapped__")
        exporter = InMemorySpanExporter()
        with serving(create_app(engine, model_name=MODEL, tracing=Tracing.to(exporter, batch=False))) as url:
            greedy(new_client(url), PROMPTS[3])
            first = trace_of(exporter, "/v1/completions")
            exporter.clear()
            greedy(new_client(url), PROMPTS[3])  # the same request again: a response-cache hit
            again = trace_of(exporter, "/v1/completions")
            outside = [s for s in redis_spans(exporter.get_finished_spans()) if s not in again["all"]]
        # the same engine under another app: its Redis spans follow the new app's exporter
        newer = InMemorySpanExporter()
        with serving(create_app(engine, model_name=MODEL, tracing=Tracing.to(newer, batch=False))) as url:
            exporter.clear()
            greedy(new_client(url), PROMPTS[4])
            moved = trace_of(newer, "/v1/completions")
    # a miss: the lookup (GET) and the draft store's sync on admission (EVAL: a script on the
    # Redis that reads the log and leaves out records past the size bound), and at the end the
    # finished sequence shared (XADD) and the answer stored (SET)
    assert sorted(s.name for s in redis_spans(first["all"])) == ["EVAL", "GET", "SET", "XADD"]
    # a hit: the lookup alone, in the second request's trace; no Redis span outside a request's trace
    assert [s.name for s in redis_spans(again["all"])] == ["GET"] and outside == []
    for trace in (first, again):
        server = trace["server"]
        for span in redis_spans(trace["all"]):
            assert span.kind == SpanKind.CLIENT and descends_from(span, server, trace["all"])
            assert server.start_time <= span.start_time and span.end_time <= server.end_time
            assert span.attributes["db.statement"].startswith(span.name)  # arguments sanitized ("GET ?")
    assert len(redis_spans(moved["all"])) == 4 and exporter.get_finished_spans() == ()


def test_tracing_follows_the_standard_environment_variables(monkeypatch):
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    assert tracing_module.from_environment() is None  # nothing set: off

    def exporters(tracing: Tracing) -> list[str]:
        processors = tracing.provider._active_span_processor._span_processors
        return [f"{type(p.span_exporter).__module__}.{type(p.span_exporter).__name__}" for p in processors]

    assert exporters(tracing_module.from_environment(console=True)) == [
        "opentelemetry.sdk.trace.export.ConsoleSpanExporter"
    ]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    (http,) = exporters(tracing_module.from_environment())
    assert "otlp.proto.http" in http
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    (grpc,) = exporters(tracing_module.from_environment())
    assert "otlp.proto.grpc" in grpc
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(InvalidArgumentError, match="http/protobuf or grpc"):
        tracing_module.from_environment()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing_module.from_environment() is None


class _OTLPReceiver(BaseHTTPRequestHandler):
    """A minimal OTLP/HTTP collector: keeps every export request it is sent."""

    received: list[bytes] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/traces":
            type(self).received.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_serve_exports_over_otlp_with_only_the_endpoint_set_and_prints_with_otel_console(tiny_model_dir):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    _OTLPReceiver.received = []
    collector = ThreadingHTTPServer(("127.0.0.1", 0), _OTLPReceiver)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.server_port}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    command = [sys.executable, "-m", "specdecode.cli", "serve", "--target", tiny_model_dir, "--port", str(port)]
    server = subprocess.Popen(
        command + ["--otel-console"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(f"{url}/health"), timeout=60)
        body = {"model": tiny_model_dir, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, headers={"traceparent": TRACEPARENT}).status_code == 200

        def exported() -> list:
            requests = [ExportTraceServiceRequest.FromString(b) for b in _OTLPReceiver.received]
            return [(r, s) for q in requests for r in q.resource_spans for ss in r.scope_spans for s in ss.spans]

        wait_for(lambda: len(exported()) >= 5, timeout=20)
    finally:
        server.terminate()
        console = server.communicate(timeout=30)[0]
        collector.shutdown()
    spans = {span.name: (resource, span) for resource, span in exported()}
    assert {"POST /v1/completions", f"text_completion {tiny_model_dir}", "queue", "prefill", "decode"} <= set(spans)
    resource, request_span = spans["POST /v1/completions"]
    assert int.from_bytes(request_span.trace_id, "big") == TRACE_ID
    assert int.from_bytes(request_span.parent_span_id, "big") == PARENT_SPAN_ID
    service = {a.key: a.value.string_value for a in resource.resource.attributes}["service.name"]
    assert service == "specdecode"
    assert f'"name": "text_completion {tiny_model_dir}"' in console and '"gen_ai.usage.output_tokens": 6' in console


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# --- metrics ---


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum of the samples of that name whose labels include these."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def test_the_gen_ai_histograms_count_each_request_once_beside_the_vllm_ones(engine):
    with serving(create_app(engine, model_name=MODEL)) as url:
        client = new_client(url)
        for prompt in PROMPTS[:3]:
            greedy(client, prompt)
        for prompt in PROMPTS[3:5]:
            messages = [{"role": "user", "content": prompt}]
            list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True, seed=1))
        client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=12, n=2, seed=3)  # two engine requests
        m = scrape(url)
    requests = 7
    assert total(m, "specdecode:request_success_total") == requests
    # time to first token and per output token: observed once, into both families, the same values
    for vllm, gen_ai in [
        ("specdecode:time_to_first_token_seconds", "gen_ai_server_time_to_first_token_seconds"),
        ("specdecode:time_per_output_token_seconds", "gen_ai_server_time_per_output_token_seconds"),
    ]:
        assert total(m, f"{vllm}_count") == total(m, f"{gen_ai}_count") > 0
        assert total(m, f"{vllm}_sum") == pytest.approx(total(m, f"{gen_ai}_sum"), rel=1e-12)
    ttft = "gen_ai_server_time_to_first_token_seconds_count"
    assert total(m, ttft) == requests
    assert total(m, ttft, gen_ai_operation_name="chat", gen_ai_request_model=MODEL) == 2
    assert total(m, ttft, gen_ai_operation_name="text_completion") == 5
    assert total(m, "gen_ai_server_request_duration_seconds_count", error_type="") == requests
    assert total(m, "gen_ai_server_request_duration_seconds_count") == requests
    usage = "gen_ai_client_token_usage"
    assert total(m, f"{usage}_sum", gen_ai_token_type="output") == total(m, "specdecode:generation_tokens_total")
    assert total(m, f"{usage}_sum", gen_ai_token_type="input") == total(m, "specdecode:prompt_tokens_total")
    assert total(m, f"{usage}_count", gen_ai_token_type="input") == requests
    # one k observation per step of each request; their sum is what was drafted
    drafted = total(m, "specdecode:spec_decode_num_draft_tokens_total")
    assert total(m, "specdecode:spec_decode_draft_length_count") == total(
        m, "specdecode:spec_decode_num_target_forwards_total"
    )
    assert total(m, "specdecode:spec_decode_draft_length_sum") == drafted > 0
    assert total(m, "specdecode:spec_decode_num_draft_tokens_per_pos_total") == drafted
    # the tree series exist from the first scrape; this target verifies no trees, so they stay at 0
    for name in ("num_tree_steps_total", "num_tree_nodes_total", "tree_accepted_depth_total", "tree_size_count"):
        assert any(n == f"specdecode:spec_decode_{name}" for n, _ in m), name
        assert total(m, f"specdecode:spec_decode_{name}") == 0


class _SlowForwards(Gate):
    """Holds the first step until opened; then every target forward takes FORWARD_S more, so
    that its cost, not this machine's noise, is what the speedup's two sums measure."""

    FORWARD_S = 0.02

    def after_forward(self, requests) -> None:
        time.sleep(self.FORWARD_S)


def held(samples: dict) -> float:
    """Requests the server holds: queued or in the batch."""
    return total(samples, "specdecode:num_requests_waiting") + total(samples, "specdecode:num_requests_running")


def test_the_estimated_speedup_of_target_only_decoding_is_about_one(tiny_model_dir):
    """Four target-only requests decoded together: target-only seconds estimated from the
    measured cost of a 4-token forward (1/4 of it per token), over the steps' own seconds."""
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir)
    hook = _SlowForwards()
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "speculative": {"num_speculative_tokens": 0}}
    with serving(create_app(engine, model_name=MODEL, faults=hook)) as url:
        post = lambda prompt: httpx.post(f"{url}/v1/completions", json=body | {"prompt": prompt}, timeout=60)  # noqa: E731
        with ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(post, prompt) for prompt in PROMPTS[:4]]
            wait_for(lambda: held(scrape(url)) == 4)  # all four in: they decode together
            hook.opened.set()
            assert all(a.result().status_code == 200 for a in answers)
        m = scrape(url)
    steps = total(m, "specdecode:spec_decode_step_seconds_total")
    target_only = total(m, "specdecode:spec_decode_target_only_seconds_total")
    # batches of 3 or 4 (a sequence may stop early): a per-token share that ignored the batch would give ~3.6
    assert steps > 10 * _SlowForwards.FORWARD_S
    assert total(m, "specdecode:batch_size_sum") / total(m, "specdecode:batch_size_count") > 3
    # the same forwards either way: about 1, a little under (a step also drafts and commits)
    assert 0.8 < target_only / steps < 1.15, (target_only, steps)


def test_metrics_move_as_the_faults_do(engine):
    """Transient failures: retries; crashes: restarts, and a resumed request is still counted
    once; a poisoned request: an engine_failure error and one failed duration; a client that
    left: an abort; a request past the time limit: a timeout."""
    duration = "gen_ai_server_request_duration_seconds_count"

    def run(app, prompts=PROMPTS) -> dict:
        with serving(app) as url, ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda p: greedy(new_client(url), p), prompts))
            return scrape(url)

    m = run(create_app(engine, model_name=MODEL, faults=RandomFaults(transient=0.3, seed=1)))
    assert total(m, "specdecode:engine_step_retries_total") > 0
    assert total(m, "specdecode:engine_worker_restarts_total") == total(m, "specdecode:request_errors_total") == 0
    assert total(m, duration, error_type="") == total(m, duration) == 8

    m = run(create_app(engine, model_name=MODEL, faults=CrashAt(3, 6)))
    assert total(m, "specdecode:engine_worker_restarts_total") == 2
    # every request resumed after the crashes, and counted once
    assert total(m, duration) == total(m, "gen_ai_server_time_to_first_token_seconds_count") == 8
    assert total(m, "specdecode:time_to_first_token_seconds_count") == 8

    poisoned = create_app(engine, model_name=MODEL, faults=RandomFaults(poison=POISONED))
    with serving(poisoned) as url:
        failed = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": POISONED}, timeout=30)
        assert failed.status_code == 500
        greedy(new_client(url), PROMPTS[0])
        m = scrape(url)
    assert total(m, "specdecode:request_errors_total", kind="engine_failure") == 1
    assert total(m, duration, error_type="RuntimeError") == 1 and total(m, duration, error_type="") == 1
    assert total(m, "specdecode:request_success_total") == 1  # the failure is not a success

    waiting = create_app(engine, model_name=MODEL, max_batch_size=1, faults=Gate(10**9, delay=0.1))
    body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 100, "temperature": 0}
    with serving(waiting) as url:
        with pytest.raises(httpx.ReadTimeout):  # the client leaves while its request runs
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.3)
        wait_for(lambda: total(scrape(url), duration, error_type="abort") == 1)
        m = scrape(url)
    assert total(m, "specdecode:request_success_total", finished_reason="abort") == total(m, duration) == 1

    slow = create_app(engine, model_name=MODEL, max_request_seconds=0.2, faults=Gate(10**9, delay=0.5))
    with serving(slow) as url:
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 504
        m = scrape(url)
    assert total(m, "specdecode:request_errors_total", kind="request_timeout") == 1
    assert total(m, duration, error_type="RequestTimeoutError") == total(m, duration) == 1


# --- the Grafana dashboard against a real Prometheus ---


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, Grafana's range variables filled in."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    queries = []
    for panel in panels:
        for child in [panel] + panel.get("panels", []):
            for target in child.get("targets", []):
                expr = target["expr"].replace("$__rate_interval", "1m").replace("$__range", "5m")
                queries.append((child["title"], expr))
    return queries


def panel_failures(prometheus: str, queries: list[tuple[str, str]]) -> list[str]:
    """Each query that fails or returns no series with a number: what went wrong."""
    failures = []
    for title, expr in queries:
        answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}).json()
        if answer["status"] != "success":
            failures.append(f"{title}: {expr}: {answer.get('error')}")
            continue
        values = [float(series["value"][1]) for series in answer["data"]["result"]]
        if not any(math.isfinite(v) for v in values):
            failures.append(f"{title}: {expr}: no data ({values})")
    return failures


class _SomeFaults:
    """Transient failures at a few steps and one crash of the engine worker."""

    def __init__(self):
        self.steps = 0

    def before_step(self, requests) -> None:
        self.steps += 1
        if self.steps == 8:
            raise WorkerCrash("injected crash")
        if self.steps in (4, 12, 20):
            raise TransientFault("injected transient fault")

    def after_forward(self, requests) -> None:
        pass


def test_every_dashboard_panel_returns_data_from_a_real_prometheus(tiny_model_dir, tmp_path):
    panels = json.loads(DASHBOARD.read_text())["panels"]
    titles = {p["title"] for p in panels}
    for wanted in ["Request rate", "Output tokens/s", "Time to first token", "Time per output token", "Batch size"]:
        assert wanted in titles
    assert {"Output tokens/s by replica", "Estimated speedup over target-only"} <= titles
    assert all(t["datasource"]["uid"] == "${datasource}" for p in panels for t in p.get("targets", []))
    # bfloat16: the response cache is on (exact there), so the cache panels have something to show
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir, dtype="bfloat16")
    app = create_app(engine, model_name=MODEL, faults=_SomeFaults())
    with serving(app) as url, prometheus_server([url.removeprefix("http://")], tmp_path) as prometheus:
        up = lambda: httpx.get(f"{prometheus}/api/v1/query", params={"query": "up"}).json()  # noqa: E731
        wait_for(lambda: [r["value"][1] for r in up()["data"]["result"]] == ["1"], timeout=30)
        _load(url)
        served = total(scrape(url), "specdecode:generation_tokens_total")
        query = {"query": "specdecode:generation_tokens_total"}

        def scraped() -> bool:
            result = httpx.get(f"{prometheus}/api/v1/query", params=query).json()["data"]["result"]
            return bool(result) and float(result[0]["value"][1]) == served

        wait_for(scraped, timeout=30)
        time.sleep(2.5)  # two more scrapes: every series that appeared late has two samples in its window
        queries = dashboard_queries()
        assert len(queries) >= 30
        failures = panel_failures(prometheus, queries)
        assert not failures, "panels without data:\n" + "\n".join(failures)
        # negative controls: a metric we do not export, a label value never set, a wrong label name
        controls = [
            ("made up", "sum(rate(specdecode:no_such_metric_total[1m]))"),
            ("wrong value", 'sum(rate(specdecode:response_cache_lookups_total{result="hitt"}[1m]))'),
            ("wrong label", 'sum(rate(specdecode:request_errors_total{code="model_not_found"}[1m]))'),
        ]
        assert len(panel_failures(prometheus, controls)) == len(controls)
        m = scrape(url)
    assert total(m, "specdecode:response_cache_lookups_total", result="hit") > 0
    assert total(m, "specdecode:engine_worker_restarts_total") == 1
    assert total(m, "specdecode:engine_step_retries_total") > 0


def series(prometheus: str, expr: str) -> list[dict]:
    return httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}).json()["data"]["result"]


class _RayMetrics(BaseHTTPRequestHandler):
    """/metrics as a Ray deployment answers it (ray_serve.merged_metrics, every sample labelled
    with its replica): two replicas r1 and r2, here both the live metrics of one server."""

    server_url = ""

    def do_GET(self):  # noqa: N802 - http.server's name
        from specdecode.server.ray_serve import merged_metrics

        text = httpx.get(f"{self.server_url}/metrics").text
        body = merged_metrics([("r1", text), ("r2", text)])
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_per_replica_panels_split_by_the_label_ray_replicas_carry(engine, tmp_path):
    """The single-process test above proves these panels return data; only a Ray-shaped /metrics
    proves they split by the label the replicas carry."""
    pytest.importorskip("ray")
    queries = [(title, expr) for title, expr in dashboard_queries() if "by (replica)" in expr]
    assert len(queries) >= 3
    with serving(create_app(engine, model_name=MODEL)) as url:
        ray_metrics = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_RayMetrics,), {"server_url": url}))
        threading.Thread(target=ray_metrics.serve_forever, daemon=True).start()
        target = f"127.0.0.1:{ray_metrics.server_port}"
        try:
            with prometheus_server([target], tmp_path) as prometheus:
                ask = functools.partial(series, prometheus)
                wait_for(lambda: [r["value"][1] for r in ask("up")] == ["1"], timeout=30)
                for prompt in PROMPTS[:3]:
                    greedy(new_client(url), prompt)
                served = total(scrape(url), "specdecode:generation_tokens_total")
                scraped = lambda: [float(r["value"][1]) for r in ask("specdecode:generation_tokens_total")]  # noqa: E731
                wait_for(lambda: scraped() == [served, served], timeout=30)
                time.sleep(2.5)  # two more scrapes: a rate over the load
                for title, expr in queries:
                    replicas = {r["metric"].get("replica"): float(r["value"][1]) for r in ask(expr)}
                    assert set(replicas) == {"r1", "r2"}, title
                    assert all(math.isfinite(v) for v in replicas.values()), title
                # control: grouped by a label the replicas do not carry, one series with none
                wrong = ask(queries[0][1].replace("by (replica)", "by (replica_id)"))
                assert [r["metric"] for r in wrong] == [{}]
        finally:
            ray_metrics.shutdown()


def _load(url: str) -> None:
    """Eight clients: completions and chats, streamed or not, each prompt twice (the second a
    response-cache hit) and once more with another budget (drafted from the first answer by the
    draft store); and one request for another model (an error)."""
    client = new_client(url)

    def one(i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        budget = 20 if i < 2 * len(PROMPTS) else 19
        if i % 2:
            messages = [{"role": "user", "content": prompt}]
            list(
                client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=budget, temperature=0, stream=True
                )
            )
        else:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=budget, temperature=0)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(len(PROMPTS))))  # first the answers, then their repeats
        list(pool.map(one, range(len(PROMPTS), 3 * len(PROMPTS))))
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="another-model", prompt=PROMPTS[0], max_tokens=4)
