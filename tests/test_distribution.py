"""Sampling keeps the target's distribution, checked statistically.

The engine samples new tokens many times; the empirical joint distribution of the second
and third (the first two of the first speculative step: the first token comes from the
prompt's prefill, before any draft) is compared with the target's exact one, computed
directly in float64 with an independent implementation of temperature / top-k / top-p. The G-test runs at
significance ALPHA (seeds are fixed, so a pass is reproducible). Each test also runs a
negative control that must fail: the same samples against the draft's distribution.
"""

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import power_divergence

from conftest import nearby_draft, permuted_vocabulary, tiny_gpt2, tiny_llama, tiny_tokenizer
from specdecode import SpeculativeEngine
from specdecode.adaptive import AdaptiveDrafter
from specdecode.drafters import CrossTokenizerDrafter, Draft, ModelDrafter, PromptLookupDrafter, self_quantized_drafter
from specdecode.kv_cache import HFModelRunner

ALPHA = 0.001
VOCAB = 12
PROMPT = [3, 5, 7, 2]
SKIP = 1  # new tokens before the tested window: the first comes from the prefill, undrafted
NUM_TOKENS = 2  # length of the window whose joint distribution is tested
SAMPLES = 2000


def reference_probs(logits: np.ndarray, temperature: float, top_k=None, top_p=None) -> np.ndarray:
    """Target distribution in float64, written independently of specdecode.sampling."""
    z = logits.astype(np.float64) / temperature
    if top_k is not None:
        z = np.where(z < np.sort(z)[-top_k], -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p is not None:
        order = np.argsort(-p, kind="stable")
        mass_before = np.cumsum(p[order]) - p[order]
        p[order[mass_before >= top_p]] = 0.0
        p /= p.sum()
    return p


def exact_joint(model, params) -> np.ndarray:
    """P(new tokens SKIP .. SKIP + NUM_TOKENS - 1 = t) for every t, flattened [VOCAB ** NUM_TOKENS]."""
    model64 = model.to(torch.float64)
    length = SKIP + NUM_TOKENS
    conditional = {}
    for prefix in itertools.chain.from_iterable(itertools.product(range(VOCAB), repeat=n) for n in range(length)):
        with torch.no_grad():
            logits = model64(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].numpy()
        conditional[prefix] = reference_probs(logits, **params)
    model.to(torch.float32)
    probs = np.ones([VOCAB] * length)
    for t in itertools.product(range(VOCAB), repeat=length):
        for n in range(length):
            probs[t] *= conditional[t[:n]][t[n]]
    return probs.sum(axis=tuple(range(SKIP))).reshape(-1)  # the skipped tokens summed out


def sample_counts(engine, k, params, seed) -> np.ndarray:
    # room for a whole first speculative step: k drafts and a bonus token after the skipped ones
    results = engine.generate([PROMPT] * SAMPLES, max_new_tokens=SKIP + max(k + 1, NUM_TOKENS), seed=seed, **params)
    counts = np.zeros(VOCAB**NUM_TOKENS)
    for r in results:
        counts[np.ravel_multi_index(r.token_ids[SKIP : SKIP + NUM_TOKENS], [VOCAB] * NUM_TOKENS)] += 1
    return counts


def g_test_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """G-test of counts against probs, pooling cells expected fewer than 5 times."""
    if counts[probs == 0].sum() > 0:
        return 0.0  # a sample the distribution cannot produce
    expected = probs * counts.sum()
    small = (expected < 5) & (probs > 0)
    observed = np.append(counts[~small & (probs > 0)], counts[small].sum())
    expected = np.append(expected[~small & (probs > 0)], expected[small].sum())
    if expected[-1] < 5:  # pool the leftovers into the smallest regular cell
        smallest = np.argmin(expected[:-1])
        observed[smallest] += observed[-1]
        expected[smallest] += expected[-1]
        observed, expected = observed[:-1], expected[:-1]
    assert len(expected) >= 2, "too few cells for a G-test: spread the distribution out"
    return power_divergence(observed, expected, lambda_="log-likelihood").pvalue


CASES = [
    # family, k, sampling params
    (tiny_llama, 1, dict(temperature=1.0)),
    (tiny_llama, 3, dict(temperature=0.7)),
    (tiny_llama, 5, dict(temperature=1.0, top_k=4)),
    (tiny_gpt2, 3, dict(temperature=1.0, top_p=0.8)),
    (tiny_gpt2, 5, dict(temperature=0.7, top_k=6, top_p=0.9)),
]
INIT = {tiny_llama: 0.3, tiny_gpt2: 0.2}  # weight scales that give spread-out distributions


def target_and_draft(family):
    target = family(seed=1, vocab_size=VOCAB, init=INIT[family])
    return target, nearby_draft(target, noise=0.5)  # accepts about 70% of the time


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


def test_adaptive_self_quantized_drafter_that_stops_when_unsure_keeps_target_distribution():
    """k changes from step to step with past acceptance, and drafts end where the draft is unsure."""
    params = dict(temperature=1.0)
    target, other = target_and_draft(tiny_llama)
    engine = SpeculativeEngine(target, num_speculative_tokens=3)
    drafter = self_quantized_drafter(target, "bfloat16", min_confidence=0.3)
    engine.drafter = AdaptiveDrafter(drafter, engine.step_costs)
    counts = sample_counts(engine, 3, params, seed=11)
    assert g_test_pvalue(counts, exact_joint(target, params)) > ALPHA
    assert g_test_pvalue(counts, exact_joint(other, params)) < ALPHA


def test_cross_tokenizer_drafter_keeps_target_distribution_when_sampling():
    """It drafts greedily through text: a deterministic, one-hot drafter, exact under sampling too."""
    params = dict(temperature=0.7)
    target, other = target_and_draft(tiny_llama)
    draft, draft_tokenizer = permuted_vocabulary(other)
    drafter = CrossTokenizerDrafter(HFModelRunner(draft), draft_tokenizer, tiny_tokenizer(VOCAB))
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
