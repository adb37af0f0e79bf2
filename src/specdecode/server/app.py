"""The FastAPI app: OpenAI-style endpoints over one EngineWorker.

Handlers check the request, hand it to the worker and await its Future, so the event
loop stays free while the engine runs. Every failure is answered with OpenAI's error
object, {"error": {"message", "type", "param", "code"}}, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.engine import GenerationResult, SpeculativeEngine
from specdecode.errors import PromptTooLongError, SpecDecodeError
from specdecode.server import schemas
from specdecode.server.faults import StepHook
from specdecode.server.metrics import ServerMetrics
from specdecode.server.worker import (
    EngineWorker,
    GenerationRequest,
    QueueFullError,
    RequestHandle,
    RequestTimeoutError,
    ShuttingDownError,
)

MAX_STOP_STRINGS = 4  # as OpenAI allows
MAX_CHOICES = 8  # n, choices per request
DISCONNECT_POLL_S = 0.5
# the engine's argument names that the API spells differently
API_NAMES = {
    "max_new_tokens": "max_tokens",
    "num_speculative_tokens": "speculative.num_speculative_tokens",
}  # how often a waiting non-streaming request checks that its client is still there


class APIError(Exception):
    """An error answered as OpenAI's error object with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def create_app(
    engine: SpeculativeEngine,
    model_name: str = "specdecode",
    api_key: str | None = None,
    max_waiting: int = 64,
    max_body_bytes: int = 1 << 20,
    max_batch_size: int = 16,
    max_request_seconds: float = 600.0,
    faults: StepHook | None = None,
    start_worker: bool = True,
) -> FastAPI:
    """An app serving `engine` as `model_name`; requests to /v1 need `api_key` when one is set.

    max_waiting: requests queued beyond the running batch before new ones get 429.
    max_body_bytes: larger request bodies get 413 (by their Content-Length).
    max_batch_size: requests decoded together (continuous batching, batching.py).
    max_request_seconds: a request still running this long after it arrived fails with 504.
    faults: a hook that fails engine steps on purpose (server/faults.py), for tests.
    start_worker: False when the caller runs `app.state.worker.run()` in a thread of its own
    (`specdecode serve` runs it in the main thread, which is faster).
    """
    metrics = ServerMetrics()
    worker = EngineWorker(engine, metrics, max_waiting, max_batch_size, max_request_seconds, faults)
    created = int(time.time())
    context_length = engine.target_runner.max_length

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if start_worker:
            worker.start()
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="specdecode", lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics

    def error_response(error: APIError) -> JSONResponse:
        metrics.errors.labels(error.code or error.type).inc()
        body = schemas.ErrorResponse(error=_error_detail(error))
        return JSONResponse(body.model_dump(), status_code=error.status)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            reason = first.get("ctx", {}).get("error", first["msg"])
            return error_response(APIError(400, f"the body is not valid JSON: {reason}", code="json_invalid"))
        where = [str(part) for part in first["loc"] if part != "body"]
        # param names the top-level field; the message has the full path (union branches included)
        param = where[0] if where else None
        message = f"{'.'.join(where) or 'body'}: {first['msg']}"
        return error_response(APIError(422, message, param=param, code="invalid_type"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return error_response(APIError(error.status_code, str(error.detail), code=code))

    @app.exception_handler(Exception)
    async def _internal(_: Request, error: Exception) -> JSONResponse:
        return error_response(APIError(500, f"internal error: {error!r}", type="server_error", code="internal_error"))

    def body_too_large(size: str) -> JSONResponse:
        message = f"the request body has {size}; the limit is {max_body_bytes} bytes"
        return error_response(APIError(413, message, code="body_too_large"))

    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes, refuse=body_too_large)

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        # compare_digest: the time taken must not tell how much of the key was right
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            message = "missing or wrong API key: send 'Authorization: Bearer KEY'"
            raise APIError(401, message, type="authentication_error", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def list_models() -> schemas.ModelList:
        card = schemas.ModelCard(id=model_name, created=created, max_model_len=context_length)
        return schemas.ModelList(data=[card])

    @v1.post("/completions")
    async def completions(body: schemas.CompletionRequest, http: Request):
        if isinstance(body.prompt, str) and not body.prompt.strip() or body.prompt == []:
            raise APIError(400, "the prompt is empty; give some text to continue", param="prompt")
        max_tokens = body.max_tokens if body.max_tokens is not None else 16  # OpenAI's default
        handles = submit(_generation_requests(body, body.prompt, max_tokens))
        head = dict(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model_name)
        if body.stream:
            (handle,) = handles

            def chunk(text: str, reason: str | None = None) -> schemas.CompletionResponse:
                return schemas.CompletionResponse(
                    **head, choices=[schemas.CompletionChoice(text=text, finish_reason=reason)]
                )

            def tail(result: GenerationResult) -> list[BaseModel]:
                usage = schemas.CompletionResponse(
                    **head, choices=[], usage=_usage(result), speculative=result.stats.to_dict()
                )
                return [chunk("", result.finish_reason)] + ([usage] if _wants_usage(body) else [])

            return await stream(handle, http, "prompt", [], chunk, tail)
        results = await outcomes(handles, http, "prompt")
        choices = [
            schemas.CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason) for i, r in enumerate(results)
        ]
        return schemas.CompletionResponse(**head, choices=choices, usage=_usage(*results), speculative=_stats(results))

    @v1.post("/chat/completions")
    async def chat_completions(body: schemas.ChatCompletionRequest, http: Request):
        if not any(m.text().strip() for m in body.messages):
            raise APIError(400, "the messages are empty; give at least one with text", param="messages")
        prompt, templated = _chat_prompt(engine, body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        # no limit given: up to the end of the context, as OpenAI's chat API does
        max_tokens = max_tokens if max_tokens is not None else context_length
        handles = submit(_generation_requests(body, prompt, max_tokens, templated))
        head = dict(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model_name)
        if body.stream:
            (handle,) = handles

            def chunk(
                text: str | None, reason: str | None = None, role: str | None = None
            ) -> schemas.ChatCompletionChunk:
                choice = schemas.ChatChunkChoice(delta=schemas.Delta(role=role, content=text), finish_reason=reason)
                return schemas.ChatCompletionChunk(**head, choices=[choice])

            def tail(result: GenerationResult) -> list[BaseModel]:
                usage = schemas.ChatCompletionChunk(
                    **head, choices=[], usage=_usage(result), speculative=result.stats.to_dict()
                )
                return [chunk(None, result.finish_reason)] + ([usage] if _wants_usage(body) else [])

            # OpenAI opens a chat stream with the role
            return await stream(handle, http, "messages", [chunk("", role="assistant")], chunk, tail)
        results = await outcomes(handles, http, "messages")
        choices = [
            schemas.ChatChoice(index=i, message=schemas.AssistantMessage(content=r.text), finish_reason=r.finish_reason)
            for i, r in enumerate(results)
        ]
        return schemas.ChatCompletionResponse(
            **head, choices=choices, usage=_usage(*results), speculative=_stats(results)
        )

    def _generation_requests(
        body: schemas._Request, prompt: str | list[int], max_tokens: int, templated: bool = False
    ) -> list[GenerationRequest]:
        """Check the values the schema cannot (ranges, the model's name); the worker's requests,
        one per choice (n), choice i seeded seed + i when a seed is given."""
        if body.model != model_name:
            message = f"the model '{body.model}' does not exist; this server serves '{model_name}'"
            raise APIError(404, message, param="model", code="model_not_found")
        if not 1 <= body.n <= MAX_CHOICES:
            raise APIError(400, f"n must be in [1, {MAX_CHOICES}], got {body.n}", param="n")
        if body.n > 1 and body.stream:
            raise APIError(400, "n > 1 cannot be streamed yet; ask without stream, or for n = 1", param="n")
        if not 1 <= max_tokens <= context_length:
            message = f"max_tokens must be in [1, {context_length}] (the context length), got {max_tokens}"
            raise APIError(400, message, param="max_tokens")
        temperature = 1.0 if body.temperature is None else body.temperature
        if temperature > 2.0:  # OpenAI's bound; the engine checks the rest
            raise APIError(400, f"temperature must be in [0, 2], got {temperature}", param="temperature")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop takes at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
        top_k = None if body.top_k == -1 else body.top_k  # vLLM's "off"
        k = body.speculative.num_speculative_tokens if body.speculative is not None else None
        seeds = [None if body.seed is None else body.seed + i for i in range(body.n)]
        for seed in seeds:  # the engine's own checks, answered now rather than from the queue
            try:
                engine.settings(max_tokens, temperature, top_k, body.top_p, seed, stop or None, k)
            except SpecDecodeError as error:
                raise APIError(400, str(error), param=API_NAMES.get(error.param, error.param)) from None
        return [
            GenerationRequest(
                prompt,
                max_tokens,
                temperature,
                body.top_p,
                top_k,
                seed,
                stop,
                num_speculative_tokens=k,
                templated=templated,
                stream=body.stream,
            )
            for seed in seeds
        ]

    def submit(requests: list[GenerationRequest]) -> list[RequestHandle]:
        """Queue every choice's request, or none of them."""
        handles = []
        try:
            for request in requests:
                handles.append(worker.submit(request))
        except (QueueFullError, ShuttingDownError) as error:
            for handle in handles:
                handle.cancel()
            if isinstance(error, QueueFullError):
                raise APIError(429, str(error), type="rate_limit_error", code="queue_full") from None
            raise APIError(503, str(error), type="server_error", code="shutting_down") from None
        return handles

    async def outcomes(handles: list[RequestHandle], http: Request, prompt_param: str) -> list[GenerationResult]:
        try:
            return await asyncio.gather(*(outcome(h, http, prompt_param) for h in handles))
        finally:
            for handle in handles:  # one choice failed: the others are not wanted any more
                handle.cancel()

    async def unless_client_leaves(awaitable, handle: RequestHandle, http: Request):
        """Await awaitable; if the client disconnects meanwhile, free the request's place and give up."""
        task = asyncio.ensure_future(awaitable)
        while not task.done():
            await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
            if not task.done() and await http.is_disconnected():
                handle.cancel()
                task.cancel()
                raise APIError(499, "the client closed the request", code="client_disconnected")
        return task.result()

    async def outcome(handle: RequestHandle, http: Request, prompt_param: str) -> GenerationResult:
        waiter = asyncio.wrap_future(handle.future)
        try:
            return await unless_client_leaves(waiter, handle, http)
        except asyncio.CancelledError:  # the worker dropped it: the client had gone
            raise APIError(499, "the client closed the request", code="client_disconnected") from None
        except APIError:
            raise
        except Exception as error:  # noqa: BLE001 - what failed the request in the engine
            raise _engine_error(error, prompt_param) from None

    async def stream(
        handle: RequestHandle,
        http: Request,
        prompt_param: str,
        opening: list[BaseModel],
        chunk: Callable[[str], BaseModel],
        tail: Callable[[GenerationResult], list[BaseModel]],
    ) -> StreamingResponse:
        """Server-sent events: the opening chunks, one chunk per piece of new text, the tail
        (finish reason, usage), then [DONE]. An error before the first text is an ordinary
        error response; one after it is an error event, as OpenAI sends."""
        deltas = handle.text_deltas()
        first = await unless_client_leaves(anext(deltas, None), handle, http)  # through the queue and the prefill
        if first is None and handle.future.exception() is not None:
            raise _engine_error(handle.future.exception(), prompt_param)

        async def events() -> AsyncIterator[str]:
            try:
                for event in opening:
                    yield _event(event)
                if first is not None:
                    yield _event(chunk(first))
                    async for delta in deltas:
                        yield _event(chunk(delta))
                error = handle.future.exception()
                if error is None:
                    for event in tail(handle.future.result()):
                        yield _event(event)
                else:
                    api_error = _engine_error(error, prompt_param)
                    metrics.errors.labels(api_error.code or api_error.type).inc()
                    yield f"data: {json.dumps({'error': _error_detail(api_error).model_dump()})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                handle.cancel()  # the client may have gone mid-stream; a finished request ignores it

        return StreamingResponse(events(), media_type="text/event-stream")

    app.include_router(v1)

    @app.get("/health")
    async def health() -> PlainTextResponse:
        # 503 once the engine thread has died: a supervisor should restart the server
        alive = worker.alive
        return PlainTextResponse("ok" if alive else "engine thread stopped", status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def run_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> None:
    """Serve app until SIGINT or SIGTERM: uvicorn in a thread, the engine loop in this one
    (the main thread: see EngineWorker.run). A signal shuts down gracefully: no new
    requests, the ones held are finished; a second one exits at once."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    http = threading.Thread(target=server.run, name="specdecode-http", daemon=True)

    def shut_down(signum, frame) -> None:
        server.force_exit = server.should_exit
        server.should_exit = True

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, shut_down)
    http.start()
    while not server.started:
        if not http.is_alive():
            raise SpecDecodeError(f"could not serve on {host}:{port} (is the port in use?); choose another --port")
        time.sleep(0.05)
    app.state.worker.run()  # returns once the app's shutdown has stopped it
    http.join()


class _BodyLimit:
    """Refuses bodies over max_bytes before the app reads them: by their Content-Length, or,
    for a chunked body, by reading it here up to the limit and handing it on. Pure ASGI:
    FastAPI's @app.middleware wrapper would hide client disconnects from the handlers."""

    def __init__(self, app, max_bytes: int, refuse: Callable[[str], JSONResponse]):
        self.app, self.max_bytes, self.refuse = app, max_bytes, refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                await self.refuse(f"{int(length)} bytes")(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before it finished sending
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self.refuse(f"more than {self.max_bytes} bytes")(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()  # from here on: the disconnect, when it comes
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def _chat_prompt(engine: SpeculativeEngine, messages: list[schemas.ChatMessage]) -> tuple[str, bool]:
    """The prompt text, and whether it is a rendered chat template (with its special tokens)."""
    tokenizer = engine.tokenizer
    if getattr(tokenizer, "chat_template", None):
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            return tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False), True
        except Exception as error:  # templates raise on what they do not accept (roles out of order, ...)
            raise APIError(400, f"the model's chat template refused the messages: {error}", param="messages") from None
    # a base model without a template: its contents, one message a line, to be continued
    return "\n".join(m.text() for m in messages), False


def _usage(*results: GenerationResult) -> schemas.Usage:
    prompt, completion = len(results[0].prompt_token_ids), sum(len(r.token_ids) for r in results)
    return schemas.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _stats(results: list[GenerationResult]) -> dict | list[dict]:
    """Our speculative stats: the request's, or one per choice when n > 1."""
    return results[0].stats.to_dict() if len(results) == 1 else [r.stats.to_dict() for r in results]


def _wants_usage(body: schemas._Request) -> bool:
    """A stream ends with a chunk of usage (and our stats) only when the client asks for it."""
    return body.stream_options is not None and body.stream_options.include_usage


def _event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def _error_detail(error: APIError) -> schemas.ErrorDetail:
    return schemas.ErrorDetail(message=error.message, type=error.type, param=error.param, code=error.code)


def _engine_error(error: BaseException, prompt_param: str) -> APIError:
    """The OpenAI-style error for what failed a request in the engine."""
    if isinstance(error, PromptTooLongError):
        return APIError(400, str(error), param=prompt_param, code="context_length_exceeded")
    if isinstance(error, SpecDecodeError):
        return APIError(400, str(error), param=API_NAMES.get(error.param, error.param))
    if isinstance(error, RequestTimeoutError):
        return APIError(504, str(error), type="timeout_error", code="request_timeout")
    return APIError(500, f"the engine failed on this request: {error!r}", type="server_error", code="engine_failure")
