"""A streamed answer's text through the real server: the answer's text, which is what
OpenAI's API returns (the text up to the stop string), whether the stop string begins
inside a token, spans tokens, begins the answer, holds multi-byte characters or overlaps
another; with speculation or without; and `usage` counts the tokens generated (through the
one that completes the stop string). A property test over random prompts and stop strings;
and a long stream decodes a window of tokens a step, never the whole text again."""

from __future__ import annotations

import random

import openai
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from helpers import VOCAB, assert_drafted_and_accepted, serving, tiny_llama
from specdecode import SpeculativeEngine
from specdecode.drafters import ModelDrafter
from specdecode.runners import HFModelRunner
from specdecode.server import create_app

MODEL = "tiny-multibyte"
MAX_TOKENS = 24
# words of one to three bytes a character, so that stop strings cut multi-byte text
WORDS = ["<eos>", "<unk>"] + [("w{}", "é{}ü", "日{}本")[i % 3].format(i) for i in range(VOCAB - 2)]


def multibyte_tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")


def self_drafted(target, tokenizer) -> SpeculativeEngine:
    """The target drafting for itself: every draft accepted, so a stop string lands inside a
    block of several tokens."""
    engine = SpeculativeEngine(target, tokenizer, ModelDrafter(HFModelRunner(target)), num_speculative_tokens=4)
    engine.eos_token_ids = frozenset()  # stop strings, not EOS, end these answers
    return engine


@pytest.fixture(scope="module")
def model():
    target = tiny_llama(seed=0)
    target.generation_config.eos_token_id = None
    return target, multibyte_tokenizer()


@pytest.fixture(scope="module")
def engines(model):
    """Speculative and target-only, on the same weights."""
    alone = SpeculativeEngine(*model, None)
    alone.eos_token_ids = frozenset()
    return self_drafted(*model), alone


@pytest.fixture(scope="module")
def client(model):
    # an engine of its own: the server's worker thread is the only one that may step it
    with serving(create_app(self_drafted(*model), model_name=MODEL)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def expected_answer(tokens: list[int], decode, stops: list[str]) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) as a decoding of one token at a time finds
    them: the first token whose text holds a stop string; the text up to where it begins."""
    for n in range(1, len(tokens) + 1):
        text = decode(tokens[:n])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)], n, "stop"
    return decode(tokens), len(tokens), "length"


def random_stops(rng: random.Random, text: str) -> list[str]:
    """Stop strings of every kind for this answer's text: a piece of it beginning anywhere
    (inside a word, at a space, at the start), two that overlap, one that never occurs."""
    kind = rng.choice(["piece", "start", "overlap", "absent"])
    begin = 0 if kind == "start" else rng.randrange(len(text))
    piece = text[begin : begin + rng.randint(1, 8)]
    if kind == "overlap":
        other = text[max(0, begin - rng.randint(1, 4)) : begin + rng.randint(1, 3)]
        return [piece, other]
    if kind == "absent":
        return [piece, "日本日本日本"]
    return [piece]


def complete(client, prompt: str, stops: list[str]) -> tuple[str, int, str]:
    return complete_of(client, prompt, MAX_TOKENS, stops)


def stream(client, prompt: str, stops: list[str]) -> tuple[str, int, str]:
    return stream_of(client, prompt, MAX_TOKENS, stops)


def complete_of(client, prompt: str, max_tokens: int, stop: list[str] | None) -> tuple[str, int, str]:
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stop=stop)
    choice = response.choices[0]
    return choice.text, response.usage.completion_tokens, choice.finish_reason


def stream_of(client, prompt: str, max_tokens: int, stop: list[str] | None) -> tuple[str, int, str]:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stop=stop,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    return text, chunks[-1].usage.completion_tokens, reason


@pytest.mark.parametrize("seed", range(8))
def test_streamed_and_whole_answers_end_where_one_token_a_step_finds_the_stop(engines, client, seed):
    drafted, alone = engines
    rng = random.Random(seed)
    for _ in range(6):
        prompt = " ".join(rng.choice(WORDS[2:]) for _ in range(rng.randint(1, 6)))
        free = alone.generate(prompt, max_new_tokens=MAX_TOKENS, temperature=0)[0]
        stops = random_stops(rng, free.text)
        expected = expected_answer(free.token_ids, alone.decode, stops)
        for engine in (drafted, alone):  # speculation or not: the same answer and tokens
            result = engine.generate(prompt, max_new_tokens=MAX_TOKENS, temperature=0, stop=stops)[0]
            assert (result.text, len(result.token_ids), result.finish_reason) == expected, (prompt, stops)
            assert result.token_ids == free.token_ids[: expected[1]]
        assert complete(client, prompt, stops) == expected, (prompt, stops)
        assert stream(client, prompt, stops) == expected, (prompt, stops)


def test_a_stop_string_that_begins_inside_a_token_keeps_the_text_before_it(engines, client):
    drafted, alone = engines
    free = alone.generate("w3 é4ü", max_new_tokens=MAX_TOKENS, temperature=0)[0]
    words = free.text.split()

    def inside(i: int) -> tuple[str, str]:  # word i's last character, a space and word i + 1
        return words[i][-1] + " " + words[i + 1], " ".join(words[:i]) + " " + words[i][:-1]

    # the first such stop string past the first block whose text occurs nowhere earlier
    i = next(i for i in range(3, len(words) - 1) if free.text.find(inside(i)[0]) == len(inside(i)[1]))
    stop, text = inside(i)
    result = drafted.generate("w3 é4ü", max_new_tokens=MAX_TOKENS, temperature=0, stop=[stop])[0]
    assert result.text == text and result.token_ids == free.token_ids[: i + 2] and result.finish_reason == "stop"
    assert_drafted_and_accepted([result])
    assert complete(client, "w3 é4ü", [stop]) == (text, i + 2, "stop")
    assert stream(client, "w3 é4ü", [stop]) == (text, i + 2, "stop")


class CountingDecode:
    """engine.decode, counting the tokens and characters of every call."""

    def __init__(self, decode):
        self.decode, self.calls = decode, []

    def __call__(self, ids: list[int]) -> str:
        text = self.decode(ids)
        self.calls.append((len(ids), len(text)))
        return text


def test_a_long_stream_decodes_a_window_a_step_not_the_whole_text():
    target = tiny_llama(seed=0, max_positions=4200)
    target.generation_config.eos_token_id = None
    engine = self_drafted(target, multibyte_tokenizer())
    counting = engine.decode = CountingDecode(engine.decode)
    with serving(create_app(engine, model_name=MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        text, tokens, reason = stream_of(client, "w3 é4ü", 4096, stop=None)
        streamed = counting.calls[:-1]  # the last: the answer's text, decoded once
        counting.calls.clear()
        assert (text, tokens, reason) == complete_of(client, "w3 é4ü", 4096, stop=None)
    assert tokens == 4096 and len(text) > 4 * 4096
    # a window is this step's tokens after the last step's (k + 1 = 5 at most each), whatever
    # the length so far; the characters decoded in all add up to a few times the text's
    assert max(n for n, _ in streamed) <= 10
    assert sum(chars for _, chars in streamed) <= 6 * len(text)
