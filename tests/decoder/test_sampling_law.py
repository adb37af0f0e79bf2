"""Sampling keeps the target's distribution, checked statistically.

The engine samples new tokens many times; the empirical joint distribution of the second
and third (the first two of the first speculative step: the first token comes from the
prompt's prefill, before any draft) is compared with the target's exact one, computed
directly in float64 with an independent implementation of temperature / top-k / top-p. The G-test runs at
significance ALPHA (seeds are fixed, so a pass is reproducible). Each test also runs a
negative control that must fail: the same samples against the draft's distribution.
"""

import numpy as np
import pytest
import torch

from helpers import (
    ALPHA,
    DIST_VOCAB,
    NUM_TOKENS,
    PROMPT,
    SAMPLES,
    SKIP,
    adapting_on_acceptance,
    exact_joint,
    g_test_pvalue,
    permuted_vocabulary,
    sample_counts,
    target_and_draft,
    tiny_gpt2,
    tiny_llama,
    tiny_tokenizer,
)
from specdecode import SpeculativeEngine
from specdecode.decoder import decode_all
from specdecode.drafters import CrossTokenizerDrafter, Draft, ModelDrafter, PromptLookupDrafter, self_quantized_drafter
from specdecode.runners import HFModelRunner

CASES = [
    # family, k, sampling params
    (tiny_llama, 1, dict(temperature=1.0)),
    (tiny_llama, 3, dict(temperature=0.7)),
    (tiny_llama, 5, dict(temperature=1.0, top_k=4)),
    (tiny_gpt2, 3, dict(temperature=1.0, top_p=0.8)),
    (tiny_gpt2, 5, dict(temperature=0.7, top_k=6, top_p=0.9)),
]


@pytest.mark.parametrize(
    "family,k,params", CASES, ids=[f"{f.__name__}-k{k}-{'-'.join(map(str, p.values()))}" for f, k, p in CASES]
)
def test_model_drafter_keeps_target_distribution(family, k, params):
    target, draft = target_and_draft(family)
    engine = SpeculativeEngine(target, drafter=ModelDrafter(HFModelRunner(draft)), num_speculative_tokens=k)
    counts = sample_counts(engine, k, params, seed=1234)
    assert g_test_pvalue(counts, exact_joint(target, params)) > ALPHA
    # negative control: the test has the power to reject the draft's distribution
    assert g_test_pvalue(counts, exact_joint(draft, params)) < ALPHA


def test_target_as_its_own_draft_keeps_target_distribution():
    """Every draft is accepted, so every step ends with a bonus token."""
    params = dict(temperature=1.0)
    target, other = target_and_draft(tiny_llama)
    engine = SpeculativeEngine(target, drafter=ModelDrafter(HFModelRunner(target)), num_speculative_tokens=3)
    counts = sample_counts(engine, 3, params, seed=5)
    assert g_test_pvalue(counts, exact_joint(target, params)) > ALPHA
    assert g_test_pvalue(counts, exact_joint(other, params)) < ALPHA


def test_one_hot_prompt_lookup_keeps_target_distribution():
    params = dict(temperature=1.0)
    target, other = target_and_draft(tiny_llama)
    engine = SpeculativeEngine(target, drafter=PromptLookupDrafter(min_ngram=1), num_speculative_tokens=3)
    counts = sample_counts(engine, 3, params, seed=7)
    assert g_test_pvalue(counts, exact_joint(target, params)) > ALPHA
    assert g_test_pvalue(counts, exact_joint(other, params)) < ALPHA


def test_adaptive_self_quantized_drafter_that_stops_when_unsure_keeps_target_distribution(monkeypatch):
    """k changes from step to step with past acceptance, and drafts end where the draft is unsure.
    Unseeded requests (a seed would hold k at its most), drawn from one seeded generator."""
    params = dict(temperature=1.0)
    target, other = target_and_draft(tiny_llama)
    drafter = self_quantized_drafter(target, "bfloat16", min_confidence=0.3)
    engine = SpeculativeEngine(target, drafter=drafter, num_speculative_tokens=3, adaptive=True)
    chosen = adapting_on_acceptance(engine, monkeypatch)
    settings = engine.settings(max_new_tokens=SKIP + 4, temperature=params["temperature"])
    generator = torch.Generator().manual_seed(11)
    sequences = [engine.sequence(PROMPT, settings, generator, fork=False) for _ in range(SAMPLES)]
    decode_all(engine.decoder, sequences)
    counts = np.zeros(DIST_VOCAB**NUM_TOKENS)
    for seq in sequences:
        counts[np.ravel_multi_index(seq.generated[SKIP : SKIP + NUM_TOKENS], [DIST_VOCAB] * NUM_TOKENS)] += 1
    assert len(set(chosen)) >= 2, set(chosen)  # k really adapted
    assert all(seq.stats.k_policy == "adaptive" for seq in sequences)
    assert g_test_pvalue(counts, exact_joint(target, params)) > ALPHA
    assert g_test_pvalue(counts, exact_joint(other, params)) < ALPHA


def test_cross_tokenizer_drafter_keeps_target_distribution_when_sampling():
    """It drafts greedily through text: a deterministic, one-hot drafter, exact under sampling too."""
    params = dict(temperature=0.7)
    target, other = target_and_draft(tiny_llama)
    draft, draft_tokenizer = permuted_vocabulary(other)
    drafter = CrossTokenizerDrafter(HFModelRunner(draft), draft_tokenizer, tiny_tokenizer(DIST_VOCAB))
    engine = SpeculativeEngine(target, drafter=drafter, num_speculative_tokens=3)
    counts = sample_counts(engine, 3, params, seed=13)
    assert g_test_pvalue(counts, exact_joint(target, params)) > ALPHA
    assert g_test_pvalue(counts, exact_joint(other, params)) < ALPHA


def test_negative_control_a_classic_bug_is_caught():
    """Reporting q before temperature while sampling after it breaks exactness; the test must see it."""
    params = dict(temperature=0.5)
    target, draft = target_and_draft(tiny_llama)

    class TemperatureBugDrafter(ModelDrafter):
        def propose(self, token_ids, k, params, generator):
            draft = super().propose(token_ids, k, params, generator)
            # q at temperature 1, recovered from q at temperature T: softmax(T * log q_T)
            return Draft(draft.tokens, torch.softmax(params.temperature * draft.probs.log(), dim=-1))

    engine = SpeculativeEngine(target, drafter=TemperatureBugDrafter(HFModelRunner(draft)), num_speculative_tokens=3)
    counts = sample_counts(engine, 3, params, seed=99)
    assert g_test_pvalue(counts, exact_joint(target, params)) < ALPHA
