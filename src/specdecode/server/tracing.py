"""OpenTelemetry traces of the server: a span per HTTP request (FastAPI's instrumentation,
its parent the client's W3C `traceparent`), under it one generation span per choice with
the GenAI semantic conventions' attributes (`gen_ai.*`) and our speculative ones
(`specdecode.*`), and under that its phases: `queue` (arrival to a batch slot), `prefill`
(the slot to the first token) and `decode` (the first token to the end; its steps are
aggregated into attributes and one event per draft length, never a span per token).
With a Redis cache backend (--cache-url), each Redis command is a client span (`GET`, `SET`,
`XRANGE`, `XADD`: opentelemetry-instrumentation-redis) under the HTTP span of the request
that made it: the engine thread makes the request's context current around its cache calls
(`RequestTrace.current`).

The engine thread must not wait on the tracer, and a request's phases end there, so the
handler only captures its context (`Tracing.start`: a RequestTrace carried on the
RequestHandle) and the engine thread creates every generation span at once when the
request ends (`RequestTrace.end`), with the times it recorded. Spans are exported from a
background thread (BatchSpanProcessor).

Off unless asked for: `from_environment` turns it on for OTLP when OTEL_EXPORTER_OTLP_ENDPOINT
(or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set, protocol from OTEL_EXPORTER_OTLP_PROTOCOL
(http/protobuf, the default, or grpc), and for the console with `serve --otel-console`.
With tracing off the app is not instrumented and the handles carry None: nothing runs.

No content by default. Spans carry what a request asked for (model, sampling parameters, k)
and what it cost, never its prompt or its answer: as in the GenAI conventions, content is
opt-in, with OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true (or SPAN_ONLY,
SPAN_AND_EVENT), which adds `gen_ai.input.messages` and `gen_ai.output.messages`. An error
the request caused (a SpecDecodeError: bad ids, a prompt too long...) quotes the request in
its message, so by default its span records the error's type and parameter, not its message.
"""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from opentelemetry import context as otel_context
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

from specdecode.errors import SpecDecodeError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from specdecode.engine import GenerationResult
    from specdecode.server.worker import RequestHandle

logger = logging.getLogger("specdecode.server")

NOT_TRACED_URLS = "/metrics,/health"  # Prometheus scrapes and health checks: no spans
CAPTURE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
# its values that put content on spans: the older instrumentations' "true", the newer modes
_CAPTURE_VALUES = ("true", "span_only", "span_and_event")


def captures_content() -> bool:
    """Whether the operator opted in to prompts and answers on spans (off unless set)."""
    return os.environ.get(CAPTURE_CONTENT, "").strip().lower() in _CAPTURE_VALUES


class Tracing:
    """The tracer of one app, from its own TracerProvider (several apps in one process, as in
    the tests, each export to their own exporters)."""

    def __init__(self, provider: TracerProvider, capture_content: bool | None = None):
        """capture_content: prompts, answers and the errors that quote them on spans (None: as
        OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT says; off when it is not set)."""
        self.provider = provider
        self.tracer = provider.get_tracer("specdecode.server")
        self.capture_content = captures_content() if capture_content is None else capture_content

    @classmethod
    def to(cls, *exporters: SpanExporter, batch: bool = True, capture_content: bool | None = None) -> Tracing:
        """Spans to these exporters, batched in a background thread (batch=False: each span
        as it ends, in the thread that ends it, as tests want)."""
        provider = TracerProvider(resource=_resource())
        for exporter in exporters:
            provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        return cls(provider, capture_content)

    def instrument(self, app: FastAPI) -> None:
        """A server span for every HTTP request but scrapes and health checks, child of the
        client's `traceparent`; no spans for each ASGI message (one per streamed chunk); and a
        client span per Redis command of the app's engine (create_app set app.state.server)."""
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.instrument_app(
            app,
            tracer_provider=self.provider,
            meter_provider=NoOpMeterProvider(),  # HTTP metrics: /metrics has ours
            excluded_urls=os.environ.get("OTEL_PYTHON_FASTAPI_EXCLUDED_URLS", NOT_TRACED_URLS),
            exclude_spans=["receive", "send"],
        )
        self.instrument_cache(app.state.server.engine.cache_backend)

    def instrument_cache(self, backend) -> None:
        """A client span per command of a Redis backend's client, to this app's exporters;
        nothing for the in-process backend (no network call to see)."""
        from specdecode.cache.backends import RedisBackend

        if not isinstance(backend, RedisBackend):
            return
        from opentelemetry.instrumentation.redis import RedisInstrumentor

        client, flag = backend.client, "_is_instrumented_by_opentelemetry"  # the instrumentation's mark
        if getattr(client, flag, False):
            # the same engine under a new app (as in tests): its spans go to the newest app's
            # exporters; uninstrument_client leaves the mark set, which would refuse the new one
            RedisInstrumentor.uninstrument_client(client)
            setattr(client, flag, False)
        RedisInstrumentor.instrument_client(client, tracer_provider=self.provider)

    def start(self, model: str) -> RequestTrace:
        """In the request's handler: what its spans will hang under (the HTTP span)."""
        return RequestTrace(self.tracer, otel_context.get_current(), model, self.capture_content)

    def flush(self) -> None:
        self.provider.force_flush()


class RequestTrace:
    """One request's spans, created and ended from the engine thread when it ends."""

    __slots__ = ("tracer", "parent", "model", "capture_content")

    def __init__(self, tracer, parent, model: str, capture_content: bool = False):
        self.tracer, self.parent, self.model = tracer, parent, model
        self.capture_content = capture_content

    @contextmanager
    def current(self) -> Iterator[None]:
        """The request's context current in this thread: spans started meanwhile (its Redis
        calls) are children of its HTTP span, not roots of traces of their own."""
        token = otel_context.attach(self.parent)
        try:
            yield
        finally:
            otel_context.detach(token)

    def end(
        self, handle: RequestHandle, result: GenerationResult | None, error: BaseException | None, aborted: bool
    ) -> None:
        try:
            self._spans(handle, result, error, aborted)
        except Exception:  # noqa: BLE001 - tracing must never fail a request or the engine loop
            logger.warning("could not record the spans of a request", exc_info=True)

    def _spans(self, handle: RequestHandle, result, error, aborted: bool) -> None:
        request = handle.request
        now, now_ns = time.perf_counter(), time.time_ns()

        def ns(t: float) -> int:  # perf_counter seconds -> epoch nanoseconds
            return now_ns - int((now - t) * 1e9)

        operation = request.operation
        span = self.tracer.start_span(
            f"{operation} {self.model}",
            context=self.parent,
            kind=SpanKind.INTERNAL,
            start_time=ns(request.arrival),
            attributes=_request_attributes(request, self.model),
        )
        if self.capture_content:
            span.set_attribute("gen_ai.input.messages", _input_messages(request))
        admitted, first = handle.started_at, handle.first_token_at
        cached = result is not None and result.stats.cached
        phases = [("queue", request.arrival, admitted or now)]
        if admitted is not None and not cached:
            phases.append(("prefill", admitted, first or now))
            if first is not None:
                phases.append(("decode", first, now))
        inside = set_span_in_context(span)
        for name, start, stop in phases:
            child = self.tracer.start_span(name, context=inside, start_time=ns(start))
            if name == "decode" and result is not None:
                _decode_summary(child, result)
            if error is not None and name == phases[-1][0]:
                child.set_status(Status(StatusCode.ERROR, f"{type(error).__name__} during {name}"))
            child.end(end_time=ns(stop))
        if handle.crashes:
            span.set_attribute("specdecode.worker_crashes", handle.crashes)
        if result is not None:
            span.set_attributes(_result_attributes(result, self.model))
            if self.capture_content:
                span.set_attribute("gen_ai.output.messages", _output_messages(result))
        elif aborted:
            span.set_attribute("gen_ai.response.finish_reasons", ["abort"])
            span.add_event("client_disconnected", timestamp=now_ns)
        if error is not None:
            span.set_attribute("error.type", type(error).__qualname__)
            message = _error_message(error, self.capture_content)
            if message == str(error):
                span.record_exception(error, timestamp=now_ns)
            else:  # the message and the traceback's last line (which repeats it) withheld
                stack = "".join(traceback.format_tb(error.__traceback__)) + f"{type(error).__qualname__}: {message}"
                overrides = {"exception.message": message, "exception.stacktrace": stack}
                span.record_exception(error, attributes=overrides, timestamp=now_ns)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {message}"))
        span.end(end_time=now_ns)


def _error_message(error: BaseException, capture_content: bool) -> str:
    """What a span says of an error: its message, unless the request caused it (its message
    quotes the request: prompt ids, lengths of its text) and content is not captured."""
    if capture_content or not isinstance(error, SpecDecodeError):
        return str(error)
    where = f" in {error.param}" if error.param else ""
    return f"the request was refused{where} (its message is content: {CAPTURE_CONTENT}=true records it)"


def _input_messages(request) -> str:
    """gen_ai.input.messages: the chat's messages, or the prompt as one user message."""
    if request.messages is not None:
        messages = [{"role": m["role"], "parts": [{"type": "text", "content": m["content"]}]} for m in request.messages]
    else:
        messages = [{"role": "user", "parts": [_part(request.prompt)]}]
    return json.dumps(messages)


def _output_messages(result: GenerationResult) -> str:
    """gen_ai.output.messages: the answer, as one assistant message."""
    part = _part(result.text if result.text is not None else result.token_ids)
    return json.dumps([{"role": "assistant", "parts": [part], "finish_reason": result.finish_reason}])


def _part(content: str | list[int]) -> dict:
    return (
        {"type": "text", "content": content} if isinstance(content, str) else {"type": "token_ids", "content": content}
    )


def _request_attributes(request, model: str) -> dict:
    settings = request.settings
    attributes = {
        "gen_ai.operation.name": request.operation,
        "gen_ai.provider.name": "specdecode",
        "gen_ai.request.model": model,
        "gen_ai.request.temperature": settings.params.temperature,
        "specdecode.stream": request.stream,
    }
    optional = {
        "gen_ai.request.max_tokens": request.max_tokens,
        "gen_ai.request.top_p": settings.params.top_p,
        "gen_ai.request.top_k": settings.params.top_k,
        "gen_ai.request.seed": settings.seed,
        "gen_ai.request.stop_sequences": list(settings.stopping.stop_strings) or None,
    }
    return attributes | {key: value for key, value in optional.items() if value is not None}


def _result_attributes(result: GenerationResult, model: str) -> dict:
    stats = result.stats
    return {
        "gen_ai.response.model": model,
        "gen_ai.response.finish_reasons": [result.finish_reason],
        "gen_ai.usage.input_tokens": len(result.prompt_token_ids),
        "gen_ai.usage.output_tokens": len(result.token_ids),
        "specdecode.drafter": stats.drafter,
        "specdecode.k_max": stats.num_speculative_tokens,
        "specdecode.k_policy": stats.k_policy,
        "specdecode.mean_k": stats.mean_k,
        "specdecode.drafted_tokens": stats.drafted_tokens,
        "specdecode.accepted_tokens": stats.accepted_tokens,
        "specdecode.acceptance_rate": stats.acceptance_rate,
        "specdecode.mean_accepted_length": stats.mean_accepted_length,
        "specdecode.target_forwards": stats.target_forwards,
        "specdecode.cached": stats.cached,
    }


def _decode_summary(span, result: GenerationResult) -> None:
    """The decode steps, aggregated: totals as attributes, one event per draft length used."""
    stats = result.stats
    span.set_attributes(
        {
            "specdecode.steps": stats.target_forwards,
            "specdecode.drafted_tokens": stats.drafted_tokens,
            "specdecode.accepted_tokens": stats.accepted_tokens,
            "specdecode.accepted_per_position": stats.accepted_per_position,
            "specdecode.drafted_per_position": stats.drafted_per_position,
        }
    )
    for k, steps in sorted(stats.drafted_histogram.items()):
        span.add_event("draft_length", {"specdecode.k": k, "specdecode.steps": steps})
    for source, (drafted, accepted) in sorted(stats.drafted_by_source.items()):
        span.add_event(
            "drafter_source",
            {
                "specdecode.drafter": source,
                "specdecode.drafted_tokens": drafted,
                "specdecode.accepted_tokens": accepted,
            },
        )


def _resource() -> Resource:
    """OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES as set, service.name "specdecode" if neither names one."""
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "specdecode"}))
    return resource


def from_environment(console: bool = False) -> Tracing | None:
    """Tracing as the standard OTEL_* variables ask (OTLP when an endpoint is set), plus the
    console when asked; None (off) when neither, or when OTEL_SDK_DISABLED=true."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporters: list[SpanExporter] = []
    wants_otlp = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if wants_otlp and env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() != "none":
        exporters.append(otlp_exporter())
    if console:
        exporters.append(ConsoleSpanExporter())
    return Tracing.to(*exporters) if exporters else None


def otlp_exporter() -> SpanExporter:
    """The OTLP span exporter for OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL (default http/protobuf,
    as the specification advises); endpoint, headers, timeout and TLS from the OTEL_* variables."""
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    protocol = protocol.strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    from specdecode.errors import InvalidArgumentError

    raise InvalidArgumentError(
        f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported; use http/protobuf or grpc", "otel"
    )
