"""Continuous batching (decoder.py, runners/slots.py): every sequence gets what it gets alone."""

import numpy as np
import pytest
import torch

from helpers import (
    DIST_VOCAB,
    NUM_TOKENS,
    PROMPT,
    SKIP,
    assert_drafted_and_accepted,
    exact_joint,
    g_test_pvalue,
    hf_greedy,
    nearby_draft,
    target_and_draft,
    tiny_gpt2,
    tiny_llama,
)
from specdecode import SpeculativeEngine
from specdecode import decoder as decoder_module
from specdecode.core.adaptive import AdaptiveK, StepCosts
from specdecode.core.sampling import SamplingParams
from specdecode.core.stopping import StoppingCriteria
from specdecode.decoder import SequenceState, decode_all
from specdecode.drafters import ModelDrafter, PromptLookupDrafter
from specdecode.engine import make_generator
from specdecode.errors import InvalidArgumentError, PromptTooLongError
from specdecode.runners import HFModelRunner
from specdecode.runners.fast_llama import FastLlamaRunner
from specdecode.runners.slots import SLOT_CAPACITY, SlotPool, kv_bytes_per_token

PROMPTS = [[3, 5, 7, 2], [1, 1, 4, 9, 16, 9, 4], [20, 3, 20, 3, 20], [2], [7, 7, 7, 7, 7, 7, 7, 7, 7, 1]]


def test_a_batched_forward_gives_each_sequence_its_own_logits():
    """Ragged prefills, then ragged steps after ragged cache lengths, against one sequence at a time."""
    model = tiny_llama(seed=3)
    batched, alone = SlotPool(FastLlamaRunner(model)), FastLlamaRunner(model)
    assert [batched.acquire() for _ in range(3)] == [0, 1, 2]
    steps = [  # per step: the new tokens of slots 0, 1, 2
        [[1, 2, 3], [4, 5, 6, 7, 8], [9]],
        [[10], [11, 12, 13], [14, 15]],
        [[16, 17], [18], [19, 20, 21, 22]],
    ]
    history = [[], [], []]
    for step in steps:
        got = batched.forward([0, 1, 2], [torch.tensor(t) for t in step], [len(t) for t in step])
        for slot, tokens in enumerate(step):
            history[slot] += tokens
            alone.reset()
            expected = alone.forward(torch.tensor(history[slot]), len(tokens))
            torch.testing.assert_close(got[slot], expected, atol=1e-5, rtol=1e-5)
    assert [batched.slots[s].cache_length for s in range(3)] == [6, 9, 7]


@pytest.mark.parametrize("family", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("drafter", [PromptLookupDrafter(), None], ids=["prompt-lookup", "target-only"])
@pytest.mark.parametrize("max_batch_size", [2, 8])
def test_greedy_batched_output_equals_transformers_generate(family, drafter, max_batch_size):
    """Sequences join as others finish (5 prompts, 2 slots) and accept ragged numbers of tokens."""
    target = family(seed=1)
    engine = SpeculativeEngine(target, drafter=drafter, num_speculative_tokens=4)
    results = engine.generate(PROMPTS, max_new_tokens=30, max_batch_size=max_batch_size)
    assert [r.token_ids for r in results] == [hf_greedy(target, p, 30) for p in PROMPTS]
    if drafter is not None:
        assert_drafted_and_accepted(results)  # drafts were verified in batches


MIXED = [dict(temperature=1.0), dict(temperature=0.7, top_k=4)]
SAMPLES = 1500


def test_batched_sampling_with_mixed_params_keeps_each_target_distribution():
    """Sequences of two sampling settings, prompt lookup, k = 3, decoded 8 at a time; each
    setting's tokens 2 and 3 (the first speculative step's) pass a G-test against the target
    and fail against the draft."""
    target, other = target_and_draft(tiny_llama)
    engine = SpeculativeEngine(target, drafter=PromptLookupDrafter(), num_speculative_tokens=3)
    engine.decoder.capacity = 8
    waiting = [
        SequenceState(
            PROMPT,
            SamplingParams(**MIXED[i % 2]),
            StoppingCriteria(SKIP + 4),
            torch.Generator().manual_seed(i),
            (engine.drafter.fork(),),
            k_max=3,
        )
        for i in range(2 * SAMPLES)
    ]
    decode_all(engine.decoder, waiting)
    assert sum(s.stats.accepted_tokens for s in waiting) > 0
    for i, params in enumerate(MIXED):
        counts = np.zeros(DIST_VOCAB**NUM_TOKENS)
        for seq in waiting[i::2]:
            counts[np.ravel_multi_index(seq.generated[SKIP : SKIP + NUM_TOKENS], [DIST_VOCAB] * NUM_TOKENS)] += 1
        assert g_test_pvalue(counts, exact_joint(target, params)) > 0.001, params
        assert g_test_pvalue(counts, exact_joint(other, params)) < 0.001, params  # negative control


def test_seeded_sampling_repeats_whatever_else_is_in_the_batch():
    target = tiny_llama(seed=1)
    engine = SpeculativeEngine(target, drafter=PromptLookupDrafter(), num_speculative_tokens=3)
    alone = engine.generate(PROMPTS[:1], max_new_tokens=20, temperature=1.0, seed=5, max_batch_size=1)
    crowded = engine.generate(PROMPTS, max_new_tokens=20, temperature=1.0, seed=5, max_batch_size=4)
    assert crowded[0].token_ids == alone[0].token_ids


def test_k_falls_to_plain_batched_decoding_when_a_big_batch_makes_drafts_expensive():
    """One forward costs about the same for 1 to 5 tokens, but grows with tokens past that."""
    costs = StepCosts()
    for tokens in (1, 2, 5, 8, 16, 40):
        costs.record(tokens, 0.033 if tokens <= 5 else 0.033 * tokens / 5)
    policy = AdaptiveK(costs)
    policy.record_draft(4, 0.0004)
    for _ in range(20):
        policy.record_verdict(4, 1)  # the first draft token is accepted, the second never
    assert policy.choose(4, batch_size=1) > 0
    assert policy.choose(4, batch_size=8) == 0


def test_a_draft_model_drafts_one_sequence_at_a_time_and_stays_exact():
    """A draft model holds one cache, so its batches hold one sequence; the output is still exact."""
    target = tiny_llama(seed=1)
    engine = SpeculativeEngine(target, drafter=ModelDrafter(HFModelRunner(target)), num_speculative_tokens=3)
    assert not engine.drafts_in_batches
    results = engine.generate(PROMPTS, max_new_tokens=20, max_batch_size=8)
    assert [r.token_ids for r in results] == [hf_greedy(target, p, 20) for p in PROMPTS]
    assert_drafted_and_accepted(results)


def test_seeded_sampling_with_an_adaptive_draft_model_ignores_what_ran_before():
    """Seeded samples must not depend on the engine's history: an earlier generate() call
    measures costs and acceptance, and still the seeded batch drafts its most k every step
    and samples what a fresh engine samples."""
    target = tiny_llama(seed=1)

    def engine():
        drafter = ModelDrafter(HFModelRunner(nearby_draft(target, 0.5)))
        return SpeculativeEngine(target, drafter=drafter, num_speculative_tokens=4, adaptive=True)

    seeded = dict(max_new_tokens=16, temperature=1.0, seed=3, max_batch_size=4)
    fresh = engine().generate(PROMPTS, **seeded)
    used = engine()
    used.generate(PROMPTS[:2], max_new_tokens=40)  # greedy and unseeded: k adapts to what it measures
    again = used.generate(PROMPTS, **seeded)
    assert [r.token_ids for r in again] == [r.token_ids for r in fresh]
    assert all(r.stats.k_policy == "fixed" for r in again)


def test_each_sequence_has_its_own_k_limit():
    """A sequence with k = 0 drafts nothing while its neighbours in the batch draft."""
    target = tiny_llama(seed=1)
    engine = SpeculativeEngine(target, drafter=PromptLookupDrafter(), num_speculative_tokens=4)
    settings = [engine.settings(max_new_tokens=30, num_speculative_tokens=k) for k in (0, 4, 2)]
    sequences = [engine.sequence(PROMPTS[4], s, make_generator(None)) for s in settings]
    engine.decoder.capacity = 3
    decode_all(engine.decoder, sequences)
    drafted = [s.stats.drafted_tokens for s in sequences]
    assert drafted[0] == 0 and drafted[1] > 0 and drafted[2] > 0
    assert max(s.stats.drafted_histogram for s in sequences[2:]) and max(sequences[2].stats.drafted_histogram) <= 2
    assert len({tuple(s.generated) for s in sequences}) == 1  # greedy: the same text whatever k
    by_call = engine.generate([PROMPTS[4]], max_new_tokens=30, num_speculative_tokens=0)[0]
    assert by_call.stats.drafted_tokens == 0 and by_call.token_ids == sequences[0].generated


@pytest.mark.parametrize("phase", ["before the forward", "after the forward"])
def test_a_step_that_fails_changes_nothing_and_its_retry_gives_the_same_output(phase):
    """All or nothing: a step that raises (here in the third sequence's verdict, after the first
    two sequences' verdicts were taken, or before the forward) leaves every sequence as it was,
    generators included, so retrying it gives exactly the uninterrupted output, EOS included."""
    target = tiny_llama(seed=1)
    target.generation_config.eos_token_id = 5  # finishes some sequences mid-batch
    engine = SpeculativeEngine(target, drafter=PromptLookupDrafter(), num_speculative_tokens=3)
    kwargs = dict(max_new_tokens=25, temperature=1.0, seed=11, max_batch_size=4)
    expected = [r.token_ids for r in engine.generate(PROMPTS, **kwargs)]

    calls = {"n": 0}
    real_verify, real_forward = decoder_module.verify_logits, decoder_module.Decoder._verify

    def flaky_verify(*args):
        calls["n"] += 1
        if phase == "after the forward" and calls["n"] % 7 == 3:
            raise RuntimeError("injected fault after the forward")
        return real_verify(*args)

    def flaky_forward(self, sequences, drafts, *rest):  # rest: what else the forward is asked for
        calls["n"] += 1
        if phase == "before the forward" and calls["n"] % 4 == 2:
            raise RuntimeError("injected fault before the forward")
        return real_forward(self, sequences, drafts, *rest)

    failures = 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decoder_module, "verify_logits", flaky_verify)
        patch.setattr(decoder_module.Decoder, "_verify", flaky_forward)
        fresh = SpeculativeEngine(target, drafter=PromptLookupDrafter(), num_speculative_tokens=3)
        settings = fresh.settings(max_new_tokens=25, temperature=1.0, seed=11)
        sequences = [fresh.sequence(p, settings, make_generator(11 + i)) for i, p in enumerate(PROMPTS)]
        decoder, waiting = fresh.decoder, list(sequences)
        decoder.capacity = 4
        while waiting or decoder.active:
            while waiting and decoder.has_room:
                decoder.add(waiting.pop(0))
            before = [
                (list(s.tokens), s.cached, s.stats.target_forwards, s.generator.get_state()) for s in decoder.active
            ]
            try:
                emitted = decoder.step()
            except RuntimeError:
                failures += 1
                after = [
                    (list(s.tokens), s.cached, s.stats.target_forwards, s.generator.get_state()) for s in decoder.active
                ]
                assert all(b[:3] == a[:3] and torch.equal(b[3], a[3]) for b, a in zip(before, after))
                continue
            for seq, _ in emitted:
                if seq.finish is not None:
                    decoder.remove(seq)
    assert failures > 3
    assert [s.generated for s in sequences] == expected
    assert any(s.finish.reason == "stop" for s in sequences)  # an EOS was among the retried steps' outcomes


@pytest.mark.parametrize("runner", ["fast", "transformers"])
def test_a_long_sequence_gives_its_slot_memory_back_and_the_slot_stays_exact(runner):
    """A sequence longer than a slot's initial capacity grows its cache; once it finishes the
    slot shrinks back (the fast runners' StaticKVCache) or drops its cache (transformers'),
    and the next sequences in that slot are still transformers' greedy output."""
    target = tiny_llama(seed=1, max_positions=512)
    engine = SpeculativeEngine(target, drafter=PromptLookupDrafter(), num_speculative_tokens=4, runner=runner)
    long = engine.generate(PROMPTS[:1], max_new_tokens=300, max_batch_size=1)[0]
    assert len(long.prompt_token_ids) + len(long.token_ids) > SLOT_CAPACITY  # it outgrew the slot
    assert long.token_ids == hf_greedy(target, PROMPTS[0], 300)
    (slot,) = engine.decoder.slots.slots
    if runner == "fast":
        assert slot.cache.capacity == SLOT_CAPACITY and slot.cache.keys[0].shape[1] == SLOT_CAPACITY
    else:
        assert not any(layer.is_initialized for layer in slot._cache.layers)  # no tensors held
    results = engine.generate(PROMPTS, max_new_tokens=30, max_batch_size=1)
    assert [r.token_ids for r in results] == [hf_greedy(target, p, 30) for p in PROMPTS]


def test_max_model_len_ends_sequences_and_bounds_the_slot_caches():
    target = tiny_llama(seed=1)  # a context of 128
    engine = SpeculativeEngine(target, drafter=PromptLookupDrafter(), num_speculative_tokens=4, max_model_len=20)
    assert engine.max_model_len == engine.decoder.max_length == 20
    results = engine.generate(PROMPTS[:2], max_new_tokens=100, max_batch_size=2)
    for prompt, result in zip(PROMPTS, results):
        assert result.finish_reason == "length" and len(prompt) + len(result.token_ids) == 20
        assert result.token_ids == hf_greedy(target, prompt, 20 - len(prompt))
    assert all(slot.cache.capacity <= 20 for slot in engine.decoder.slots.slots)
    with pytest.raises(PromptTooLongError, match="the prompt has 20 tokens but max_model_len is 20"):
        engine.generate([list(range(20))])
    view = engine.with_drafter(None, 0)
    assert view.decoder.max_length == 20
    for bad in (129, 1):
        with pytest.raises(InvalidArgumentError, match=r"max_model_len must be in \[2, 128\]") as error:
            SpeculativeEngine(target, max_model_len=bad)
        assert error.value.param == "max_model_len"


def test_a_view_shares_the_measured_step_costs_but_not_the_acceptance():
    """A view's decoder starts from the step costs its engine measured (the runner's, on this
    machine), not from nothing, and what it measures the engine knows; its drafters' acceptance
    stays its own. Its greedy text is still the target's, with drafts kept."""
    target = tiny_llama(seed=1)
    engine = SpeculativeEngine(target, drafter=PromptLookupDrafter(), num_speculative_tokens=4)
    engine.generate(PROMPTS[:2], max_new_tokens=30)
    measured = dict(engine.decoder.costs.seconds)
    assert measured and engine.decoder.policies  # something to share, and something not to
    view = engine.with_drafter(PromptLookupDrafter(), 4, adaptive=True)
    assert view.decoder.costs is engine.decoder.costs and view.decoder.costs.seconds == measured
    assert view.decoder.policies == {}
    [result] = view.generate(PROMPTS[2:3], max_new_tokens=30)
    assert result.token_ids == hf_greedy(target, PROMPTS[2], 30) and result.stats.accepted_tokens > 0
    assert all(policy is not engine.decoder.policies.get(key) for key, policy in view.decoder.policies.items())


@pytest.mark.parametrize("family", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("runner", ["fast", "transformers"])
def test_kv_bytes_per_token_is_what_a_cache_position_takes(family, runner):
    model = family(seed=1)
    engine = SpeculativeEngine(model, runner=runner)
    heads = 2 if family is tiny_llama else 4  # the llama has 2 key/value heads for its 4 query heads
    assert kv_bytes_per_token(engine.target_runner) == 2 * 2 * heads * 8 * 4  # keys and values, layers, dim 8, f32
    if runner == "fast":  # what the runner's StaticKVCache really holds per position
        cache = engine.target_runner.cache
        assert cache.nbytes == cache.capacity * kv_bytes_per_token(engine.target_runner)
