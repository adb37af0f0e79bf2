"""Prefix reuse (runners/slots.py): a slot given back keeps what its sequence cached, and a new
sequence whose prompt starts with those tokens prefills only the rest. Where the runner declares
`reuses_prefixes` (the C layers: every row of a prefill a function of that row and the keys its
query sees) the rest's rows are bitwise those of the whole prompt's prefill, so speculative
decoding stays token for token (and seeded samples draw for draw) the target's; a draft head
gets the reused positions' hidden states as a prefill would have given them.
"""

import pytest
import torch

from helpers import assert_drafted_and_accepted, head64_llama, same_bits
from helpers.bits import c_layers_run_here
from specdecode import SpeculativeEngine
from specdecode.cache.engine_caches import CacheOptions
from specdecode.drafters import PromptLookupDrafter
from specdecode.drafters.head import HeadDrafter, head_config, new_head
from specdecode.runners import HFModelRunner
from specdecode.runners.fast_llama import FastLlamaRunner, Int8Recipe
from specdecode.runners.slots import SlotPool

SYSTEM = list(range(100, 140))  # a prefix the prompts share, as a chat template's system prompt
PROMPTS = [
    SYSTEM + [7, 8, 9, 10, 11] * 6,
    SYSTEM + list(range(40, 80)),
    SYSTEM + [3, 1, 4, 1, 5, 9, 2, 6] * 4,
]


pytestmark = pytest.mark.skipif(not c_layers_run_here(), reason="no own w8a8 product or no gcc here")


def c_runner(model=None) -> FastLlamaRunner:
    runner = FastLlamaRunner(model if model is not None else head64_llama(0), "w8a8", Int8Recipe())
    assert runner.layer_kernel is not None and runner.reuses_prefixes
    return runner


def torch_runner() -> FastLlamaRunner:
    """The same w8a8 model on torch operations (SDPA prefills a prompt's rows together)."""
    runner = FastLlamaRunner(head64_llama(0), "w8a8", Int8Recipe())
    runner._int8_layers = None  # as where int8_layer.load() gave None
    return runner


def prefill_then_decode(pool: SlotPool, slot: int, prompt: list[int], start: int, steps: int = 4) -> torch.Tensor:
    """The prefill's logits after prompt[start:] (prompt[:start] cached), then `steps` greedy tokens'."""
    rows = [pool.forward([slot], [torch.tensor(prompt[start:])], [1])[0]]
    for _ in range(steps):
        rows.append(pool.forward([slot], [rows[-1].argmax(-1)], [1])[0])
    return torch.cat(rows)


def suffix_against_whole(runner: FastLlamaRunner, cached: list[int] = PROMPTS[0]) -> tuple[torch.Tensor, torch.Tensor]:
    """PROMPTS[1] prefilled after the prefix a slot kept from PROMPTS[0] (the slot having
    cached `cached`), and prefilled whole."""
    pool = SlotPool(runner)
    first = pool.acquire()
    pool.forward([first], [torch.tensor(cached)], [1])
    pool.release(first, PROMPTS[0])
    slot, reused, _ = pool.acquire_reusing(PROMPTS[1])
    assert (slot, reused) == (first, len(SYSTEM))
    suffix = prefill_then_decode(pool, slot, PROMPTS[1], reused)
    alone = SlotPool(runner)
    whole = prefill_then_decode(alone, alone.acquire(), PROMPTS[1], 0)
    return suffix, whole


def test_a_prompt_after_a_kept_prefix_gets_the_bits_of_its_whole_prefill():
    suffix, whole = suffix_against_whole(c_runner())
    assert same_bits(suffix, whole)


def test_the_suffix_reads_the_kept_positions():
    """Negative control: a slot that says it holds the shared prefix but cached other tokens
    gives the suffix other logits (the comparison above sees what the kept cache holds)."""
    runner = c_runner()
    suffix, whole = suffix_against_whole(runner, cached=[1] * len(SYSTEM) + PROMPTS[0][len(SYSTEM) :])
    assert not same_bits(suffix, whole)


def test_only_the_c_layers_declare_it():
    runner = torch_runner()
    assert not runner.reuses_prefixes and not SlotPool(runner).reuses_prefixes
    assert not SlotPool(HFModelRunner(head64_llama(0))).reuses_prefixes


def test_a_new_sequence_takes_the_free_slot_with_its_longest_prefix_else_the_longest_free():
    pool = SlotPool(c_runner())
    slots = [pool.acquire() for _ in range(3)]
    for slot, prompt in zip(slots, PROMPTS):
        pool.forward([slot], [torch.tensor(prompt)], [1])
    for slot, prompt in zip(slots, PROMPTS):
        pool.release(slot, prompt)
    assert pool.acquire_reusing(PROMPTS[2] + [5, 5])[:2] == (slots[2], len(PROMPTS[2]))
    assert pool.acquire_reusing(PROMPTS[1])[:2] == (slots[1], len(PROMPTS[1]) - 1)  # its last token runs
    assert pool.acquire_reusing([1, 2, 3])[:2] == (slots[0], 0)  # nothing shared: the longest free
    assert pool.slots[slots[0]].cache_length == 0


def test_off_a_slot_keeps_nothing():
    pool = SlotPool(c_runner(), reuse_prefixes=False)
    slot = pool.acquire()
    pool.forward([slot], [torch.tensor(PROMPTS[0])], [1])
    pool.release(slot, PROMPTS[0])
    assert pool.slots[slot].cache_length == 0
    assert pool.acquire_reusing(PROMPTS[0])[:2] == (slot, 0)


def engine_with(drafter, prefix_cache: bool = True, k: int = 6) -> SpeculativeEngine:
    engine = SpeculativeEngine(c_runner(), drafter=drafter, num_speculative_tokens=k)  # k pinned
    engine.open_caches(CacheOptions(response_cache=False, draft_store=False, prefix_cache=prefix_cache))
    return engine


def test_greedy_speculation_over_reused_prefixes_equals_target_only_decoding_without():
    plain = engine_with(None, prefix_cache=False)
    target_only = [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=40, speculative=False)]
    assert all(r.stats.prompt_tokens_reused == 0 for r in plain.generate(PROMPTS, max_new_tokens=4))
    engine = engine_with(PromptLookupDrafter())
    for batch in (1, 3, 3):  # one slot, then three new ones, then each prompt's own
        results = engine.generate(PROMPTS, max_new_tokens=40, max_batch_size=batch)
        assert [r.token_ids for r in results] == target_only
        assert_drafted_and_accepted(results)
    assert [r.stats.prompt_tokens_reused for r in results] == [len(p) - 2 for p in PROMPTS]
    reused_system = engine.generate([SYSTEM + [9, 9, 9]], max_new_tokens=40)[0]
    assert reused_system.stats.prompt_tokens_reused == len(SYSTEM)
    assert reused_system.token_ids == plain.generate([SYSTEM + [9, 9, 9]], max_new_tokens=40)[0].token_ids


def test_seeded_samples_over_reused_prefixes_repeat_those_without():
    params = dict(temperature=0.9, seed=7)
    plain = engine_with(PromptLookupDrafter(), prefix_cache=False)
    engine = engine_with(PromptLookupDrafter())
    expected = [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=30, **params)]
    engine.generate(PROMPTS, max_new_tokens=30, max_batch_size=3, **params)
    again = engine.generate(PROMPTS, max_new_tokens=30, max_batch_size=3, **params)
    assert [r.stats.prompt_tokens_reused for r in again] == [len(p) - 2 for p in PROMPTS]
    assert [r.token_ids for r in again] == expected


def head_drafter(model) -> HeadDrafter:
    vocabulary = torch.arange(model.config.vocab_size)
    layers = (model.config.num_hidden_layers,)
    return HeadDrafter(new_head(model, head_config(model, layers, len(vocabulary), "tiny"), vocabulary, 0))


def test_a_draft_head_drafts_from_the_reused_positions_as_from_a_prefill(monkeypatch):
    model = head64_llama(0)
    runs = {}
    for name, prefix_cache in (("plain", False), ("reused", True)):
        engine = SpeculativeEngine(c_runner(model), drafter=head_drafter(model), num_speculative_tokens=3)
        engine.open_caches(CacheOptions(response_cache=False, draft_store=False, prefix_cache=prefix_cache))
        engine.generate(PROMPTS, max_new_tokens=20, max_batch_size=3)  # the slots now hold these prompts and answers
        runs[name] = engine.generate(PROMPTS, max_new_tokens=20, max_batch_size=3)
    plain, reused = runs["plain"], runs["reused"]
    assert [r.stats.prompt_tokens_reused for r in reused] == [len(p) - 2 for p in PROMPTS]
    assert [r.token_ids for r in reused] == [r.token_ids for r in plain]
    assert [r.stats.drafted_tokens for r in reused] == [r.stats.drafted_tokens for r in plain]
    assert [r.stats.accepted_tokens for r in reused] == [r.stats.accepted_tokens for r in plain]
    assert all(r.stats.drafted_tokens for r in reused)
    # without the kept hidden states, the head would have had nothing to draft from
    acquire = SlotPool.acquire_reusing
    monkeypatch.setattr(SlotPool, "acquire_reusing", lambda *a: acquire(*a)[:2] + (None,))
    blind = engine.generate(PROMPTS, max_new_tokens=20, max_batch_size=3)
    assert [r.token_ids for r in blind] == [r.token_ids for r in plain]
    assert all(r.stats.drafted_tokens == 0 for r in blind)


def test_after_an_engine_crash_no_slot_offers_what_it_held():
    engine = engine_with(PromptLookupDrafter())
    engine.generate(PROMPTS, max_new_tokens=8, max_batch_size=3)
    assert engine.generate(PROMPTS[:1], max_new_tokens=8)[0].stats.prompt_tokens_reused == len(PROMPTS[0]) - 2
    engine.decoder.reset()  # what the server's worker does after a crash
    assert all(r.stats.prompt_tokens_reused == 0 for r in engine.generate(PROMPTS, max_new_tokens=8, max_batch_size=3))


def prefill_rows(monkeypatch) -> list[int]:
    """The rows of every prefill forward (one new token's logits asked per sequence) from now on."""
    rows: list[int] = []
    forward = SlotPool.forward

    def spy(self, slots, token_ids, num_logits, *args):
        if any(len(t) > n for t, n in zip(token_ids, num_logits)):
            rows.append(sum(len(t) for t in token_ids))
        return forward(self, slots, token_ids, num_logits, *args)

    monkeypatch.setattr(SlotPool, "forward", spy)
    return rows


@pytest.mark.parametrize("drafter", ["lookup", "head"])
def test_a_prompt_sent_several_times_in_one_step_is_prefilled_once(monkeypatch, drafter):
    """The n choices of a request (or one prompt sent twice) share one prefill: the others copy
    its rows, and decode as if each had run its own (greedy and seeded samples alike; a draft
    head gets the copied rows' hidden states)."""
    model = head64_llama(0)
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    runs = {}
    for prefix_cache in (False, True):
        make = (lambda: PromptLookupDrafter()) if drafter == "lookup" else (lambda: head_drafter(model))
        engine = SpeculativeEngine(c_runner(model), drafter=make(), num_speculative_tokens=3)
        engine.open_caches(CacheOptions(response_cache=False, draft_store=False, prefix_cache=prefix_cache))
        rows = prefill_rows(monkeypatch)
        greedy = engine.generate(prompts, max_new_tokens=20, max_batch_size=4)
        seeded = engine.generate(prompts[:1] * 3, max_new_tokens=20, max_batch_size=3, temperature=0.9, seed=3)
        runs[prefix_cache] = greedy, seeded, rows
        monkeypatch.undo()
    (greedy_alone, seeded_alone, rows_alone), (greedy, seeded, rows) = runs[False], runs[True]
    assert rows_alone[0] == sum(map(len, prompts))
    assert rows[0] == len(PROMPTS[1]) + len(PROMPTS[0])  # each prompt once
    for results, alone in ((greedy, greedy_alone), (seeded, seeded_alone)):
        assert [r.token_ids for r in results] == [r.token_ids for r in alone]
        assert [r.stats.drafted_tokens for r in results] == [r.stats.drafted_tokens for r in alone]
    if drafter == "lookup":
        assert_drafted_and_accepted(greedy)
    else:  # an untrained head drafts (from the copied rows' states too), and is rarely right
        assert all(r.stats.drafted_tokens for r in greedy)
