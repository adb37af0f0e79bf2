"""The OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions.

Each handler checks the request (the engine's own checks, run here so that a bad value is
answered at once), hands one request per choice to the worker and awaits the results.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from pydantic import BaseModel

from specdecode.core.adjustments import Adjustments
from specdecode.core.checks import seeds_for
from specdecode.core.constraints import Constraint
from specdecode.core.logprobs import TokenLogprob
from specdecode.engine import GenerationResult, SpeculativeEngine
from specdecode.errors import SpecDecodeError
from specdecode.server import schemas, tools
from specdecode.server.config import ServerConfig
from specdecode.server.errors import API_NAMES, APIError
from specdecode.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from specdecode.server.metrics import ServerMetrics
from specdecode.server.streaming import outcomes, stream
from specdecode.server.worker import (
    EngineWorker,
    GenerationRequest,
    QueueFullError,
    RequestHandle,
    ShuttingDownError,
)

if TYPE_CHECKING:
    from specdecode.server.tracing import Tracing

MAX_CHOICES = 8  # n, choices per request
MAX_TEMPERATURE = 2.0  # OpenAI's bound


@dataclass
class ServerState:
    """What the handlers share: `app.state.server`."""

    engine: SpeculativeEngine
    worker: EngineWorker
    metrics: ServerMetrics
    config: ServerConfig
    tracing: Tracing | None = None  # OpenTelemetry spans (tracing.py); None: off
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.config.served_name

    @property
    def context_length(self) -> int:
        """max_model_len: the most tokens, prompt and completion, a request may hold."""
        return self.engine.max_model_len


def _state(request: Request) -> ServerState:
    return request.app.state.server


v1 = APIRouter(prefix="/v1")  # behind limits.KeyCheck where the server has a key


@v1.get("/models")
async def list_models(http: Request) -> schemas.ModelList:
    state = _state(http)
    card = schemas.ModelCard(id=state.model_name, created=state.created, max_model_len=state.context_length)
    return schemas.ModelList(data=[card])


@v1.post("/completions")
async def completions(body: schemas.CompletionRequest, http: Request):
    state = _state(http)
    if isinstance(body.prompt, str) and not body.prompt.strip() or body.prompt == []:
        raise APIError(400, "the prompt is empty; give some text to continue", param="prompt")
    max_tokens = body.max_tokens if body.max_tokens is not None else 16  # OpenAI's default
    handles = _submit(state, _generation_requests(state, body, body.prompt, max_tokens))
    head = dict(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=state.model_name)
    text = TokenTexts(state.engine).text
    if body.stream:
        offsets = [0] * body.n  # where each choice's next chunk starts in its answer

        def chunk(delta: str, reason: str | None = None, index: int = 0, logprobs: list[TokenLogprob] | None = None):
            scores = None
            if body.logprobs is not None and reason is None:
                scores = completion_logprobs(logprobs or [], text, offsets[index])
            offsets[index] += len(delta)
            choice = schemas.CompletionChoice(index=index, text=delta, finish_reason=reason, logprobs=scores)
            return schemas.CompletionResponse(**head, choices=[choice])

        def tail(results: list[GenerationResult]) -> list[BaseModel]:
            usage = schemas.CompletionResponse(**head, choices=[], usage=_usage(*results), speculative=_stats(results))
            ends = [chunk("", r.finish_reason, index=i) for i, r in enumerate(results)]
            return ends + ([usage] if _wants_usage(body) else [])

        return await stream(handles, http, state.metrics, "prompt", [], chunk, tail)
    results = await outcomes(handles, http, "prompt")
    choices = [
        schemas.CompletionChoice(
            index=i,
            text=r.text,
            finish_reason=r.finish_reason,
            logprobs=completion_logprobs(r.logprobs, text) if r.logprobs is not None else None,
        )
        for i, r in enumerate(results)
    ]
    return schemas.CompletionResponse(**head, choices=choices, usage=_usage(*results), speculative=_stats(results))


@v1.post("/chat/completions")
async def chat_completions(body: schemas.ChatCompletionRequest, http: Request):
    state = _state(http)
    if not any(m.text().strip() or m.tool_calls for m in body.messages):
        raise APIError(400, "the messages are empty; give at least one with text", param="messages")
    tool_choice = tools.choice_of(body)
    conversation, prompt, templated = _chat_prompt(state.engine, body)
    # None (no limit given): up to the end of the context, as OpenAI's chat API does
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    calls = tools.constraint(body, tool_choice)
    requests = _generation_requests(state, body, prompt, max_tokens, templated, conversation, calls)
    handles = _submit(state, requests)
    answer = _ChatAnswer(body, tool_choice, TokenTexts(state.engine), state.model_name)
    if body.stream:
        # OpenAI opens a chat stream with the role, each choice's
        opening = [answer.chunk("", role="assistant", index=i) for i in range(body.n)]
        return await stream(handles, http, state.metrics, "messages", opening, answer.chunk, answer.tail)
    results = await outcomes(handles, http, "messages")
    return schemas.ChatCompletionResponse(
        **answer.head,
        choices=[answer.choice(i, r) for i, r in enumerate(results)],
        usage=_usage(*results),
        speculative=_stats(results),
    )


class _ChatAnswer:
    """A chat request's answer, whole or as chunks. With tools that may be called ("auto"), a
    stream sends its text as it comes until a call may begin; the rest is held until the end,
    when the answer is read for calls. Where the answer is calls by its grammar ("required", a
    named function), a stream sends each call as it is written (tools.py)."""

    def __init__(self, body: schemas.ChatCompletionRequest, tool_choice: str | None, texts: TokenTexts, model: str):
        self.body, self.texts = body, texts
        self.reads_calls = tool_choice not in (None, "none")
        self.streams_calls = tool_choice not in (None, "none", "auto")
        self.head = dict(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model)
        self.holdbacks = [tools.CallHoldback() for _ in range(body.n)]  # each choice's, with tools
        self.call_streams = [tools.CallStream() for _ in range(body.n)]
        self.held_logprobs: list[list[TokenLogprob]] = [[] for _ in range(body.n)]

    def message(self, result: GenerationResult) -> tuple[schemas.AssistantMessage, str]:
        """The assistant's message and the finish reason ("tool_calls" where it calls)."""
        if not self.reads_calls:
            return schemas.AssistantMessage(content=result.text), result.finish_reason
        content, calls = tools.calls_in(result.text or "", self.body)
        if not calls:
            return schemas.AssistantMessage(content=result.text), result.finish_reason
        # an answer cut short (max_tokens) says so, as OpenAI's does, whatever calls it finished
        reason = "tool_calls" if result.finish_reason == "stop" else result.finish_reason
        return schemas.AssistantMessage(content=content, tool_calls=calls), reason

    def choice(self, index: int, result: GenerationResult) -> schemas.ChatChoice:
        message, reason = self.message(result)
        return schemas.ChatChoice(
            index=index, message=message, finish_reason=reason, logprobs=self._logprobs(result.logprobs)
        )

    def chunk(
        self,
        delta: str | None,
        reason: str | None = None,
        role: str | None = None,
        index: int = 0,
        logprobs: list[TokenLogprob] | None = None,
    ) -> schemas.ChatCompletionChunk | None:
        if self.reads_calls and delta and role is None:
            self.held_logprobs[index] += logprobs or []
            calls = self.call_streams[index].release(delta) if self.streams_calls else []
            delta = None if self.streams_calls else self.holdbacks[index].release(delta)
            if not delta and not calls:
                return None  # held: it may be, or is, a call
            logprobs, self.held_logprobs[index] = self.held_logprobs[index], []
            return self._chunk(schemas.Delta(content=delta, tool_calls=calls or None), reason, index, logprobs)
        return self._chunk(schemas.Delta(role=role, content=delta), reason, index, logprobs)

    def _chunk(
        self, delta: schemas.Delta, reason: str | None, index: int, logprobs: list[TokenLogprob] | None = None
    ) -> schemas.ChatCompletionChunk:
        choice = schemas.ChatChunkChoice(
            index=index, delta=delta, finish_reason=reason, logprobs=self._logprobs(logprobs)
        )
        return schemas.ChatCompletionChunk(**self.head, choices=[choice])

    def tail(self, results: list[GenerationResult]) -> list[BaseModel]:
        events = []
        for i, result in enumerate(results):
            reason = result.finish_reason
            if self.streams_calls:  # sent as they were written
                reason = self.message(result)[1]
            elif self.reads_calls:  # what was held: the calls, or text that is none
                message, reason = self.message(result)
                calls = [
                    schemas.ToolCallDelta(index=n, id=c.id, type=c.type, function=c.function.model_dump())
                    for n, c in enumerate(message.tool_calls or [])
                ]
                held = self.holdbacks[i].held if not calls else ""
                if held or calls:
                    delta = schemas.Delta(content=held or None, tool_calls=calls or None)
                    scores = self.held_logprobs[i] if result.logprobs is not None else None
                    events.append(self._chunk(delta, None, i, scores))
            events.append(self._chunk(schemas.Delta(), reason, i))
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            events.append(
                schemas.ChatCompletionChunk(
                    **self.head, choices=[], usage=_usage(*results), speculative=_stats(results)
                )
            )
        return events

    def _logprobs(self, entries: list[TokenLogprob] | None) -> schemas.ChoiceLogprobs | None:
        return chat_logprobs(entries, self.texts) if self.body.logprobs and entries is not None else None


def _generation_requests(
    state: ServerState,
    body: schemas._Request,
    prompt: str | list[int],
    max_tokens: int | None,
    templated: bool = False,
    messages: list[dict] | None = None,
    calls: Constraint | None = None,
) -> list[GenerationRequest]:
    """The worker's requests, one per choice (n), choice i seeded seed + i (seeds_for) when a seed is given;
    checked first: the model's name, OpenAI's own bounds, then the engine's checks. max_tokens
    None: up to the end of the context. Whether prompt + max_tokens fits in max_model_len is
    checked on the engine thread, which tokenizes the prompt (worker.py)."""
    if body.model != state.model_name:
        message = f"the model '{body.model}' does not exist; this server serves '{state.model_name}'"
        raise APIError(404, message, param="model", code="model_not_found")
    if (field_name := body.unsupported()) is not None:
        message = f"{field_name} is not supported by this server; leave it out (or at its default)"
        raise APIError(400, message, param=field_name, code="unsupported_parameter")
    if not 1 <= body.n <= MAX_CHOICES:
        raise APIError(400, f"n must be in [1, {MAX_CHOICES}], got {body.n}", param="n")
    if max_tokens is not None and not 1 <= max_tokens <= state.context_length:
        message = f"max_tokens must be in [1, {state.context_length}] (max_model_len), got {max_tokens}"
        raise APIError(400, message, param="max_tokens")
    temperature = 1.0 if body.temperature is None else body.temperature
    if temperature > MAX_TEMPERATURE:
        raise APIError(400, f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}", param="temperature")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    top_k = None if body.top_k == -1 else body.top_k  # vLLM's "off"
    k = body.speculative.num_speculative_tokens if body.speculative is not None else None
    constraint, constraint_param = _constraint(body)
    if calls is not None:  # the grammar of the calls tool_choice requires
        if constraint is not None:
            raise APIError(400, f"give {constraint_param} or a tool_choice that calls, not both", param="tool_choice")
        constraint, constraint_param = calls, "tools"
    logprobs, logprobs_param = _logprobs(body)
    names = API_NAMES | {"constraint": constraint_param, "logprobs": logprobs_param}
    try:
        adjustments = Adjustments.of(
            body.logit_bias,
            body.presence_penalty or 0.0,
            body.frequency_penalty or 0.0,
            1.0 if body.repetition_penalty is None else body.repetition_penalty,
        )
    except SpecDecodeError as error:
        raise APIError(400, str(error), param=error.param) from None
    options = dict(
        min_p=body.min_p, stop_token_ids=body.stop_token_ids or [], adjustments=adjustments, logprobs=logprobs
    )
    try:
        settings = [
            state.engine.settings(
                # the room the prompt leaves bounds it on the engine thread, which tokenizes it (worker.py)
                max_new_tokens=state.context_length if max_tokens is None else max_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=body.top_p,
                seed=seed,
                stop=stop or None,
                num_speculative_tokens=k,
                constraint=constraint,
                **options,
            )
            for seed in seeds_for(body.seed, body.n)
        ]
    except SpecDecodeError as error:
        raise APIError(400, str(error), param=names.get(error.param, error.param)) from None
    operation = "chat" if isinstance(body, schemas.ChatCompletionRequest) else "text_completion"
    return [
        GenerationRequest(prompt, max_tokens, each, templated, body.stream, operation, messages) for each in settings
    ]


def _logprobs(body: schemas._Request) -> tuple[int | None, str]:
    """How many of the likeliest tokens to list per token (None: no log-probabilities), and the
    parameter that says so."""
    try:
        return body.logprobs_asked()
    except ValueError as error:
        raise APIError(400, str(error), param="top_logprobs") from None


def _constraint(body: schemas._Request) -> tuple[Constraint | None, str]:
    """The grammar the answer must follow (OpenAI's response_format, or vLLM's structured_outputs),
    and the parameter that asked for it."""
    if body.response_format is not None and body.structured_outputs is not None:
        raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
    if body.structured_outputs is not None:
        asked = body.structured_outputs
        given = {
            name: value
            for name, value in (
                ("json", asked.json_),
                ("regex", asked.regex),
                ("choice", asked.choice),
                ("grammar", asked.grammar),
            )
            if value is not None
        }
        if len(given) != 1:
            message = "structured_outputs takes exactly one of json, regex, choice, grammar"
            raise APIError(400, message, param="structured_outputs")
        ((name, value),) = given.items()
        if name == "json":
            try:
                schema = json.loads(value) if isinstance(value, str) else value
            except ValueError as error:
                raise APIError(
                    400, f"structured_outputs.json is not JSON: {error}", param="structured_outputs.json"
                ) from None
            return Constraint.json_schema(schema), "structured_outputs.json"
        return _OTHER_CONSTRAINTS[name](value), f"structured_outputs.{name}"
    form = body.response_format
    if form is None or form.type == "text":
        return None, "response_format"
    if form.type == "json_object":
        return Constraint.json_object(), "response_format"
    if form.json_schema is None:
        raise APIError(400, "response_format json_schema needs its json_schema", param="response_format.json_schema")
    schema = form.json_schema.schema_
    return (
        Constraint.json_schema(schema) if schema is not None else Constraint.json_object()
    ), "response_format.json_schema"


_OTHER_CONSTRAINTS = {"regex": Constraint.regex, "choice": Constraint.choice, "grammar": Constraint.grammar}


def _submit(state: ServerState, requests: list[GenerationRequest]) -> list[RequestHandle]:
    """Queue every choice's request, or none of them."""
    handles = []
    try:
        for request in requests:
            trace = state.tracing.start(state.model_name) if state.tracing is not None else None
            handles.append(state.worker.submit(request, trace))
    except (QueueFullError, ShuttingDownError) as error:
        for handle in handles:
            handle.cancel()
        if isinstance(error, QueueFullError):
            raise APIError(429, str(error), type="rate_limit_error", code="queue_full") from None
        raise APIError(503, str(error), type="server_error", code="shutting_down") from None
    return handles


def _chat_prompt(engine: SpeculativeEngine, body: schemas.ChatCompletionRequest) -> tuple[list[dict], str, bool]:
    """The conversation as rendered (tools.py), the prompt text, and whether it is a rendered
    chat template (with its special tokens)."""
    tokenizer = engine.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    conversation, functions = tools.conversation(body, template)
    if template:
        try:
            return conversation, engine.chat_prompt(conversation, functions), True
        except SpecDecodeError as error:
            raise APIError(400, str(error), param=error.param) from None
    # a base model without a template: its contents, one message a line, to be continued
    return conversation, "\n".join(m["content"] for m in conversation), False


def _usage(*results: GenerationResult) -> schemas.Usage:
    prompt, completion = len(results[0].prompt_token_ids), sum(len(r.token_ids) for r in results)
    cached = min(r.stats.prompt_tokens_reused for r in results)  # what every choice found kept
    return schemas.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=schemas.PromptTokensDetails(cached_tokens=cached),
    )


def _stats(results: list[GenerationResult]) -> dict | list[dict]:
    """Our speculative stats: the request's, or one per choice when n > 1."""
    return results[0].stats.to_dict() if len(results) == 1 else [r.stats.to_dict() for r in results]


def _wants_usage(body: schemas._Request) -> bool:
    """A stream ends with a chunk of usage (and our stats) only when the client asks for it."""
    return body.stream_options is not None and body.stream_options.include_usage
