"""The server's prefix reuse (runners/slots.py), through the official `openai` client: a request
whose prompt starts as an earlier one's prefills only the rest, says so in its usage
(prompt_tokens_details.cached_tokens) and in /metrics, and answers what a server without it
answers; --no-prefix-cache switches it off."""

import httpx
import openai
import pytest

from helpers import SERVED_MODEL as MODEL
from helpers import head64_llama, metric, serving, tiny_tokenizer, wait_for
from helpers.bits import c_layers_run_here
from specdecode import CacheOptions, SpeculativeEngine
from specdecode.server import create_app

SHARED = " ".join(f"w{i}" for i in range(10, 50))  # 40 tokens two prompts start with
PROMPTS = [f"{SHARED} w3 w4 w5 w3 w4", f"{SHARED} w7 w8 w9 w7 w8 w9"]

pytestmark = pytest.mark.skipif(not c_layers_run_here(), reason="no C layers here (no prefix reuse)")


@pytest.fixture(scope="module")
def c_layers_dir(tmp_path_factory) -> str:
    """A model whose w8a8 layers run in C (head_dim 64), with a tokenizer: a folder as a user gives."""
    folder = tmp_path_factory.mktemp("head64")
    head64_llama(0).save_pretrained(folder)
    tiny_tokenizer(256).save_pretrained(folder)
    return str(folder)


def hits(url: str) -> float:
    return metric(httpx.get(f"{url}/metrics").text, "specdecode:prefix_cache_hits_total")


def answers(url: str) -> list:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    return [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0) for p in PROMPTS]


def test_a_prompt_that_starts_as_an_earlier_one_prefills_the_rest_and_answers_the_same(c_layers_dir):
    off = SpeculativeEngine.from_pretrained(c_layers_dir, cache=CacheOptions(response_cache=False, prefix_cache=False))
    on = SpeculativeEngine.from_pretrained(c_layers_dir, cache=CacheOptions(response_cache=False))
    assert on.decoder.slots.reuses_prefixes and not off.decoder.slots.reuses_prefixes
    with serving(create_app(off, model_name=MODEL)) as url:
        expected = answers(url)
        assert hits(url) == 0
    with serving(create_app(on, model_name=MODEL)) as url:
        first, second = answers(url)
        wait_for(lambda: hits(url) > 0)  # counted as the request finishes, maybe after its answer
        counted = hits(url)
    assert [r.choices[0].text for r in (first, second)] == [r.choices[0].text for r in expected]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in expected] == [0, 0]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == len(SHARED.split()) == counted


def test_serve_says_whether_prefixes_are_kept_and_why_not(c_layers_dir, tiny_model_dir):
    from specdecode.cli.serving import _prefix_note

    on = SpeculativeEngine.from_pretrained(c_layers_dir, cache=CacheOptions(response_cache=False))
    off = SpeculativeEngine.from_pretrained(c_layers_dir, cache=CacheOptions(prefix_cache=False))
    other = SpeculativeEngine.from_pretrained(tiny_model_dir)  # no C layers for its head size
    assert _prefix_note(on, True).startswith("on")
    assert _prefix_note(off, False) == "off (--no-prefix-cache)"
    assert "rounds a row by the rows beside it" in _prefix_note(other, True)
