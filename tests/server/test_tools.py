"""Tool calls through the real server and the official `openai` client (server/tools.py): a named
function or "required" makes calls whose arguments follow the function's schema, exactly as the
engine answers the same grammar, streamed or not; "auto" reads Hermes-format calls from the
answer; tool results come back as `role: tool` messages; bad tool requests are 400s naming the
field, and the server goes on."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest

from helpers import byte_llama, byte_tokenizer, openai_client, serving
from specdecode import SpeculativeEngine
from specdecode.drafters import PromptLookupDrafter
from specdecode.server import create_app, schemas, tools

MODEL = "tiny-bytes"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]},
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def engine() -> SpeculativeEngine:  # one token a byte: a context for the tools' listing
    return SpeculativeEngine(*byte_llama(max_positions=2048), PromptLookupDrafter(), num_speculative_tokens=4)


@pytest.fixture(scope="module")
def reference():
    return engine()


@pytest.fixture(scope="module")
def url():
    with serving(create_app(engine(), model_name=MODEL)) as base:
        yield base


@pytest.fixture
def client(url):
    return openai_client(url)


def follows_weather(arguments: str) -> bool:
    value = json.loads(arguments)
    return set(value) == {"city", "unit"} and value["unit"] in ("c", "f") and len(value["city"]) <= 8


def test_a_named_function_is_called_with_arguments_of_its_schema(client, reference):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=120, temperature=0
    )
    answer = response.choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    (call,) = answer.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert follows_weather(call.function.arguments)
    assert response.model_extra["speculative"]["forced_accepted"] > 0  # keys, quotes, braces drafted free
    # the engine's own answer under the same grammar, on the same prompt
    body = schemas.ChatCompletionRequest(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice)
    conversation, _ = tools.conversation(body, None)
    prompt = "\n".join(m["content"] for m in conversation)
    expected = reference.generate(prompt, max_new_tokens=120, constraint=tools.constraint(body, "get_weather"))[0]
    assert tools.calls_in(expected.text, body)[1][0].function.arguments == call.function.arguments


def test_required_calls_are_of_the_tools(client):
    asked = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200)
    whole = client.chat.completions.create(**asked, temperature=0).choices[0]
    assert whole.finish_reason in ("tool_calls", "length") and whole.message.tool_calls
    for call in whole.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        assert call.function.name != "get_weather" or follows_weather(call.function.arguments)
    single = client.chat.completions.create(**asked, temperature=0.9, seed=1, parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1


def test_required_calls_stream_as_they_answer_whole(client):
    asked = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=200)
    asked |= dict(parallel_tool_calls=False)  # one call, bounded by its schema: the answer ends
    whole = client.chat.completions.create(**asked, temperature=0).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    pieces, reason = [], None
    for chunk in client.chat.completions.create(**asked, temperature=0, stream=True):
        for choice in chunk.choices:
            pieces += choice.delta.tool_calls or []
            reason = choice.finish_reason or reason
    assert reason == "tool_calls"
    assert joined(pieces) == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    # each call opens with its id and name, then its arguments come as they are written
    assert max(Counter(p.index for p in pieces).values()) > 2


def joined(pieces) -> list[tuple[str, str]]:
    """A stream's tool-call pieces joined by index, as a client joins them: (name, arguments)."""
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        if piece.index not in calls:  # a call's first piece names it
            assert piece.id.startswith("call_") and piece.type == "function" and piece.function.name
            calls[piece.index] = [piece.function.name, ""]
        else:
            assert piece.id is None and piece.function.name is None
        calls[piece.index][1] += piece.function.arguments or ""
    assert list(calls) == list(range(len(calls)))
    return [(name, arguments) for name, arguments in calls.values()]


CALLS = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "O\\"s}lo", "unit": "c"}}</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, len(CALLS)])
def test_calls_stream_in_pieces_that_join_into_the_calls_of_the_whole_answer(size):
    body = schemas.ChatCompletionRequest(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME])
    stream, pieces = tools.CallStream(), []
    for start in range(0, len(CALLS), size):
        pieces += stream.release(CALLS[start : start + size])
    whole = tools.calls_in(CALLS, body)[1]
    assert joined(pieces) == [(c.function.name, c.function.arguments) for c in whole]
    assert json.loads(whole[0].function.arguments) == {"city": 'O"s}lo', "unit": "c"}  # a quote, a brace: text
    assert stream.calls == 2


def test_auto_and_none_answer_text_when_the_model_writes_no_call(client):
    for choice in ("auto", "none"):
        response = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice=choice, max_tokens=8, temperature=0
        )
        assert response.choices[0].message.tool_calls is None and response.choices[0].message.content is not None


def test_auto_streams_text_as_it_comes(client):
    asked = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**asked).choices[0].message.content
    pieces = [
        c.choices[0].delta.content
        for c in client.chat.completions.create(**asked, stream=True)
        if c.choices and c.choices[0].delta.content
    ]
    assert "".join(pieces) == whole and len(pieces) > 1  # not held to the end


def test_a_stream_holds_what_may_begin_a_call():
    holdback = tools.CallHoldback()
    assert holdback.release("Sure. <tool") == "Sure. " and holdback.held == "<tool"
    assert holdback.release("box") == "<toolbox"  # not a call after all
    assert holdback.release('<tool_call>{"name"') == "" and holdback.calling
    assert holdback.release(': "f"}</tool_call> more') == ""
    assert holdback.held == '<tool_call>{"name": "f"}</tool_call> more'


def test_calls_are_read_from_hermes_blocks():
    body = schemas.ChatCompletionRequest(model=MODEL, messages=MESSAGES, tools=[WEATHER])
    text = 'Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>'
    content, calls = tools.calls_in(text, body)
    assert content == "Let me look." and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo", "unit": "c"}
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert tools.calls_in(unknown, body) == (unknown, [])  # not a known function: text
    assert tools.calls_in("<tool_call>{not json</tool_call>", body)[1] == []


def test_tool_results_come_back_as_tool_messages(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=4)
    assert response.choices[0].message is not None
    body = schemas.ChatCompletionRequest(model=MODEL, messages=messages, tools=[WEATHER])
    conversation, native = tools.conversation(body, None)
    assert native is None and "get_weather" in conversation[0]["content"]  # the tools, listed for the model
    assert '"city": "Oslo"' in conversation[2]["content"] and conversation[3]["content"] == "sunny, 21 C"


def test_a_template_that_renders_tools_gets_them():
    template = (
        "{% for t in tools %}{{ t.function.name }};{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = template
    body = schemas.ChatCompletionRequest(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME])
    conversation, functions = tools.conversation(body, template)
    assert [f["function"]["name"] for f in functions] == ["get_weather", "get_time"]
    assert conversation == MESSAGES
    rendered = tokenizer.apply_chat_template(conversation, tools=functions, tokenize=False)
    assert rendered.startswith("get_weather;get_time;")


BAD = [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER] * 129}, "tools"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
            "tool_choice": "required",
        },
        "tools",
    ),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
]


@pytest.mark.parametrize("fields, param", BAD)
def test_bad_tool_requests_are_400s_naming_the_field(url, client, fields, param):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4} | fields
    response = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices[0].message
