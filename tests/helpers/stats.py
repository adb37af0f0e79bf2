"""The sampling tests' statistics: the target's exact law over a window of tokens, sample
counts from the engine, and the G-test."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy.stats import power_divergence

from helpers.models import nearby_draft, tiny_gpt2, tiny_llama

# --- sampling: the target's exact law and the G-test (test_distribution.py, test_batching.py) ---

ALPHA = 0.001
DIST_VOCAB = 12  # vocabulary of the sampling tests' models: small enough to enumerate
PROMPT = [3, 5, 7, 2]
SKIP = 1  # new tokens before the tested window: the first comes from the prefill, undrafted
NUM_TOKENS = 2  # length of the window whose joint distribution is tested
SAMPLES = 2000


def reference_probs(logits: np.ndarray, temperature: float, top_k=None, top_p=None) -> np.ndarray:
    """Target distribution in float64, written independently of specdecode.core.sampling."""
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
    """P(new tokens SKIP .. SKIP + NUM_TOKENS - 1 = t) for every t, flattened [DIST_VOCAB ** NUM_TOKENS]."""
    model64 = model.to(torch.float64)
    length = SKIP + NUM_TOKENS
    conditional = {}
    for prefix in itertools.chain.from_iterable(itertools.product(range(DIST_VOCAB), repeat=n) for n in range(length)):
        with torch.no_grad():
            logits = model64(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].numpy()
        conditional[prefix] = reference_probs(logits, **params)
    model.to(torch.float32)
    probs = np.ones([DIST_VOCAB] * length)
    for t in itertools.product(range(DIST_VOCAB), repeat=length):
        for n in range(length):
            probs[t] *= conditional[t[:n]][t[n]]
    return probs.sum(axis=tuple(range(SKIP))).reshape(-1)  # the skipped tokens summed out


def sample_counts(engine, k, params, seed) -> np.ndarray:
    # room for a whole first speculative step: k drafts and a bonus token after the skipped ones
    results = engine.generate([PROMPT] * SAMPLES, max_new_tokens=SKIP + max(k + 1, NUM_TOKENS), seed=seed, **params)
    counts = np.zeros(DIST_VOCAB**NUM_TOKENS)
    for r in results:
        counts[np.ravel_multi_index(r.token_ids[SKIP : SKIP + NUM_TOKENS], [DIST_VOCAB] * NUM_TOKENS)] += 1
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


INIT = {tiny_llama: 0.3, tiny_gpt2: 0.2}  # weight scales that give spread-out distributions


def target_and_draft(family):
    target = family(seed=1, vocab_size=DIST_VOCAB, init=INIT[family])
    return target, nearby_draft(target, noise=0.5)  # accepts about 70% of the time
