"""The FastAPI app: OpenAI-style endpoints (routes.py) over one EngineWorker (worker.py).

Handlers check the request, hand it to the worker and await its Future (streaming.py), so
the event loop stays free while the engine runs. Every failure is answered with OpenAI's
error object (errors.py), and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, TypedDict

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specdecode.engine import SpeculativeEngine
from specdecode.errors import InvalidArgumentError, SpecDecodeError
from specdecode.runners.slots import kv_bytes_per_token
from specdecode.server.config import ServerConfig
from specdecode.server.errors import APIError, error_response, install_error_handlers, retry_after, unauthorized
from specdecode.server.faults import StepHook
from specdecode.server.limits import BodyLimit, KeyCheck, uvicorn_config
from specdecode.server.metrics import ServerMetrics
from specdecode.server.routes import ServerState, v1
from specdecode.server.worker import EngineWorker

if TYPE_CHECKING:
    from specdecode.server.tracing import Tracing

logger = logging.getLogger("specdecode.server")


class _Pages(TypedDict, total=False):
    """FastAPI's own pages (None: off), as create_app passes them."""

    openapi_url: str | None
    docs_url: str | None
    redoc_url: str | None


def create_app(
    engine: SpeculativeEngine,
    config: ServerConfig | None = None,
    *,
    start_worker: bool = True,
    faults: StepHook | None = None,
    tracing: Tracing | None = None,
    metrics_text: Callable[[], Awaitable[bytes]] | None = None,
    **settings,
) -> FastAPI:
    """An app serving `engine` as the config's served_name, with its limits (ServerConfig; the
    default one where None). With an api_key, every route but /health needs it: /v1, /metrics
    (unless metrics_without_key: for a Prometheus that cannot send it) and /openapi.json; the
    /docs and /redoc pages are off (a browser cannot send the key their requests need).

    settings: fields of the config to replace (`create_app(engine, max_batch_size=1)`).
    start_worker: False when the caller runs `app.state.worker.run()` in a thread of its own
    (`specdecode serve` runs it in the main thread, which is faster).
    faults: a hook that fails engine steps on purpose (server/faults.py), for tests.
    tracing: OpenTelemetry spans of every request (server/tracing.py; None: off, at no cost).
    metrics_text: what /metrics answers (default: this app's own metrics); a Ray replica
    answers every replica's (ray_serve.py).
    """
    config = replace(config or ServerConfig(), **settings)
    if config.kv_cache_gb is not None:
        config = replace(
            config, max_batch_size=batch_size_for_budget(engine, config.max_batch_size, config.kv_cache_gb)
        )
    metrics = ServerMetrics(config.served_name)
    worker = EngineWorker(engine, metrics, config, faults)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if start_worker:
            worker.start()
        yield
        await asyncio.to_thread(worker.stop)
        if tracing is not None:
            await asyncio.to_thread(tracing.flush)

    keyed = config.api_key is not None
    # with a key, FastAPI's own /openapi.json, /docs and /redoc are off; the schema is served below, keyed
    pages: _Pages = dict(openapi_url=None, docs_url=None, redoc_url=None) if keyed else {}
    app = FastAPI(title="specdecode", lifespan=lifespan, **pages)
    app.state.server = ServerState(engine, worker, metrics, config, tracing)
    app.state.worker, app.state.metrics = worker, metrics
    install_error_handlers(app, metrics)

    def body_too_large(size: str) -> JSONResponse:
        message = f"the request body has {size}; the limit is {config.max_body_bytes} bytes"
        return closing(error_response(APIError(413, message, code="body_too_large"), metrics))

    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, refuse=body_too_large)
    if config.api_key is not None:  # added last: outermost, so it runs before any body is read
        open_paths = frozenset({"/health"} | ({"/metrics"} if config.metrics_without_key else set()))
        refuse = lambda: closing(error_response(unauthorized(), metrics))  # noqa: E731
        app.add_middleware(KeyCheck, api_key=config.api_key, open_paths=open_paths, refuse=refuse)
    app.include_router(v1)
    if tracing is not None:
        tracing.instrument(app)

    @app.get("/health")
    async def health() -> PlainTextResponse:
        # 503 once the engine thread has died: a supervisor should restart the server
        if worker.alive:
            return PlainTextResponse("ok")
        return PlainTextResponse("engine thread stopped", status_code=503, headers=retry_after(503))

    async def own_metrics() -> bytes:
        return generate_latest(metrics.registry)

    @app.get("/metrics")
    async def prometheus_metrics() -> PlainTextResponse:
        return PlainTextResponse(await (metrics_text or own_metrics)(), media_type=CONTENT_TYPE_LATEST)

    if keyed:

        @app.get("/openapi.json", include_in_schema=False)  # behind KeyCheck
        async def openapi() -> JSONResponse:
            return JSONResponse(app.openapi())

    return app


def app_from_config(
    config: ServerConfig,
    engine: SpeculativeEngine | None = None,
    *,
    start_worker: bool = True,
    faults: StepHook | None = None,
    metrics_text: Callable[[], Awaitable[bytes]] | None = None,
) -> FastAPI:
    """The app `serve`, each Ray replica and `batch` build: over `engine` (default: one loaded
    here from the config), traced as the OTEL_* variables and otel_console ask."""
    return create_app(
        engine if engine is not None else config.engine(),
        config,
        start_worker=start_worker,
        faults=faults,
        tracing=tracing_from_environment(config.otel_console),
        metrics_text=metrics_text,
    )


def tracing_from_environment(console: bool) -> Tracing | None:
    """OpenTelemetry tracing as the OTEL_* variables ask, and to the console when asked; None
    (off: the SDK is not even imported) when neither."""
    otel = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not console and not any(os.environ.get(name) for name in otel):
        return None
    from specdecode.server.tracing import from_environment

    return from_environment(console)


def batch_size_for_budget(engine: SpeculativeEngine, max_batch_size: int, kv_cache_gb: float) -> int:
    """The batch size whose KV caches fit in kv_cache_gb GiB when every sequence holds all of
    max_model_len: max_batch_size if it fits; fewer, logged, if not; and an error (the server
    does not start) if not even one sequence fits, since a full-length request could not run
    (kv_cache_gb is positive: ServerConfig checks it).

    A sequence's cache grows with it, to at most max_model_len positions of
    kv_bytes_per_token each (2 x layers x key/value heads x head dim x dtype size), and
    shrinks back when it ends (runners/slots.py), so this bounds the slots' caches. Not
    counted: the weights, activations, a draft model's cache, and the copy a cache briefly
    needs while it doubles."""
    per_token = kv_bytes_per_token(engine.target_runner)
    if per_token == 0:  # a recurrent state only: nothing grows with the sequence
        return max_batch_size
    per_sequence = engine.max_model_len * per_token
    budget = int(kv_cache_gb * 2**30)
    fits = budget // per_sequence
    if fits < 1:
        raise InvalidArgumentError(
            f"a KV-cache budget of {kv_cache_gb:g} GiB (--kv-cache-gb) is less than one sequence of max_model_len "
            f"{engine.max_model_len} tokens needs ({per_sequence} bytes, {per_token} per token); raise "
            "--kv-cache-gb or lower --max-model-len",
            "kv_cache_gb",
        )
    wanted = engine.batch_capacity(max_batch_size)
    if fits < wanted:
        logger.warning(
            "KV-cache budget of %g GiB holds %d sequences of max_model_len %d tokens (%d bytes per token): "
            "max_batch_size lowered from %d to %d",
            kv_cache_gb,
            fits,
            engine.max_model_len,
            per_token,
            wanted,
            fits,
        )
        return fits
    return max_batch_size


def run_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Serve app until SIGINT or SIGTERM: uvicorn in a thread, the engine loop in this one
    (the main thread: see EngineWorker.run). A first signal shuts down gracefully: no new
    requests, the ones held are finished. A second one exits at once: the requests still
    held are failed and the loop returns after its current step."""
    server = uvicorn.Server(uvicorn_config(app, app.state.server.config, host, port, log_level))
    http = threading.Thread(target=server.run, name="specdecode-http", daemon=True)

    def shut_down(signum, frame) -> None:
        if server.should_exit:  # the second signal
            server.force_exit = True
            app.state.worker.abort()
        server.should_exit = True

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, shut_down)
    http.start()
    while not server.started:
        if not http.is_alive():
            raise SpecDecodeError(f"could not serve on {host}:{port} (is the port in use?); choose another --port")
        time.sleep(0.05)
    app.state.worker.run()  # returns once the app's shutdown has stopped it, or abort()
    http.join(timeout=5)


def closing(response: JSONResponse) -> JSONResponse:
    """The response, and the connection closed after it: the rest of a refused request's body
    is not wanted, and its client holds no connection while it retries."""
    response.headers["connection"] = "close"
    return response
