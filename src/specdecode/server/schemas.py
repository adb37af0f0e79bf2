"""Request and response bodies in the shape of OpenAI's completions and chat APIs.

The models check types only; value ranges (max_tokens, temperature, ...) are checked by the
engine (and the few bounds of OpenAI's own by routes.py), so that a wrong type is a 422 and
a wrong value a 400 with the parameter named. A field this server does not implement is a
400 naming it, not silently ignored: unknown fields are refused, and OpenAI's fields that
would change the output (best_of, echo, suffix) are accepted only with the value that changes
nothing (see `_Request.unsupported`).
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
    min_p: float | None = None  # vLLM's
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's: token ids that end the answer as EOS does
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None  # the response's `speculative` holds the stats
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    user: str | None = None  # accepted and unused, as OpenAI uses it only for abuse monitoring
    logit_bias: dict[str, float] | None = None  # token id (a JSON key: a string) -> bias
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        """The first field given a value this server cannot honour, if any."""
        return next((name for name, no_op in NO_OP_VALUES.items() if getattr(self, name) not in no_op), None)

    def logprobs_asked(self) -> tuple[int | None, str]:
        """How many of the likeliest tokens to list beside each token's log-probability (None:
        no log-probabilities), and the field that asked."""
        raise NotImplementedError


class CompletionRequest(_Request):
    prompt: str | list[int]  # text, or token ids; one prompt per request for now
    logprobs: int | None = None  # the completions API's: how many of the likeliest tokens to list

    def logprobs_asked(self) -> tuple[int | None, str]:
        return self.logprobs, "logprobs"


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends and returns it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant's message of tool calls only
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, sent back with their results
    tool_call_id: str | None = None  # a tool message's: the call it answers
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class Function(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # the arguments always follow the schema here, strict or not


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins when both are given
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = None  # None: True, as OpenAI
    logprobs: bool | None = None  # the chat API's: whether to return log-probabilities ...
    top_logprobs: int | None = None  # ... and how many of the likeliest tokens to list

    def logprobs_asked(self) -> tuple[int | None, str]:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            return None, "logprobs"
        return self.top_logprobs or 0, "top_logprobs"


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # leading prompt tokens found in a slot's kept KV cache, not run again


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """The completions API's: per token, its text, log-probability, the likeliest tokens
    there (text -> log-probability) and where its text starts in the answer."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """The chat API's: one entry per token of the answer."""

    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


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
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: dict | list[dict] | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None  # a piece of the arguments' JSON text


class ToolCallDelta(BaseModel):
    """A piece of a streamed call: the first of a call names it (id, type, name), the others carry
    its arguments' text as it is written; a client joins them by index."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculative: dict | list[dict] | None = None


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
