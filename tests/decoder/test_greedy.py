"""Temperature 0: the engine's output equals transformers' own greedy generate, token for token."""

import math

import pytest

from helpers import (
    GREEDY_PROMPTS,
    adapting_on_acceptance,
    assert_drafted_and_accepted,
    hf_greedy,
    permuted_vocabulary,
    tiny_gpt2,
    tiny_llama,
    tiny_tokenizer,
)
from specdecode import SpeculativeEngine
from specdecode.drafters import (
    AutoDrafter,
    CrossTokenizerDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    self_quantized_drafter,
)
from specdecode.runners import HFModelRunner

PROMPTS = GREEDY_PROMPTS


def drafters(target, family):
    random_draft = family(seed=99)
    return {
        "random draft (mostly rejected)": ModelDrafter(HFModelRunner(random_draft)),
        "target as its own draft (all accepted)": ModelDrafter(HFModelRunner(target)),
        "prompt lookup": PromptLookupDrafter(),
        "prompt lookup, long n-grams, short copies": PromptLookupDrafter(2, 4, max_continuation=2, use_history=True),
        "self-quantized bfloat16": self_quantized_drafter(target, "bfloat16"),
        "self-quantized int8": self_quantized_drafter(target, "int8", min_confidence=0.5),
        "cross-tokenizer, random draft": CrossTokenizerDrafter(
            HFModelRunner(permuted_vocabulary(random_draft)[0]), permuted_vocabulary(random_draft)[1], tiny_tokenizer()
        ),
        # prompt lookup, which pays where the text repeats, and a draft that never pays (its k
        # adapts to 0); each tried first while its measurements rank it first
        "auto, adaptive": AutoDrafter([PromptLookupDrafter(), ModelDrafter(HFModelRunner(random_draft))]),
    }


@pytest.mark.parametrize("family", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_equals_transformers_generate_for_every_drafter(family, k, monkeypatch):
    target = family(seed=1)
    expected = [hf_greedy(target, prompt, 40) for prompt in PROMPTS]
    for name, drafter in drafters(target, family).items():
        adaptive = name.endswith("adaptive")
        engine = SpeculativeEngine(target, drafter=drafter, num_speculative_tokens=k, adaptive=adaptive)
        chosen = adapting_on_acceptance(engine, monkeypatch) if adaptive else []
        results = engine.generate(PROMPTS, max_new_tokens=40)
        assert [r.token_ids for r in results] == expected, name
        assert_drafted_and_accepted(results, name)
        if adaptive:
            assert len(set(chosen)) >= 2, (name, chosen)  # k really adapted


def test_acceptance_matches_the_drafter_quality():
    target = tiny_llama(seed=1)
    self_draft = SpeculativeEngine(target, drafter=ModelDrafter(HFModelRunner(target)), num_speculative_tokens=4)
    random_draft = SpeculativeEngine(
        target, drafter=ModelDrafter(HFModelRunner(tiny_llama(seed=99))), num_speculative_tokens=4
    )
    stats = self_draft.generate(PROMPTS[:1], max_new_tokens=40)[0].stats
    assert stats.acceptance_rate == 1.0
    # the first forward prefills the prompt alone and emits 1 token; each later one 4 drafts + 1 bonus
    assert stats.target_forwards == 1 + math.ceil((40 - 1) / 5)
    assert stats.drafted_histogram == {0: 1, 4: 7, 3: 1}  # the last draft fits the 40-token budget
    assert stats.accepted_per_position == stats.drafted_per_position
    assert random_draft.generate(PROMPTS[:1], max_new_tokens=40)[0].stats.acceptance_rate < 0.5


def test_target_only_mode_runs_the_same_loop_with_one_token_per_forward():
    target = tiny_gpt2(seed=1)
    engine = SpeculativeEngine(target, drafter=PromptLookupDrafter(), num_speculative_tokens=4)
    result = engine.generate(PROMPTS[:1], max_new_tokens=30, speculative=False)[0]
    assert result.token_ids == hf_greedy(target, PROMPTS[0], 30)
    assert result.stats.drafter == "none"
    assert result.stats.target_forwards == 30
    assert result.stats.drafted_tokens == 0


def test_generation_stops_at_the_context_window():
    target = tiny_llama(seed=1, max_positions=24)
    engine = SpeculativeEngine(target, drafter=PromptLookupDrafter(), num_speculative_tokens=4)
    result = engine.generate([PROMPTS[0]], max_new_tokens=100)[0]
    assert len(PROMPTS[0]) + len(result.token_ids) == 24
    assert result.finish_reason == "length"
    assert result.token_ids == hf_greedy(target, PROMPTS[0], 20)
