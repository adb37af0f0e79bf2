"""The OpenAI-compatible server, run for real with uvicorn on a local port and called with
the official `openai` client (and httpx for what that client cannot send)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from typer.testing import CliRunner

from helpers import SERVED_MODEL as MODEL
from helpers import SERVER_PROMPT as PROMPT
from helpers import metric, serving
from specdecode import SpeculativeEngine
from specdecode.cli import app as cli_app
from specdecode.engine import DrafterOptions
from specdecode.errors import InvalidArgumentError
from specdecode.runners.slots import kv_bytes_per_token
from specdecode.server import create_app


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """A second engine on the same folder, called directly: what the server must answer."""
    return SpeculativeEngine.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir)
    with serving(create_app(engine, model_name=MODEL)) as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_completion_equals_engine_generate(client, reference):
    expected = reference.generate(PROMPT, max_new_tokens=12, temperature=0)[0]
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = response.choices[0]
    assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    stats = response.model_extra["speculative"]
    assert stats["drafter"] == "auto" and stats["generated_tokens"] == len(expected.token_ids)


def test_completion_of_token_ids_and_stop(client, reference):
    ids = reference.encode(PROMPT)
    expected = reference.generate([ids], max_new_tokens=10, temperature=0)[0]
    assert (
        client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0).choices[0].text
        == expected.text
    )
    stop = expected.text.split()[2]  # a word the greedy output contains: the text ends before it
    cut = reference.generate(PROMPT, max_new_tokens=10, temperature=0, stop=[stop])[0]
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop])
    assert response.choices[0].text == cut.text and response.choices[0].finish_reason == "stop"
    assert stop not in response.choices[0].text


def test_streamed_completion_joins_to_the_same_text(client, reference):
    expected = reference.generate(PROMPT, max_new_tokens=12, temperature=0)[0]
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_without_template_joins_the_messages(client, reference):
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3 w1 w2"}]
    expected = reference.generate("w1 w2\nw3 w1 w2", max_new_tokens=10, temperature=0)[0]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_raw_stream_ends_with_done(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_fields_left_at_their_no_op_values_are_accepted(client, reference):
    """Clients that send OpenAI's defaults for unsupported fields are served as before."""
    extra = {"logprobs": None, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u1"}
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body=extra)
    assert response.choices[0].text == reference.generate(PROMPT, max_new_tokens=6, temperature=0)[0].text


def test_each_request_chooses_its_own_k(client, reference):
    """speculative.num_speculative_tokens: 0 drafts nothing, while a neighbour drafts; same text."""
    prompt = "w2 w1 w4 w2 w1 w4 w2 w1"
    expected = reference.generate(prompt, max_new_tokens=12, temperature=0)[0].text

    def ask(k):
        extra = {"speculative": {"num_speculative_tokens": k}}
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra)

    with ThreadPoolExecutor(2) as pool:
        off, on = pool.map(ask, [0, 4])
    assert off.choices[0].text == on.choices[0].text == expected
    assert off.model_extra["speculative"]["drafted_tokens"] == 0
    assert off.model_extra["speculative"]["num_speculative_tokens"] == 0
    assert on.model_extra["speculative"]["num_speculative_tokens"] == 4


def test_seeded_sampling_repeats(client):
    def ask():
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9, seed=7)

    assert ask().choices[0].text == ask().choices[0].text


def test_n_choices_are_sampled_together_each_as_it_would_be_alone(client):
    """Choice i of a seeded request is the single request seeded seed + i, though they ran batched."""
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0)
    response = client.completions.create(**ask, n=3, seed=7)
    assert [c.index for c in response.choices] == [0, 1, 2]
    alone = [client.completions.create(**ask, seed=7 + i).choices[0].text for i in range(3)]
    assert [c.text for c in response.choices] == alone
    assert response.usage.completion_tokens == sum(s["generated_tokens"] for s in response.model_extra["speculative"])
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=4, n=2
    )
    assert len(chat.choices) == 2 and chat.choices[1].index == 1


def test_n_choices_stream_each_as_it_would_be_alone(client):
    """Streamed, each choice's chunks carry its index and add up to its answer unstreamed."""
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, n=3, seed=11)
    whole = client.completions.create(**ask)
    texts, reasons = ["", "", ""], [None, None, None]
    for chunk in client.completions.create(**ask, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert texts == [c.text for c in whole.choices] and reasons == [c.finish_reason for c in whole.choices]
    messages = [{"role": "user", "content": PROMPT}]
    chat = dict(model=MODEL, messages=messages, max_tokens=6, temperature=1.0, n=2, seed=3)
    answers = ["", ""]
    for chunk in client.chat.completions.create(**chat, stream=True):
        for choice in chunk.choices:
            answers[choice.index] += choice.delta.content or ""
    assert answers == [c.message.content for c in client.chat.completions.create(**chat).choices]


def test_concurrent_clients_get_what_they_get_alone(client, reference):
    """Greedy requests batched with each other and with sampled ones (other temperature, top_p,
    seeds) return exactly the engine's single-request output."""
    prompts = ["w1 w2 w3", "w4 w5 w4 w5", "w9 w8 w7", "w2 w2 w2 w3", "w10 w11", "w3", "w5 w6 w5 w6 w5", "w7 w7"]
    expected = [reference.generate(p, max_new_tokens=8 + i, temperature=0)[0].text for i, p in enumerate(prompts)]

    def greedy(i: int) -> str:
        return (
            client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=8 + i, temperature=0).choices[0].text
        )

    def sampled(i: int) -> str:
        return (
            client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=10, temperature=0.8, top_p=0.9, seed=i)
            .choices[0]
            .text
        )

    with ThreadPoolExecutor(16) as pool:
        noise = [pool.submit(sampled, i) for i in range(len(prompts))]
        assert list(pool.map(greedy, range(len(prompts)))) == expected
        assert all(isinstance(n.result(), str) for n in noise)


def test_models_and_health(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].model_extra["max_model_len"] == 128
    health = httpx.get(f"{server}/health")
    assert health.status_code == 200 and health.text == "ok"


BAD_REQUESTS = [
    # (body, status, param): a JSON body the server must refuse, and how
    ({"model": MODEL, "prompt": "  "}, 400, "prompt"),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": 100_000}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": 124}, 400, "max_tokens"),  # 5 + 124 > the 128-token context
    ({"model": MODEL, "prompt": PROMPT, "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": PROMPT, "n": 9}, 400, "n"),
    ({"model": MODEL, "prompt": PROMPT, "stop": [""]}, 400, "stop"),
    ({"model": MODEL, "prompt": " ".join(["w1"] * 200)}, 400, "prompt"),  # over the 128-token context
    ({"model": MODEL, "prompt": [999]}, 400, "prompt"),  # a token id outside the vocabulary
    ({"model": MODEL, "prompt": PROMPT, "seed": 2**64}, 400, "seed"),  # past what a generator takes
    ({"model": MODEL, "prompt": PROMPT, "seed": 2**64 - 2, "n": 3}, 400, "seed"),  # choice 2's seed + 2 overflows
    (
        {"model": MODEL, "prompt": PROMPT, "speculative": {"num_speculative_tokens": -1}},
        400,
        "speculative.num_speculative_tokens",
    ),
    ({"model": MODEL, "prompt": PROMPT, "speculative": {"k": 2}}, 400, "speculative.k"),
    # what this server does not implement is refused by name, not silently ignored
    ({"model": MODEL, "prompt": PROMPT, "best_of": 2}, 400, "best_of"),
    ({"model": MODEL, "prompt": PROMPT, "echo": True}, 400, "echo"),
    ({"model": MODEL, "prompt": PROMPT, "suffix": "w1"}, 400, "suffix"),
    (
        {"model": MODEL, "prompt": PROMPT, "response_format": {"type": "json_schema"}},
        400,
        "response_format.json_schema",
    ),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": "many"}, 422, "max_tokens"),
    ({"model": MODEL, "prompt": {"text": PROMPT}}, 422, "prompt"),
    ({"model": MODEL}, 422, "prompt"),
    ({"model": "gpt-4", "prompt": PROMPT}, 404, "model"),
]


@pytest.mark.parametrize("body, status, param", BAD_REQUESTS)
def test_bad_completion_requests_get_openai_errors(server, body, status, param):
    response = httpx.post(f"{server}/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_bad_chat_requests_and_malformed_json(server, client):
    url = f"{server}/v1/chat/completions"
    malformed = httpx.post(
        url, content=b'{"model": "tiny", "messages": [', headers={"content-type": "application/json"}
    )
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "json_invalid"
    too_long = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": " ".join(["w1"] * 200)}]})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    wrong_role = httpx.post(url, json={"model": MODEL, "messages": [{"role": "robot", "content": "w1"}]})
    assert wrong_role.status_code == 422 and wrong_role.json()["error"]["param"].startswith("messages")
    empty = httpx.post(url, json={"model": MODEL, "messages": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"
    huge = httpx.post(url, content=b" " * (2 << 20), headers={"content-type": "application/json"})
    assert huge.status_code == 413
    chunked = httpx.post(url, content=iter([b" " * (1 << 19)] * 4), headers={"content-type": "application/json"})
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "body_too_large"
    small_chunked = iter([b'{"model": "tiny", "prompt": "w1 w2", ', b'"max_tokens": 2, "temperature": 0}'])
    headers = {"content-type": "application/json"}
    assert httpx.post(f"{server}/v1/completions", content=small_chunked, headers=headers).status_code == 200
    assert httpx.get(f"{server}/v1/nothing").json()["error"]["code"] == "not_found"
    with pytest.raises(openai.BadRequestError):  # the official client raises its own error type
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    # and the server still serves
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).choices[0].text


def test_metrics_count_requests_tokens_and_errors(tiny_model_dir):
    # k fixed: the shared server's adaptive k may have switched drafting off in earlier tests
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir, options=DrafterOptions(adaptive=False))
    with serving(create_app(engine, model_name=MODEL)) as server:
        client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
        check_metrics(server, client)


def check_metrics(server: str, client: openai.OpenAI) -> None:
    names = [
        "specdecode:num_requests_running",
        "specdecode:num_requests_waiting",
        "specdecode:generation_tokens_total",
        "specdecode:spec_decode_num_draft_tokens_total",
        "specdecode:spec_decode_num_accepted_tokens_total",
        "specdecode:time_to_first_token_seconds_count",
        "specdecode:time_per_output_token_seconds_count",
        "specdecode:e2e_request_latency_seconds_count",
        "specdecode:batch_size_count",
        "specdecode:spec_decode_draft_acceptance_rate",
        "specdecode:engine_step_retries_total",
        "specdecode:engine_worker_restarts_total",
    ]
    before = httpx.get(f"{server}/metrics").text
    assert all(name in before for name in names), before
    # an answer that repeats its own tokens, so that prompt lookup drafts after the prefill
    client.completions.create(model=MODEL, prompt="w2 w1 w4 w2 w1", max_tokens=12, temperature=0)
    httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0})
    after = httpx.get(f"{server}/metrics").text
    assert (
        metric(after, "specdecode:generation_tokens_total") >= metric(before, "specdecode:generation_tokens_total") + 1
    )
    latencies = "specdecode:e2e_request_latency_seconds_count"
    assert metric(after, latencies) == metric(before, latencies) + 1
    assert metric(after, "specdecode:num_requests_running") == 0
    assert metric(after, "specdecode:batch_size_count") > metric(before, "specdecode:batch_size_count")
    drafted = metric(after, "specdecode:spec_decode_num_draft_tokens_total")
    accepted = metric(after, "specdecode:spec_decode_num_accepted_tokens_total")
    assert drafted > 0
    assert metric(after, "specdecode:spec_decode_draft_acceptance_rate") == pytest.approx(accepted / drafted)
    per_position = re.findall(
        r'^specdecode:spec_decode_num_accepted_tokens_per_pos_total\{position="\d+"\} (\S+)$', after, re.M
    )
    assert per_position and sum(map(float, per_position)) == accepted
    errors = 'specdecode:request_errors_total{kind="invalid_request_error"}'
    assert metric(after, errors) == metric(before, errors) + 1


def test_api_key_is_enforced(tiny_model_dir):
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir)
    with serving(create_app(engine, model_name=MODEL, api_key="secret")) as url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        for headers in ({}, {"authorization": "secret"}, {"authorization": "Basic secret"}):
            refused = httpx.get(f"{url}/v1/models", headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="secret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].text is not None
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key


def test_serve_command_reports_a_missing_model():
    result = CliRunner().invoke(cli_app, ["serve", "--target", "/no/such/model"])
    assert result.exit_code == 2 and "error" in result.output


def test_chat_template_is_applied_when_the_tokenizer_has_one(tiny_model_dir, reference):
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir)
    # a toy template: each message's words, then w0 w0 to open the assistant's turn
    engine.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}w0 w0"
    messages = [
        {"role": "user", "content": "w3 w4"},
        {"role": "assistant", "content": "w5"},
        {"role": "user", "content": "w6"},
    ]
    expected = reference.generate("w3 w4 w5 w6 w0 w0", max_new_tokens=6, temperature=0)[0]
    with serving(create_app(engine, model_name=MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_requests_that_cannot_fit_max_model_len_get_400(tiny_model_dir):
    """Prompt + max_tokens over max_model_len is refused with the numbers (vLLM's behaviour),
    streamed or not, text or token ids; a chat request without max_tokens runs to the context's end."""
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir, max_model_len=32)
    ids = engine.encode(PROMPT)  # before serving: the engine is the worker thread's from then on
    assert len(ids) == 5
    # "w1 w2" meets no end-of-sequence token for 100 greedy tokens of the tiny model
    expected = engine.generate("w1 w2", max_new_tokens=30, temperature=0)[0]
    with serving(create_app(engine, model_name=MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert client.models.list().data[0].model_extra["max_model_len"] == 32
        for prompt, stream in ((PROMPT, False), (PROMPT, True), (ids, False)):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 28, "temperature": 0, "stream": stream}
            refused = httpx.post(f"{url}/v1/completions", json=body)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
            assert (
                "5 tokens" in error["message"] and "33" in error["message"] and "max_model_len 32" in error["message"]
            )
        over = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 33})
        assert over.status_code == 400 and "[1, 32]" in over.json()["error"]["message"]
        too_long = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": " ".join(["w1"] * 32)})
        assert too_long.json()["error"]["param"] == "prompt"
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        fits = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=27, temperature=0)
        assert fits.usage.total_tokens <= 32
        # a chat message (no template: the text as it is) with no max_tokens: to the context's end
        messages = [{"role": "user", "content": "w1 w2"}]
        chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
        assert chat.choices[0].message.content == expected.text
        assert chat.choices[0].finish_reason == expected.finish_reason == "length"
        assert chat.usage.total_tokens == 32


def test_a_kv_cache_budget_lowers_the_batch_size_or_refuses_to_start(tiny_model_dir, caplog):
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir, max_model_len=64)
    per_sequence = 64 * kv_bytes_per_token(engine.target_runner)  # 64 tokens x 256 bytes
    app = create_app(engine, max_batch_size=16, kv_cache_gb=3.5 * per_sequence / 2**30, start_worker=False)
    assert app.state.worker.decoder.capacity == 3
    assert "max_batch_size lowered from 16 to 3" in caplog.text
    roomy = create_app(engine, max_batch_size=4, kv_cache_gb=1.0, start_worker=False)
    assert roomy.state.worker.decoder.capacity == 4
    with pytest.raises(InvalidArgumentError, match="less than one sequence of max_model_len 64 tokens needs"):
        create_app(engine, kv_cache_gb=0.5 * per_sequence / 2**30, start_worker=False)
