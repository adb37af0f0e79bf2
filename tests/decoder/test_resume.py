"""A sequence whose cache was lost (an engine crash: the worker's _recover calls
decoder.reset()) goes on bit for bit as the uninterrupted run, and only such answers are cached.

The uninterrupted run computed its generated tokens one query at a time (one-token decoding,
or verification on the fast path, which attends each query alone). Re-running prompt and
generated tokens as one prefill would compute those rows with batched attention instead,
which in bfloat16 rounds otherwise and, some tokens later, can flip a greedy choice. The
rebuild prefills the prompt alone, as the first run did, then re-runs the generated tokens
through the verification path. The model is wide enough (hidden 256, head_dim 64) and the
runs long enough (120 tokens) for the batched kernel's rounding to show.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from transformers import LlamaForCausalLM

from helpers import SERVED_MODEL, CrashAt, head64_llama, metric, serving, tiny_tokenizer
from specdecode import CacheOptions, SpeculativeEngine
from specdecode.decoder import SequenceState
from specdecode.drafters import PromptLookupDrafter
from specdecode.engine import make_generator
from specdecode.runners.fast_llama import FastLlamaRunner
from specdecode.server import create_app
from specdecode.server.faults import WorkerCrash
from specdecode.server.worker import EngineWorker

VOCAB = 256
NEW_TOKENS = 120


def bfloat16_llama(seed: int = 0) -> LlamaForCausalLM:
    return head64_llama(seed, vocab_size=VOCAB, tie_word_embeddings=False)


def prompts(count: int = 4, seed: int = 0) -> list[list[int]]:
    """Random token ids with a repeat, so that prompt lookup drafts (and some drafts are kept)."""
    generator = torch.Generator().manual_seed(seed)
    chosen = [torch.randint(0, VOCAB, (20,), generator=generator).tolist() for _ in range(count)]
    return [p + p[:8] for p in chosen]


@pytest.fixture(scope="module")
def engine() -> SpeculativeEngine:
    engine = SpeculativeEngine(bfloat16_llama(), drafter=PromptLookupDrafter(), num_speculative_tokens=4)
    assert isinstance(engine.target_runner, FastLlamaRunner) and engine.target_runner.batch_invariant
    return engine


def decode(
    engine: SpeculativeEngine, prompt: list[int], lose_cache_at: tuple[int, ...] = (), **sampling
) -> SequenceState:
    """One sequence decoded step by step; before the steps numbered in lose_cache_at, every cache
    is forgotten, as after a crash of the server's engine worker (EngineWorker._recover)."""
    params = dict(temperature=0.0, seed=None) | sampling
    settings = engine.settings(max_new_tokens=NEW_TOKENS, temperature=params["temperature"], seed=params["seed"])
    seq = engine.sequence(prompt, settings, make_generator(params["seed"]), seed=params["seed"])
    decoder = engine.decoder
    decoder.add(seq)
    step = 0
    while seq.finish is None:
        step += 1
        if step in lose_cache_at:
            decoder.reset()
        decoder.step()
    decoder.remove(seq)
    return seq


def test_a_resumed_sequence_reproduces_the_uninterrupted_run_bit_for_bit(engine):
    differ, resumed = [], []
    for index, prompt in enumerate(prompts()):
        reference = decode(engine, prompt)
        assert len(reference.generated) == NEW_TOKENS and reference.stats.accepted_tokens > 0
        steps = reference.stats.target_forwards
        for crash in (steps // 4, steps // 2, 3 * steps // 4):  # steps that run: drafts shorten the run
            resumed.append(decode(engine, prompt, lose_cache_at=(crash,)))
            if resumed[-1].generated != reference.generated:
                pairs = zip(resumed[-1].generated, reference.generated)
                first = next(i for i, (a, b) in enumerate(pairs) if a != b)
                differ.append(f"prompt {index}, cache lost at step {crash}: first differs at token {first}")
    assert not differ, differ
    assert all(seq.stats.replayed_tokens > len(seq.prompt_ids) for seq in resumed)  # the cache was rebuilt


def test_a_resumed_sequence_reprefills_its_prompt_alone_then_verifies_its_tokens_one_query_at_a_time(
    engine, monkeypatch
):
    """What makes the rebuild exact: the prompt runs alone from an empty cache, as its first
    prefill did, and the generated tokens run with every row's logits asked for (the fast
    path then attends one query at a time), not as a prefill."""
    prompt = prompts(1)[0]
    forwards: list[tuple[int, int, int]] = []  # (cached, new tokens, logits asked for)
    forward_batch = FastLlamaRunner.forward_batch

    def spy(self, caches, token_ids, num_logits):
        forwards.extend((c.length, len(t), n) for c, t, n in zip(caches, token_ids, num_logits))
        return forward_batch(self, caches, token_ids, num_logits)

    monkeypatch.setattr(FastLlamaRunner, "forward_batch", spy)
    seq = decode(engine, prompt, lose_cache_at=(40,))
    rebuilt = forwards.index((0, len(prompt), 1), 1)  # the prompt's second prefill
    cached, count, logits = forwards[rebuilt + 1]
    assert cached == len(prompt) and logits == count > 2, forwards[rebuilt + 1]  # verification, not a prefill
    assert len(prompt) + 2 <= seq.stats.replayed_tokens <= len(prompt) + count - 1


def test_a_sampled_sequence_that_lived_through_a_crash_is_not_cached(engine):
    """Its draws follow its drafts, and a draft model's cache is rebuilt in other chunks after
    a failure; a greedy answer does not depend on its drafts and keeps its key."""
    engine.open_caches(CacheOptions(draft_store=False))
    try:
        prompt = prompts(1)[0]
        assert decode(engine, prompt, temperature=0.8, seed=3).cache_key is not None
        assert decode(engine, prompt, lose_cache_at=(20,), temperature=0.8, seed=3).cache_key is None
        assert decode(engine, prompt, lose_cache_at=(20,)).cache_key is not None
    finally:
        engine.response_cache, engine.cache_note = None, "no response cache"


def test_requests_resumed_after_an_engine_crash_get_and_cache_their_uninterrupted_answers():
    """The real server, crashed twice while four long requests run, with the response cache
    on: each answer is the one the request gets alone and uninterrupted, and so is what the
    cache then serves for it."""
    tokenizer = tiny_tokenizer(VOCAB)
    texts = [" ".join(tokenizer.convert_ids_to_tokens(p)) for p in prompts()]
    model = bfloat16_llama()
    reference = SpeculativeEngine(model, tokenizer, PromptLookupDrafter(), num_speculative_tokens=4)
    expected = [r.text for r in reference.generate(texts, max_new_tokens=NEW_TOKENS)]
    engine = SpeculativeEngine(model, tokenizer, PromptLookupDrafter(), num_speculative_tokens=4)
    engine.open_caches(CacheOptions(draft_store=False))
    assert engine.response_cache is not None

    def complete(client, text):
        answer = client.completions.create(model=SERVED_MODEL, prompt=text, max_tokens=NEW_TOKENS, temperature=0)
        return answer.choices[0].text, answer.model_extra["speculative"]["cached"]

    with serving(create_app(engine, model_name=SERVED_MODEL, faults=CrashAt(25, 50))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(len(texts)) as pool:
            answered = list(pool.map(lambda t: complete(client, t), texts))
        again = [complete(client, t) for t in texts]
        assert metric(httpx.get(f"{url}/metrics").text, "specdecode:engine_worker_restarts_total") >= 1
    assert [text for text, _ in answered] == expected
    assert again == [(text, True) for text in expected]


def test_a_request_that_finished_in_the_step_a_crash_interrupted_gets_its_answer(tiny_model_dir, monkeypatch):
    """The crash comes after the step that ended the request (at its EOS), before its answer
    went out: it is answered as it stands, not stepped on past its end."""
    engine = SpeculativeEngine.from_pretrained(tiny_model_dir, cache=CacheOptions(response_cache=False))
    prompt = "w0 w2"  # the tiny model's greedy answer ends with its EOS after 10 tokens
    expected = engine.generate(prompt, max_new_tokens=30)[0]
    assert expected.finish_reason == "stop" and len(expected.token_ids) < 30
    deliver, crashed = EngineWorker._deliver, []

    def crash_once(self, emitted):
        if not crashed and any(seq.finish is not None for seq, _ in emitted):
            crashed.append(True)
            raise WorkerCrash("injected crash before a finished request was answered")
        deliver(self, emitted)

    monkeypatch.setattr(EngineWorker, "_deliver", crash_once)
    with serving(create_app(engine, model_name=SERVED_MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        choice = client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=30, temperature=0).choices[0]
    assert crashed
    assert (choice.text, choice.finish_reason) == (expected.text, "stop")
