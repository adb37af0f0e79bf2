"""Request and response bodies in the shape of OpenAI's completions and chat APIs.

The models check types only; value ranges (max_tokens, temperature, ...) are checked by the
engine (and the few bounds of OpenAI's own by routes.py), so that a wrong type is a 422 and
a wrong value a 400 with the parameter named. A field this server does not implement is a
400 naming it, not silently ignored: unknown fields are refused, and OpenAI's fields that
change the output (logit_bias, logprobs, penalties, ...) are accepted only with the value
that changes nothing (see `_Request.unsupported`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class SpeculativeOptions(BaseModel):
    """Ours: this request's speculation, within what the server loaded."""

    model_config = ConfigDict(extra="forbid")

    num_speculative_tokens: int | None = None  # most draft tokens per step; 0: target-only


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the answer always follows the schema here, strict or not


class ResponseFormat(BaseModel):
    """OpenAI's: plain text, any JSON object, or JSON of a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's extension (`extra_body={"structured_outputs": {...}}`): exactly one of these."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict | str | None = Field(default=None, alias="json")  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # a Lark grammar


# OpenAI (and vLLM) fields not implemented here, each with the value that leaves the output as it is
NO_OP_VALUES = {
    "logit_bias": (None, {}),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # None: OpenAI's default, 1.0
    top_p: float | None = None
    top_k: int | None = None  # not in OpenAI's API; vLLM accepts it too
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None  # the response's `speculative` holds the stats
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    user: str | None = None  # accepted and unused, as OpenAI uses it only for abuse monitoring
    logit_bias: dict | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        """The first field given a value this server cannot honour, if any."""
        return next((name for name, no_op in NO_OP_VALUES.items() if getattr(self, name) not in no_op), None)


class CompletionRequest(_Request):
    prompt: str | list[int]  # text, or token ids; one prompt per request for now


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins when both are given


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculative: dict | list[dict] | None = None  # ours: GenerationStats.to_dict() of the request (per choice if n > 1)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: dict | list[dict] | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculative: dict | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdecode"
    max_model_len: int  # vLLM reports it too: the context length, in tokens


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
