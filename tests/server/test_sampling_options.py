"""The rest of OpenAI's sampling API through the real server and the official `openai` client:
logprobs (chat and completions, streamed or not), logit_bias, the penalties, vLLM's min_p and
stop_token_ids, each answered as the engine answers the same options, with drafts kept; a bad
value is a 400 naming its parameter, and the server goes on."""

from __future__ import annotations

import math

import httpx
import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode

from helpers import byte_llama, byte_tokenizer, openai_client, serving
from specdecode import SpeculativeEngine
from specdecode.drafters import ModelDrafter
from specdecode.runners import HFModelRunner
from specdecode.server import create_app
from specdecode.server.logprobs import TokenTexts

MODEL = "tiny-bytes"
PROMPT = "the cat sat on the mat. the cat sat on the"
TOKENIZER = byte_tokenizer()


def engine() -> SpeculativeEngine:
    target, tokenizer = byte_llama(seed=2)
    return SpeculativeEngine(target, tokenizer, ModelDrafter(HFModelRunner(target)), num_speculative_tokens=4)


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


def tid(char: str) -> int:
    (token,) = TOKENIZER(char).input_ids
    return token


def byte_of(token: int) -> int:
    """The byte byte_tokenizer's token stands for (its text is U+FFFD where it begins a character)."""
    return BYTE_DECODER[TOKENIZER.convert_ids_to_tokens(token)]


BYTE_DECODER = {char: byte for byte, char in bytes_to_unicode().items()}


def test_a_tokens_bytes_are_its_own_where_its_text_is_part_of_a_character(reference):
    texts = TokenTexts(reference)
    first, second = "é".encode()  # two tokens of one byte each
    for byte in (first, second):
        (token,) = [t for t in range(256) if byte_of(t) == byte]
        assert texts.text(token) == "\ufffd" and texts.bytes(token) == bytes([byte])
    assert texts.bytes(tid("a")) == b"a" and texts.bytes(TOKENIZER.eos_token_id) == b"<eos>"


def test_chat_logprobs_are_the_engines(client, reference):
    expected = reference.generate(PROMPT, max_new_tokens=16, logprobs=3)[0]
    messages = [{"role": "user", "content": PROMPT}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = response.choices[0]
    assert choice.message.content == expected.text
    content = choice.logprobs.content
    assert len(content) == len(expected.token_ids)
    for entry, ours in zip(content, expected.logprobs, strict=True):
        assert entry.token == TOKENIZER.decode([ours.token]) and entry.bytes == [byte_of(ours.token)]
        assert math.isclose(entry.logprob, ours.logprob, abs_tol=1e-5)
        assert [t.token for t in entry.top_logprobs] == [TOKENIZER.decode([t]) for t, _ in ours.top]
    assert response.model_extra["speculative"]["accepted_tokens"] > 0  # drafts were verified and kept
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None  # only when asked


def test_streamed_chat_logprobs_add_up_to_the_answers(client):
    messages = [{"role": "user", "content": PROMPT}]
    asked = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**asked).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(**asked, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]


def test_completion_logprobs_in_the_completions_shape(client, reference):
    expected = reference.generate(PROMPT, max_new_tokens=12, logprobs=2)[0]
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2).choices[0]
    scores = choice.logprobs
    assert choice.text == expected.text
    assert scores.tokens == [TOKENIZER.decode([t]) for t in expected.token_ids]  # a byte's token: U+FFFD
    assert scores.text_offset == [sum(len(t) for t in scores.tokens[:i]) for i in range(len(scores.tokens))]
    for logprob, top, ours in zip(scores.token_logprobs, scores.top_logprobs, expected.logprobs, strict=True):
        assert math.isclose(logprob, ours.logprob, abs_tol=1e-5)
        # text -> log-probability: tokens of the same text (U+FFFD) share one key
        assert {TOKENIZER.decode([t]) for t, _ in ours.top} == set(top)
    streamed_tokens = []
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed_tokens += chunk.choices[0].logprobs.tokens
    assert streamed_tokens == scores.tokens


OPTIONS = {
    "penalties": dict(presence_penalty=1.2, frequency_penalty=0.7),
    "repetition": dict(extra_body={"repetition_penalty": 1.4}),
    "logit_bias": dict(logit_bias={str(tid(" ")): 4.0, str(tid("t")): -100}),
    "min_p": dict(temperature=0.8, seed=5, extra_body={"min_p": 0.2}),
}
ENGINE_OPTIONS = {
    "penalties": dict(presence_penalty=1.2, frequency_penalty=0.7),
    "repetition": dict(repetition_penalty=1.4),
    "logit_bias": dict(logit_bias={tid(" "): 4.0, tid("t"): -100}),
    "min_p": dict(temperature=0.8, seed=5, min_p=0.2),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_options_answer_as_the_engine_does(client, reference, name):
    options = {"temperature": 0} | OPTIONS[name]
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, **options)
    expected = reference.generate(PROMPT, max_new_tokens=24, **ENGINE_OPTIONS[name])[0]
    assert response.choices[0].text == expected.text
    if name != "min_p":
        assert expected.text != reference.generate(PROMPT, max_new_tokens=24)[0].text  # the option mattered


def test_stop_token_ids_end_the_answer(client, reference):
    plain = reference.generate(PROMPT, max_new_tokens=24)[0]
    stop = plain.token_ids[4]
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"stop_token_ids": [stop]}
    )
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == plain.token_ids.index(stop) + 1


BAD = [
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 2}, "min_p"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
]


@pytest.mark.parametrize("fields, param", BAD)
def test_bad_values_are_400s_naming_the_parameter(url, fields, param):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2} | fields
    response = httpx.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_bad_chat_logprobs_are_400s_naming_the_parameter(url, client):
    messages = [{"role": "user", "content": PROMPT}]
    for fields, param in [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ]:
        body = {"model": MODEL, "messages": messages, "max_tokens": 2} | fields
        response = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).choices[0].message
