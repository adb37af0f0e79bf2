"""The caching layer (cache/): a draft store and an exact response cache, in process and on a
real Redis started here. Nothing they hold can change an output: drafts are verified, and a
cached answer is checked and served only where outputs do not depend on the batch."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading

import httpx
import numpy as np
import openai
import pytest
import redis
import torch
from typer.testing import CliRunner

from helpers import (
    ALPHA,
    DIST_VOCAB,
    NUM_TOKENS,
    PROMPT,
    SKIP,
    exact_joint,
    free_port,
    g_test_pvalue,
    healthy,
    hf_greedy,
    metric,
    redis_server,
    serving,
    target_and_draft,
    tiny_llama,
    tiny_tokenizer,
    wait_for,
)
from helpers import (
    SERVED_MODEL as MODEL,
)
from specdecode import CacheOptions, SpeculativeEngine
from specdecode.cache import DraftStore, InProcessBackend, RedisBackend, ResponseCache, open_backend
from specdecode.cache import backends as backends_module
from specdecode.cli import app as cli_app
from specdecode.decoder import decode_all
from specdecode.drafters import AutoDrafter, PromptLookupDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.errors import InvalidArgumentError
from specdecode.runners import HFModelRunner
from specdecode.runners.fast_llama import FastLlamaRunner
from specdecode.server import create_app

PROMPTS = [[3, 5, 7, 2], [1, 1, 4, 9, 16, 9, 4], [20, 3, 20, 3, 20]]
PASSWORD = "hunter2-not-for-logs"


def engine_with_caches(
    model, url: str | None = None, auto: bool = False, text: bool = False, runner=FastLlamaRunner, response_cache=True
) -> SpeculativeEngine:
    """text: with a tokenizer, for the server (its EOS ignored, as transformers' generate of these models does)."""
    engine = SpeculativeEngine(runner(model), tiny_tokenizer() if text else None, num_speculative_tokens=4)
    engine.eos_token_ids = frozenset()
    store = engine.open_caches(CacheOptions(url, response_cache=response_cache))
    suffix = SuffixDrafter(store)
    engine.drafter = AutoDrafter([PromptLookupDrafter(), suffix]) if auto else suffix
    return engine


@pytest.fixture(scope="module")
def bf16_model():
    return tiny_llama(seed=1).to(torch.bfloat16)


# --- the draft store ---


def test_the_store_continues_the_longest_match_and_stops_where_history_disagrees():
    store = DraftStore(InProcessBackend(), "m", vocab_size=30)
    store.add([1, 2, 3, 4, 5, 6, 7])
    assert store.propose([9, 2, 3], k=3) == [4, 5, 6]
    assert store.propose([9, 9], k=3) == []  # no n-gram of 2+ tokens matches
    store.add([1, 2, 3, 8, 9])
    store.add([0, 2, 3, 10, 11])
    assert store.propose([2, 3], k=3) == []  # 4, 8, 10 each followed "2 3" a third of the time
    assert store.propose([1, 2, 3], k=3) == []  # the longest match decides: 4 or 8, half each
    store.add([1, 2, 3, 4, 5, 6, 7])
    assert store.propose([1, 2, 3], k=2) == [4, 5]  # 4 now follows "1 2 3" two times in three


def test_the_store_forgets_its_oldest_sequences_past_its_bound():
    store = DraftStore(InProcessBackend(), "m", vocab_size=30, max_tokens=10)
    store.add([1, 2, 3, 4, 5, 6])
    store.add([11, 12, 13, 14, 15, 16])
    assert store.propose([1, 2], k=2) == [] and store.propose([11, 12], k=2) == [13, 14]
    assert len(store) == 6


def test_records_that_are_not_sequences_of_this_vocabulary_are_skipped():
    class Log(InProcessBackend):
        def read(self, log, **bounds):
            return [
                b"\x01\x02\x03",
                b"",
                np.array([1, 2, 99], dtype=np.int32).tobytes(),
                np.array([4, 5, 6, 7], dtype=np.int32).tobytes(),
            ]

    store = DraftStore(Log(), "m", vocab_size=30)
    store.sync()
    assert store.skipped == 3 and store.propose([4, 5], k=2) == [6, 7]


# --- the response cache ---


def test_a_response_entry_that_was_altered_or_moved_is_a_miss():
    backend = InProcessBackend()
    cache = ResponseCache(backend, "model-a", vocab_size=30)
    key, other = cache.key([1, 2, 3], max_new_tokens=4), cache.key([1, 2, 4], max_new_tokens=4)
    assert key != other and key != ResponseCache(backend, "model-b", 30).key([1, 2, 3], max_new_tokens=4)
    cache.put(key, [5, 6, 7], "length")
    assert cache.get(key) == ([5, 6, 7], "length")
    stored = backend.get(key)
    backend.set(other, stored, None)  # the right bytes under another request's key
    backend.set(key, stored[:-1] + bytes([stored[-1] ^ 1]), None)  # one bit of a token flipped
    assert cache.get(key) is None and cache.get(other) is None and cache.rejected == 2


def test_repeated_greedy_and_seeded_requests_are_served_from_the_cache_exactly(bf16_model):
    engine = engine_with_caches(bf16_model)
    assert engine.cache_note == "response cache on"
    first = engine.generate(PROMPTS, max_new_tokens=24)  # the first prompt's answer is stored
    again = engine.generate(PROMPTS[:1], max_new_tokens=24)[0]
    assert again.stats.cached and again.token_ids == first[0].token_ids
    fresh = SpeculativeEngine(FastLlamaRunner(bf16_model)).generate(PROMPTS[:1], max_new_tokens=24)[0]
    assert again.token_ids == fresh.token_ids
    other_budget = engine.generate(PROMPTS[:1], max_new_tokens=23)[0]
    assert not other_budget.stats.cached  # another budget is another request
    sampled = dict(max_new_tokens=16, temperature=1.0, seed=3)
    batch = engine.generate(PROMPTS, **sampled, max_batch_size=8)
    repeat = engine.generate(PROMPTS, **sampled, max_batch_size=8)
    assert all(r.stats.cached for r in repeat) and [r.token_ids for r in repeat] == [r.token_ids for r in batch]
    unseeded = engine.generate(PROMPTS, max_new_tokens=16, temperature=1.0, max_batch_size=8)
    assert not any(r.stats.cached for r in unseeded)


def test_the_response_cache_stays_off_where_batches_change_the_bits():
    engine = engine_with_caches(tiny_llama(seed=1), runner=HFModelRunner)  # transformers' kernels
    assert engine.response_cache is None and "HFModelRunner" in engine.cache_note
    engine.generate(PROMPTS[:1], max_new_tokens=8)
    assert not engine.generate(PROMPTS[:1], max_new_tokens=8)[0].stats.cached


# --- the suffix drafter ---


def test_a_repeated_request_is_drafted_from_the_store_and_stays_exact():
    target = tiny_llama(seed=1)
    engine = engine_with_caches(target, response_cache=False)  # so the repeat is decoded
    first = engine.generate(PROMPTS[:1], max_new_tokens=40)[0]
    second = engine.generate(PROMPTS[:1], max_new_tokens=40)[0]
    assert first.token_ids == second.token_ids == hf_greedy(target, PROMPTS[0], 40)
    assert first.stats.accepted_tokens == 0 and second.stats.accepted_tokens >= 30
    assert second.stats.target_forwards < first.stats.target_forwards / 3


def test_suffix_drafts_keep_the_target_distribution_when_sampling():
    """The store filled with the draft model's own samples (a stale, wrong history): unseeded
    requests drawn from one seeded generator keep the target's law (and not the draft's)."""
    params = dict(temperature=1.0)
    target, other = target_and_draft(tiny_llama)
    engine = engine_with_caches(target)
    history = SpeculativeEngine(other).generate([PROMPT] * 200, max_new_tokens=6, seed=0, **params)
    for result in history:
        engine.drafter.store.add(PROMPT + result.token_ids)
    settings = engine.settings(max_new_tokens=SKIP + 4, temperature=1.0)
    generator = torch.Generator().manual_seed(21)
    sequences = [engine.sequence(PROMPT, settings, generator, fork=False, cacheable=False) for _ in range(2000)]
    decode_all(engine.decoder, sequences)
    assert sum(s.stats.accepted_tokens for s in sequences) > 500
    counts = np.zeros(DIST_VOCAB**NUM_TOKENS)
    for seq in sequences:
        counts[np.ravel_multi_index(seq.generated[SKIP : SKIP + NUM_TOKENS], [DIST_VOCAB] * NUM_TOKENS)] += 1
    assert g_test_pvalue(counts, exact_joint(target, params)) > ALPHA
    assert g_test_pvalue(counts, exact_joint(other, params)) < ALPHA  # negative control


# --- on a real Redis ---


def test_two_processes_share_drafts_and_answers_through_redis(bf16_model):
    with redis_server() as url:
        first, second = engine_with_caches(bf16_model, url), engine_with_caches(bf16_model, url)
        answered = first.generate(PROMPTS[:1], max_new_tokens=32)[0]
        hit = second.generate(PROMPTS[:1], max_new_tokens=32)[0]
        assert hit.stats.cached and hit.token_ids == answered.token_ids
        drafted = second.generate(PROMPTS[:1], max_new_tokens=31)[0]  # another request: decoded, drafted from the store
        assert drafted.token_ids == answered.token_ids[:31] and drafted.stats.accepted_tokens >= 20


def test_poisoned_redis_entries_change_nothing(bf16_model):
    with redis_server() as url:
        engine = engine_with_caches(bf16_model, url)
        expected = engine.generate(PROMPTS[:1], max_new_tokens=24)[0].token_ids
        client = redis.Redis.from_url(url)
        for key in client.scan_iter("*:resp:*"):
            value = client.get(key)
            other = 16 if int(np.frombuffer(value[-4:], dtype=np.int32)[0]) == 17 else 17  # not the token it held
            client.set(key, value[:-4] + np.array([other], dtype=np.int32).tobytes())  # the last token altered
        log = engine.drafter.store.log
        for record in (
            b"garbage",
            np.array([1, 2, 10**6], dtype=np.int32).tobytes(),
            np.array(PROMPTS[0] + [9] * 20, dtype=np.int32).tobytes(),
        ):
            client.xadd(log, {b"w": b"someone else", b"v": record})
        again = engine.generate(PROMPTS[:1], max_new_tokens=24)[0]
        assert not again.stats.cached and again.token_ids == expected
        assert engine.response_cache.rejected == 1 and engine.drafter.store.skipped == 2


def test_a_redis_that_dies_and_returns_costs_no_request(bf16_model, monkeypatch):
    monkeypatch.setattr(backends_module, "RETRY_S", 0.2)
    port = None
    with redis_server() as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        engine = engine_with_caches(bf16_model, url, auto=True)
        expected = [engine.generate([p], max_new_tokens=20)[0].token_ids for p in PROMPTS]
    # Redis is gone: every request is still answered, exactly; errors counted, not raised
    assert [engine.generate([p], max_new_tokens=20)[0].token_ids for p in PROMPTS] == expected
    assert engine.cache_backend.errors > 0
    with redis_server(port):
        torch.manual_seed(0)
        import time

        time.sleep(0.3)
        engine.generate([[2, 4, 6]], max_new_tokens=8)  # stored in Redis again
        assert redis.Redis.from_url(f"redis://127.0.0.1:{port}/0").dbsize() > 0


def test_killing_redis_during_a_load_test_loses_and_changes_nothing(bf16_model, monkeypatch):
    """Redis stopped while 8 clients stream 48 requests: every request is answered, each
    exactly as a server without Redis answers it; the backend's errors are counted."""
    from specdecode.server.loadtest import run_level

    monkeypatch.setattr(backends_module, "RETRY_S", 0.2)
    prompts = [" ".join(f"w{(i * j) % 19 + 1}" for j in range(3, 9)) for i in range(48)]

    def load(engine, during=lambda finished: None) -> tuple[list[str | None], list[str | None]]:
        app = create_app(engine, model_name=MODEL)
        finished = app.state.metrics.requests_finished.labels("length")._value.get  # all end at max_tokens
        with serving(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            background = threading.Thread(target=during, args=(finished,))
            background.start()
            timings = run_level(client, MODEL, prompts, 8, 30, 0.0)[1]
            background.join()
        return [t.text for t in timings], [t.error for t in timings]

    expected, _ = load(engine_with_caches(bf16_model, auto=True, text=True))
    with redis_server() as url:
        engine = engine_with_caches(bf16_model, url, auto=True, text=True)
        killed_after = []

        def kill_redis(finished) -> None:
            wait_for(lambda: finished() >= 8, timeout=60)  # some answered with Redis up, most after
            killed_after.append(finished())
            with contextlib.suppress(redis.ConnectionError):  # it hangs up as it goes
                redis.Redis.from_url(url).shutdown(nosave=True)

        texts, errors = load(engine, kill_redis)
    assert killed_after and killed_after[0] < len(prompts)
    assert errors == [None] * len(prompts) and texts == expected
    assert engine.cache_backend.errors > 0  # requests after the kill met a dead Redis


def test_a_malformed_or_unreachable_cache_url(tiny_model_dir):
    with pytest.raises(InvalidArgumentError, match="redis://HOST:PORT"):
        open_backend("http://localhost:6379")
    assert not RedisBackend("redis://127.0.0.1:1/0").ping()
    for url, says in (("localhost:6379", "must look like redis://"), ("redis://127.0.0.1:1/0", "no Redis answered")):
        result = CliRunner().invoke(cli_app, ["generate", "w1 w2", "--target", tiny_model_dir, "--cache-url", url])
        assert result.exit_code == 2 and says in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1


# --- in the server ---


def test_two_servers_on_one_redis_share_answers_and_drafts(bf16_model):
    """The second server's first request on a prompt the first server answered: a cache hit;
    a slightly different request (another budget) is decoded, drafted from the shared store."""
    with redis_server() as url:
        first, second = (engine_with_caches(bf16_model, url, auto=True, text=True) for _ in range(2))
        with serving(create_app(first, model_name=MODEL)) as a, serving(create_app(second, model_name=MODEL)) as b:
            ask = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0)
            answered = _client(a).completions.create(**ask)
            hit = _client(b).completions.create(**ask)
            assert hit.choices[0].text == answered.choices[0].text and hit.usage == answered.usage
            assert hit.model_extra["speculative"]["cached"] and not answered.model_extra["speculative"]["cached"]
            drafted = _client(b).completions.create(**(ask | dict(max_tokens=29)))
            stats = drafted.model_extra["speculative"]
            assert drafted.choices[0].text == answered.choices[0].text[: len(drafted.choices[0].text)]
            assert stats["drafted_by_source"]["suffix"][1] >= 10  # accepted from the other server's answer
            assert stats["mean_accepted_length"] > 2  # tokens per target forward; target-only: 1
            metrics = httpx.get(f"{b}/metrics").text
            assert metric(metrics, 'specdecode:response_cache_lookups_total{result="hit"}') == 1
            assert metric(metrics, 'specdecode:spec_decode_num_accepted_tokens_by_source_total{source="suffix"}') >= 10
            assert metric(metrics, "specdecode:draft_store_tokens") > 0


def test_a_streamed_request_is_answered_from_the_cache_too(bf16_model):
    engine = engine_with_caches(bf16_model, text=True)
    with serving(create_app(engine, model_name=MODEL)) as url:
        ask = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True)
        texts = [
            "".join(c.choices[0].text for c in _client(url).completions.create(**ask) if c.choices) for _ in range(2)
        ]
        assert texts[0] == texts[1] and texts[0]
        assert metric(httpx.get(f"{url}/metrics").text, 'specdecode:response_cache_lookups_total{result="hit"}') == 1


def test_serve_with_an_unreachable_redis_warns_and_serves(tiny_model_dir):
    """...and its warnings (no Redis answers; without a key the Redis must be trusted) never show the password."""
    port = free_port()
    command = [sys.executable, "-m", "specdecode.cli", "serve", "--target", tiny_model_dir, "--port", str(port)]
    command += ["--cache-url", f"redis://user:{PASSWORD}@127.0.0.1:{free_port()}/0"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: healthy(f"http://127.0.0.1:{port}"), timeout=60)
        answer = _client(f"http://127.0.0.1:{port}").completions.create(
            model=tiny_model_dir, prompt="w1 w2 w3", max_tokens=4, temperature=0
        )
        assert answer.choices[0].finish_reason == "length"
    finally:
        server.terminate()
        output = server.communicate(timeout=30)[0]
    assert "warning: no Redis answers" in output and "must be trusted" in output
    assert PASSWORD not in output and "user:***@127.0.0.1" in output, output


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
