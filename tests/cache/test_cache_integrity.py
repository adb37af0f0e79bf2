"""The caches cannot lie (issue 22): seeded answers repeat with and without the response cache,
a seeded answer is served only to an engine that would draw the same sample, the model
fingerprint covers the kernels, forged Redis entries and records are refused, a hostile draft
record is bounded, and no error shows the Redis password. Redis runs for real on loopback."""

from __future__ import annotations

import copy
import hashlib
import logging
import re

import numpy as np
import pytest
import redis
import torch
from typer.testing import CliRunner

from helpers import redis_server, tiny_llama
from specdecode import CacheOptions, SpeculativeEngine
from specdecode.cache import DraftStore, InProcessBackend, RedisBackend, ResponseCache, open_backend
from specdecode.cli import app as cli_app
from specdecode.drafters import ModelDrafter, PromptLookupDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.errors import InvalidArgumentError
from specdecode.runners.fast_llama import FastLlamaRunner

PROMPTS = [[3, 5, 7, 2], [1, 1, 4, 9, 16, 9, 4], [20, 3, 20, 3, 20]]
REPEATING = [3, 5, 7, 3, 5, 7, 3, 5]  # prompt lookup drafts from it at once
SAMPLED = dict(max_new_tokens=16, temperature=1.0)
PASSWORD = "hunter2-not-for-logs"


@pytest.fixture(scope="module")
def bf16_model():
    return tiny_llama(seed=1).to(torch.bfloat16)


def engine_on(model, backend=None, drafter=None, k: int = 3, runner=FastLlamaRunner, secret=None) -> SpeculativeEngine:
    """An engine with k pinned (adaptive off) and, given a backend, a response cache on it."""
    engine = SpeculativeEngine(runner(model), drafter=drafter, num_speculative_tokens=k)
    engine.eos_token_ids = frozenset()
    if backend is not None:
        keyed = {"secret": secret} if secret is not None else {}
        cache = ResponseCache(backend, engine.model_fingerprint(), engine.target_runner.vocab_size, **keyed)
        engine.use_response_cache(cache)
    return engine


def unkeyed_entry(key: bytes | str, token_ids: list[int], reason: str) -> bytes:
    """An entry as anyone who reads cache/response_cache.py can write one without the key."""
    key = key if isinstance(key, bytes) else key.encode()
    payload = bytes([("stop", "length").index(reason)]) + np.array(token_ids, dtype=np.int32).tobytes()
    return hashlib.blake2b(key + payload, digest_size=16).digest() + payload


# --- item 4: one seeding rule, every prompt cacheable ---


def test_seeded_generate_over_several_prompts_is_the_same_with_and_without_the_cache(bf16_model):
    plain = engine_on(bf16_model, drafter=PromptLookupDrafter())
    cached = engine_on(bf16_model, InProcessBackend(), drafter=PromptLookupDrafter())
    expected = [r.token_ids for r in plain.generate(PROMPTS, seed=7, **SAMPLED)]
    cached.generate(PROMPTS[:1], seed=7, **SAMPLED)  # the first prompt's answer stored: a hit below
    results = cached.generate(PROMPTS, seed=7, **SAMPLED)
    assert results[0].stats.cached
    assert [r.token_ids for r in results] == expected, "a cache hit changed a later prompt's sample"
    again = cached.generate(PROMPTS, seed=7, **SAMPLED)
    assert all(r.stats.cached for r in again), "every seeded prompt is cacheable"
    assert [r.token_ids for r in again] == expected
    batched = [r.token_ids for r in plain.generate(PROMPTS, seed=7, **SAMPLED, max_batch_size=8)]
    assert batched == expected, "one at a time and in a batch, prompt i is seeded seed + i alike"
    assert sum(r.stats.drafted_tokens for r in plain.generate(PROMPTS, seed=7, **SAMPLED)) > 0


# --- item 5: a seeded answer is served only to an engine that would draw it ---


def test_engines_with_other_prompt_lookup_settings_do_not_share_seeded_answers(bf16_model):
    backend = InProcessBackend()
    wide = engine_on(bf16_model, backend, PromptLookupDrafter(1, 3))
    narrow = engine_on(bf16_model, backend, PromptLookupDrafter(2, 2, max_continuation=1))
    same = engine_on(bf16_model, backend, PromptLookupDrafter(1, 3))
    answer = wide.generate([REPEATING], seed=5, **SAMPLED)[0]
    assert answer.stats.drafted_tokens > 0
    other = narrow.generate([REPEATING], seed=5, **SAMPLED)[0]
    assert not other.stats.cached, "an engine with other prompt-lookup settings was served the seeded answer"
    assert (
        other.token_ids
        == engine_on(bf16_model, None, PromptLookupDrafter(2, 2, 1))
        .generate([REPEATING], seed=5, **SAMPLED)[0]
        .token_ids
    )
    shared = same.generate([REPEATING], seed=5, **SAMPLED)[0]
    assert shared.stats.cached and shared.token_ids == answer.token_ids  # the same settings: the same sample
    greedy = dict(max_new_tokens=16)
    wide.generate([REPEATING], **greedy)
    assert narrow.generate([REPEATING], **greedy)[0].stats.cached  # greedy answers do not depend on drafts


def test_engines_with_other_draft_models_do_not_share_seeded_answers(bf16_model):
    backend = InProcessBackend()
    draft = tiny_llama(seed=2).to(torch.bfloat16)
    other_draft = tiny_llama(seed=3).to(torch.bfloat16)
    first = engine_on(bf16_model, backend, ModelDrafter(FastLlamaRunner(draft)))
    second = engine_on(bf16_model, backend, ModelDrafter(FastLlamaRunner(other_draft)))
    copied = engine_on(bf16_model, backend, ModelDrafter(FastLlamaRunner(copy.deepcopy(draft))))
    confident = engine_on(bf16_model, backend, ModelDrafter(FastLlamaRunner(draft), min_confidence=0.9))
    answer = first.generate([PROMPTS[0]], seed=5, **SAMPLED)[0]
    assert answer.stats.drafted_tokens > 0
    for engine in (second, confident):
        assert not engine.generate([PROMPTS[0]], seed=5, **SAMPLED)[0].stats.cached, engine.drafter.runner
    again = copied.generate([PROMPTS[0]], seed=5, **SAMPLED)[0]
    assert again.stats.cached and again.token_ids == answer.token_ids  # the same draft weights


def test_seeded_answers_of_an_unknown_drafter_are_not_cached(bf16_model):
    class Custom(PromptLookupDrafter):
        """A drafter whose proposals the cache cannot describe (not one of specdecode's)."""

    engine = engine_on(bf16_model, InProcessBackend(), Custom())
    engine.generate([REPEATING], seed=5, **SAMPLED)
    assert not engine.generate([REPEATING], seed=5, **SAMPLED)[0].stats.cached
    engine.generate([REPEATING], max_new_tokens=8)
    assert engine.generate([REPEATING], max_new_tokens=8)[0].stats.cached  # greedy: still cached


def test_a_drafter_of_ones_own_that_declares_its_identity_has_seeded_answers_cached(bf16_model):
    class Described(PromptLookupDrafter):
        """Exact n-grams of one length: its own identity (Drafter.cache_identity) names it."""

        def __init__(self, ngram: int):
            super().__init__(ngram, ngram)

        def cache_identity(self) -> list:
            return ["n-grams of one length", self.min_ngram]

    backend = InProcessBackend()
    answer = engine_on(bf16_model, backend, Described(2)).generate([REPEATING], seed=5, **SAMPLED)[0]
    assert answer.stats.drafted_tokens > 0 and not answer.stats.cached
    same = engine_on(bf16_model, backend, Described(2)).generate([REPEATING], seed=5, **SAMPLED)[0]
    assert same.stats.cached and same.token_ids == answer.token_ids
    assert not engine_on(bf16_model, backend, Described(1)).generate([REPEATING], seed=5, **SAMPLED)[0].stats.cached
    plain = engine_on(bf16_model, backend, PromptLookupDrafter(2, 2)).generate([REPEATING], seed=5, **SAMPLED)[0]
    assert not plain.stats.cached  # the class is part of the identity


# --- item 6: the fingerprint covers what changes bits ---


def fingerprint(model, quantization=None) -> str:
    return SpeculativeEngine(FastLlamaRunner(model, quantization)).model_fingerprint()


def test_the_fingerprint_names_the_runner_variant(bf16_model):
    assert fingerprint(bf16_model) == fingerprint(bf16_model)
    assert fingerprint(bf16_model) != fingerprint(bf16_model, "int8"), "float and int8 runners share a fingerprint"


@pytest.mark.parametrize(
    "change",
    [
        "ONEDNN_MAX_CPU_ISA",
        "DNNL_MAX_CPU_ISA",
        "ATEN_CPU_CAPABILITY",
        "cpu flags",
        "torch version",
        "transformers version",
        "onednn version",
        "threads",
        "float32 matmul precision",
    ],
)
def test_the_fingerprint_names_the_kernels(bf16_model, monkeypatch, change):
    import specdecode.cpu

    before = fingerprint(bf16_model)
    threads = torch.get_num_threads()
    if change in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.setenv(change, "AVX512_CORE")  # as on a host without native bfloat16
    elif change == "ATEN_CPU_CAPABILITY":
        monkeypatch.setenv(change, "avx2")
    elif change == "cpu flags":
        flags = specdecode.cpu.cpu_flags()
        native = {"avx512_bf16", "amx_bf16"}  # taken away where the CPU has them, else given
        other = flags - native if flags & native else flags | native
        monkeypatch.setattr(specdecode.cpu, "cpu_flags", lambda: other)
    elif change == "torch version":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    elif change == "transformers version":
        import transformers

        monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".other")
    elif change == "onednn version":
        show = torch.__config__.show()
        other = re.sub(r"(DNN v)[0-9.]+", r"\g<1>0.0.1", show)
        assert other != show
        monkeypatch.setattr(torch.__config__, "show", lambda: other)
    elif change == "threads":
        torch.set_num_threads(1 if threads != 1 else 2)
    else:
        monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "medium")
    try:
        assert fingerprint(bf16_model) != before, f"{change} does not change the fingerprint"
    finally:
        torch.set_num_threads(threads)


def test_engines_on_other_kernels_do_not_share_answers(bf16_model, monkeypatch):
    backend = InProcessBackend()
    here = engine_on(bf16_model, backend)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    limited = engine_on(bf16_model, backend)
    here.generate(PROMPTS[:1], max_new_tokens=8)
    assert not limited.generate(PROMPTS[:1], max_new_tokens=8)[0].stats.cached
    int8 = engine_on(bf16_model, backend, runner=lambda model: FastLlamaRunner(model, "int8"))
    assert not int8.generate(PROMPTS[:1], max_new_tokens=8)[0].stats.cached


# --- item 7: entries authenticated with the operator's key; lengths checked ---


def test_a_forged_response_entry_is_refused_with_the_key(bf16_model, monkeypatch):
    with redis_server() as url:
        client = redis.Redis.from_url(url)
        engine = SpeculativeEngine(FastLlamaRunner(bf16_model))
        engine.open_caches(CacheOptions(url, draft_store=False, secret="the operator's key"))
        expected = engine.generate(PROMPTS[:1], max_new_tokens=24)[0].token_ids
        assert engine.generate(PROMPTS[:1], max_new_tokens=24)[0].stats.cached  # its own entries are served
        (key,) = client.keys("*:resp:*")
        client.set(key, unkeyed_entry(key, [17] * 24, "length"))  # well formed, and in bounds
        again = engine.generate(PROMPTS[:1], max_new_tokens=24)[0]
        assert not again.stats.cached and again.token_ids == expected, "a forged entry was served"
        assert engine.response_cache.rejected == 1
        # the key from the environment; another operator's key is no better than none
        monkeypatch.setenv("SPECDECODE_CACHE_SECRET", "another key")
        other = SpeculativeEngine(FastLlamaRunner(bf16_model))
        other.open_caches(CacheOptions(url, draft_store=False))
        assert not other.generate(PROMPTS[:1], max_new_tokens=24)[0].stats.cached
        assert other.generate(PROMPTS[:1], max_new_tokens=24)[0].stats.cached


def test_without_a_key_entries_that_do_not_fit_the_request_are_refused_and_a_warning_says_so(bf16_model, caplog):
    with redis_server() as url:
        client = redis.Redis.from_url(url)
        engine = SpeculativeEngine(FastLlamaRunner(bf16_model))
        with caplog.at_level(logging.WARNING, logger="specdecode.cache"):
            engine.open_caches(CacheOptions(url, draft_store=False))
        assert "must be trusted" in caplog.text and "SPECDECODE_CACHE_SECRET" in caplog.text
        expected = engine.generate(PROMPTS[:1], max_new_tokens=24)[0].token_ids
        (key,) = client.keys("*:resp:*")
        forged = (
            ([17] * 30, "length"),  # more tokens than max_new_tokens
            ([17] * 23, "length"),  # "length" one token short of the budget
            ([17] * 23 + [10**6], "length"),  # an id outside the vocabulary
            ([], "stop"),  # "stop" with no EOS or stop string to stop at
        )
        for count, (token_ids, reason) in enumerate(forged, 1):
            client.set(key, unkeyed_entry(key, token_ids, reason))
            again = engine.generate(PROMPTS[:1], max_new_tokens=24)[0]
            assert not again.stats.cached and again.token_ids == expected, f"served {token_ids} ({reason})"
            assert engine.response_cache.rejected == count


def test_draft_records_are_authenticated_with_the_key(bf16_model):
    with redis_server() as url:
        client = redis.Redis.from_url(url)

        def engine(secret):
            engine = SpeculativeEngine(FastLlamaRunner(bf16_model), num_speculative_tokens=4)
            engine.drafter = SuffixDrafter(engine.open_caches(CacheOptions(url, response_cache=False, secret=secret)))
            return engine

        writer, reader, stranger = engine("key"), engine("key"), engine("other key")
        writer.generate(PROMPTS[:1], max_new_tokens=24)  # its sequence shared, with a MAC
        client.xadd(reader.drafter.store.log, {b"w": b"someone", b"v": np.array(PROMPTS[1] * 4, np.int32).tobytes()})
        reader.drafter.store.sync()
        assert len(reader.drafter.store) == 28 and reader.drafter.store.skipped == 1
        stranger.drafter.store.sync()
        assert len(stranger.drafter.store) == 0 and stranger.drafter.store.skipped == 2


# --- item 13: draft records bounded, indexed within a budget ---


def test_a_hostile_megabyte_draft_record_is_skipped_and_counted(bf16_model):
    truth = SpeculativeEngine(FastLlamaRunner(bf16_model)).generate(PROMPTS[:1], max_new_tokens=20)[0].token_ids
    with redis_server() as url:
        client = redis.Redis.from_url(url)
        engine = SpeculativeEngine(FastLlamaRunner(bf16_model), num_speculative_tokens=4)
        engine.eos_token_ids = frozenset()
        store = engine.open_caches(CacheOptions(url, response_cache=False))
        engine.drafter = SuffixDrafter(store)
        hostile = np.full(300_000, 3, dtype=np.int32).tobytes()  # 1.2 MB of valid ids
        client.xadd(store.log, {b"w": b"someone", b"v": hostile})
        client.xadd(store.log, {b"w": b"someone", b"v": np.array(PROMPTS[0] + truth, np.int32).tobytes()})
        # one read brings at most a sequence's worth of bytes per record: the hostile one not at all
        records = RedisBackend(url).read(store.log, max_entries=10, max_record_bytes=4 * engine.max_model_len)
        assert [r if r is None else len(r) for r in records] == [None, 96]
        unscripted = RedisBackend(url)  # a server that refuses scripts: the client drops the record
        unscripted.client.eval = lambda *args: (_ for _ in ()).throw(redis.ResponseError("unknown command 'EVAL'"))
        records = unscripted.read(store.log, max_entries=10, max_record_bytes=4 * engine.max_model_len)
        assert [r if r is None else len(r) for r in records] == [None, 96] and unscripted.errors == 0
        indexed = []
        index = store._index
        store._index = lambda ids: (indexed.append(len(ids)), index(ids))
        result = engine.generate(PROMPTS[:1], max_new_tokens=20)[0]
        assert result.token_ids == truth and result.stats.accepted_tokens >= 10  # drafted from the other record
        assert store.skipped == 1 and store.tokens == 24 + 24, "the hostile record was indexed"
        assert indexed == [24, 24]


def test_a_read_takes_a_bounded_batch_and_indexing_a_bounded_budget(bf16_model):
    with redis_server() as url:
        client = redis.Redis.from_url(url)
        store = DraftStore(RedisBackend(url), "m", vocab_size=30, max_record_tokens=100)
        for i in range(600):
            client.xadd(store.log, {b"w": b"someone", b"v": np.array([i % 30] * 50, np.int32).tobytes()})
        store.sync(budget=0)  # a new store reads the newest records first, a bounded batch
        assert store.pending_records == store.READ_ENTRIES < 600 and store.tokens == 0  # read, not yet indexed
        store.propose([1, 1], k=2)  # a step's proposal indexes a bounded budget first
        assert 0 < store.tokens <= store.INDEX_BUDGET_TOKENS + 100
        store.sync()
        assert store.pending_records == 0 and store.tokens == 50 * store.READ_ENTRIES
        for i in range(5):
            client.xadd(store.log, {b"w": b"someone", b"v": np.array([i] * 50, np.int32).tobytes()})
        store.sync()  # then what was added since
        assert store.tokens == 50 * (store.READ_ENTRIES + 5)


# --- item 14: the Redis password appears nowhere ---


def test_the_redis_password_is_masked_in_every_error(tiny_model_dir, caplog):
    for url in (
        f"http://user:{PASSWORD}@localhost:6379",
        f"redis://user:{PASSWORD}@127.0.0.1:notaport/0",
        f"rediss://:{PASSWORD}@{PASSWORD}@127.0.0.1:notaport/0",
        f"user:{PASSWORD}@localhost:6379",
        f"http://127.0.0.1:6379/0?password={PASSWORD}",
        f"redis://:{PASSWORD}@127.0.0.1:6379/0?socket_timeout=soon",
    ):
        with pytest.raises(InvalidArgumentError) as raised:
            open_backend(url)
        assert PASSWORD not in str(raised.value), str(raised.value)
    unreachable = f"redis://user:{PASSWORD}@127.0.0.1:1/0"
    result = CliRunner().invoke(cli_app, ["generate", "w1 w2", "--target", tiny_model_dir, "--cache-url", unreachable])
    assert result.exit_code == 2 and "no Redis answered" in result.output
    assert PASSWORD not in result.output, result.output
    with caplog.at_level(logging.WARNING, logger="specdecode.cache"):
        backend = RedisBackend(unreachable)
        backend.get("k")
    assert "failed" in caplog.text and PASSWORD not in caplog.text, caplog.text
    options = CacheOptions(unreachable, secret="the operator's key")
    assert PASSWORD not in repr(options) and "operator" not in repr(options)


def test_a_wrong_redis_password_is_not_logged(caplog):
    with redis_server() as url:
        redis.Redis.from_url(url).config_set("requirepass", "the right one")
        wrong = url.replace("redis://", f"redis://:{PASSWORD}@")
        with caplog.at_level(logging.WARNING, logger="specdecode.cache"):
            backend = RedisBackend(wrong)
            assert backend.get("k") is None and backend.errors == 1
        assert "failed" in caplog.text and PASSWORD not in caplog.text, caplog.text


def test_the_cli_reads_the_key_from_a_file_and_warns_without_one(tiny_model_dir, tmp_path, caplog):
    secret = tmp_path / "cache-secret"
    secret.write_text("the operator's key\n")
    with redis_server() as url:
        ask = ["generate", "w1 w2", "--target", tiny_model_dir, "--cache-url", url, "--json", "--max-new-tokens", "4"]
        with caplog.at_level(logging.WARNING, logger="specdecode.cache"):
            runs = [CliRunner().invoke(cli_app, ask + ["--cache-secret-file", str(secret)]) for _ in range(2)]
        assert [r.exit_code for r in runs] == [0, 0], runs[0].output
        assert '"cached": true' in runs[1].stdout and "must be trusted" not in caplog.text
        with caplog.at_level(logging.WARNING, logger="specdecode.cache"):
            unkeyed = CliRunner().invoke(cli_app, ask)
        assert unkeyed.exit_code == 0 and "must be trusted" in caplog.text
        assert '"cached": false' in unkeyed.stdout  # the keyed entry is not served without the key
        missing = CliRunner().invoke(cli_app, ask + ["--cache-secret-file", str(tmp_path / "missing")])
        assert missing.exit_code == 2 and "--cache-secret-file" in missing.output, missing.output
