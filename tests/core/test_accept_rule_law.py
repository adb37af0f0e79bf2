"""The accept/reject rule's law, computed exactly, and `verify` checked against it.

The rule's law is written here independently of specdecode, in float64: a target T and a
draft Q give a distribution after every prefix (so p and q rows depend on the drafted
tokens, as in the engine); the law of the tokens one verification emits is summed over
every draft x (weighted by Q's probability of drafting it) and over the regions of the
uniform draws u (x_i accepted when u_i < min(1, T/Q), else the recovered token is drawn
from norm(max(0, T - Q)); all accepted, a bonus token from T). The target's law of the
same k + 1 tokens is the product of T's conditionals; the emitted tokens, completed by the
target where the step ended early, must have exactly that law, at every position.

Then `verify` itself: its residual exactly against the formula, its emitted tokens against
the exact law by G-tests (every draft position, and positions 3 and 4 of k = 4 across many
steps), each with a negative control that must fail.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest
import torch

from helpers import ALPHA, g_test_pvalue
from specdecode.core import verification
from specdecode.core.verification import _residual, verify

V = 4  # vocabulary: small enough to enumerate every draft and every emitted sequence


def random_row(rng: np.random.Generator) -> np.ndarray:
    row = rng.dirichlet(np.full(V, 0.6))
    if rng.random() < 0.3:  # tokens a model cannot produce: p or q exactly 0
        row[rng.integers(V)] = 0.0
        row /= row.sum()
    return row


def random_tables(k: int, seed: int) -> tuple[dict, dict]:
    """T after every prefix of up to k tokens, Q after every prefix of up to k - 1."""
    rng = np.random.default_rng(seed)
    target = {prefix: random_row(rng) for prefix in prefixes(k)}
    draft = {prefix: random_row(rng) for prefix in prefixes(k - 1)}
    return target, draft


def prefixes(n: int) -> list[tuple]:
    """Every sequence of 0 .. n tokens."""
    return [y for m in range(n + 1) for y in itertools.product(range(V), repeat=m)]


def residual_formula(t: np.ndarray, q: np.ndarray) -> np.ndarray:
    r = np.maximum(0.0, t - q)
    return r / r.sum() if r.sum() > 0 else t  # sum 0: t == q, and a rejection has probability 0


def rule_law(target: dict, draft: dict, k: int, rule: str = "exact") -> dict[tuple, float]:
    """P(one verification emits exactly y), for every y of 1 .. k + 1 tokens.

    rule "exact" is the rule; the others are buggy rules, negative controls: "recover from p"
    draws the recovered token from T instead of the residual, "ratio inverted" accepts with
    min(1, Q/T)."""
    law: dict[tuple, float] = defaultdict(float)
    for x in itertools.product(range(V), repeat=k):
        weight = np.prod([draft[x[:i]][x[i]] for i in range(k)])  # Q drafts x
        if weight == 0:
            continue
        reach = 1.0  # P(x_1 .. x_i all accepted)
        for i in range(k):
            t, q = target[x[:i]], draft[x[:i]]
            if rule == "ratio inverted":
                accept = min(1.0, q[x[i]] / t[x[i]]) if t[x[i]] > 0 else 1.0
            else:
                accept = min(1.0, t[x[i]] / q[x[i]])  # q > 0: x was drafted
            rejected = reach * (1.0 - accept)  # the u_i region [accept, 1)
            if rejected > 0:
                recovered = t if rule == "recover from p" else residual_formula(t, q)
                for y in range(V):
                    law[x[:i] + (y,)] += weight * rejected * recovered[y]
            reach *= accept
        for y in range(V):  # every draft accepted: the bonus token, from T after the drafts
            law[x + (y,)] += weight * reach * target[x][y]
    return dict(law)


def completed(law: dict[tuple, float], target: dict, k: int) -> np.ndarray:
    """The law of k + 1 tokens: what one verification emitted, then the target's own draws."""
    out = np.zeros([V] * (k + 1))
    for z in itertools.product(range(V), repeat=k + 1):
        out[z] = sum(
            law.get(z[:m], 0.0) * np.prod([target[z[:i]][z[i]] for i in range(m, k + 1)]) for m in range(1, k + 2)
        )
    return out


def target_law(target: dict, k: int) -> np.ndarray:
    out = np.zeros([V] * (k + 1))
    for z in itertools.product(range(V), repeat=k + 1):
        out[z] = np.prod([target[z[:i]][z[i]] for i in range(k + 1)])
    return out


def rejection_probabilities(target: dict, draft: dict, k: int) -> list[float]:
    """P(the first rejection is at draft position i), i = 1 .. k: each must be tested."""
    law = rule_law(target, draft, k)
    return [sum(p for y, p in law.items() if len(y) == i) for i in range(1, k + 1)]


# --- the rule's law, exactly ---


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_the_rule_emits_tokens_with_exactly_the_targets_law(k, seed):
    target, draft = random_tables(k, seed)
    law = rule_law(target, draft, k)
    assert abs(sum(law.values()) - 1.0) < 1e-12
    # not vacuous: a rejection (a residual row) at every draft position, and every draft accepted
    assert min(rejection_probabilities(target, draft, k)) > 1e-3
    assert sum(p for y, p in law.items() if len(y) == k + 1) > 1e-3
    expected = target_law(target, k)
    got = completed(law, target, k)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    # position by position (the joint implies it; this is what a failure would show first)
    for position in range(k + 1):
        others = tuple(i for i in range(k + 1) if i != position)
        np.testing.assert_allclose(got.sum(axis=others), expected.sum(axis=others), rtol=0, atol=1e-12)
    # and each emitted prefix, whatever came after it: P(the step emitted >= m tokens, y_1..y_m)
    # completed by the target is the target's law of m tokens
    for m in range(1, k + 2):
        np.testing.assert_allclose(
            got.sum(axis=tuple(range(m, k + 1))), expected.sum(axis=tuple(range(m, k + 1))), rtol=0, atol=1e-12
        )


@pytest.mark.parametrize("rule", ["recover from p", "ratio inverted"])
@pytest.mark.parametrize("k", [1, 4])
def test_negative_control_a_buggy_rule_has_another_law(k, rule):
    target, draft = random_tables(k, seed=0)
    got = completed(rule_law(target, draft, k, rule), target, k)
    assert np.abs(got - target_law(target, k)).max() > 1e-3


# --- verify's residual, exactly ---


@pytest.mark.parametrize("seed", range(20))
def test_residual_is_the_normalised_positive_part_of_p_minus_q(seed):
    rng = np.random.default_rng(seed)
    k = 3
    q = np.stack([random_row(rng) for _ in range(k)])
    p = random_row(rng)
    draft = torch.tensor(rng.integers(V, size=k))
    q32, p32 = torch.tensor(q, dtype=torch.float32), torch.tensor(p, dtype=torch.float32)
    for position in range(k):
        got = _residual(p32, q32, draft, position).double().numpy()
        np.testing.assert_allclose(got, residual_formula(p, q[position]), rtol=0, atol=1e-6)
        one_hot = np.eye(V)[int(draft[position])]  # a drafter without probabilities
        got = _residual(p32, None, draft, position).double().numpy()
        np.testing.assert_allclose(got, residual_formula(p, one_hot), rtol=0, atol=1e-6)
    # p == q: a rejection had probability 0, and p is returned
    assert torch.equal(_residual(p32, p32[None].repeat(k, 1), draft, 0), p32)


# --- verify's law, by G-tests ---


def verify_counts(target: dict, draft: dict, k: int, runs: int, seed: int) -> tuple[np.ndarray, list[tuple]]:
    """Run verify `runs` times, each on a draft drawn from Q and with a generator of its own;
    counts of the emitted sequences, cells in the order of the returned list."""
    cells = [y for m in range(1, k + 2) for y in itertools.product(range(V), repeat=m)]
    index = {y: i for i, y in enumerate(cells)}
    target32, draft32 = ({y: torch.tensor(row, dtype=torch.float32) for y, row in t.items()} for t in (target, draft))
    counts = np.zeros(len(cells))
    for run in range(runs):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + run)
        x: tuple = ()
        for _ in range(k):
            x += (int(torch.multinomial(draft32[x], 1, generator=generator)),)
        q = torch.stack([draft32[x[:i]] for i in range(k)])
        p = torch.stack([target32[x[:i]] for i in range(k + 1)])
        verdict = verify(torch.tensor(x), q, p, generator)
        counts[index[x[: verdict.num_accepted] + (verdict.next_token,)]] += 1
    return counts, cells


@pytest.mark.parametrize("k", [1, 2, 3])
def test_verify_samples_the_exact_law(k):
    target, draft = random_tables(k, seed=k)
    counts, cells = verify_counts(target, draft, k, runs=6000, seed=k)
    law = rule_law(target, draft, k)
    probs = np.array([law.get(y, 0.0) for y in cells])
    assert g_test_pvalue(counts, probs) > ALPHA


def test_negative_control_verify_recovering_from_p_fails_the_g_test(monkeypatch):
    k = 2
    target, draft = random_tables(k, seed=k)
    monkeypatch.setattr(verification, "_residual", lambda p, *args: p)  # the bug: recover from p itself
    counts, cells = verify_counts(target, draft, k, runs=6000, seed=k)
    law = rule_law(target, draft, k)
    assert g_test_pvalue(counts, np.array([law.get(y, 0.0) for y in cells])) < 1e-6
    # ... and the buggy rule's own exact law is what it sampled: the test tells the two apart
    buggy = rule_law(target, draft, k, "recover from p")
    assert g_test_pvalue(counts, np.array([buggy.get(y, 0.0) for y in cells])) > ALPHA


# Fixed rows at k = 4 (the same whatever was drafted): the draft nearly agrees with the target
# at positions 1 and 2, so most steps reach 3 and 4, where it disagrees, so there the residual
# decides. Reaching position 3 depends only on positions 1 and 2, and from there the rule is
# a verification of its own: (y_3, y_4), y_4 completed by the target when the step ended at
# 3, has the law p_3 x p_4.
P_ROWS = np.array(
    [
        [0.40, 0.30, 0.20, 0.10],
        [0.10, 0.60, 0.20, 0.10],
        [0.70, 0.10, 0.10, 0.10],
        [0.05, 0.15, 0.50, 0.30],
        [0.25, 0.25, 0.25, 0.25],
    ]
)
Q_ROWS = np.array(
    [
        [0.45, 0.25, 0.20, 0.10],
        [0.10, 0.55, 0.25, 0.10],
        [0.10, 0.10, 0.10, 0.70],
        [0.60, 0.30, 0.05, 0.05],
    ]
)


def late_position_counts(runs: int, seed: int) -> np.ndarray:
    """Counts of (y_3, y_4) over the steps that reached position 3, one generator for every
    step (drafts and verification draw from it in turn, as in the engine)."""
    generator = torch.Generator().manual_seed(seed)
    completion = np.random.default_rng(seed)
    p, q = torch.tensor(P_ROWS, dtype=torch.float32), torch.tensor(Q_ROWS, dtype=torch.float32)
    counts = np.zeros((V, V))
    for _ in range(runs):
        draft = torch.multinomial(q, 1, generator=generator)[:, 0]  # [4]
        verdict = verify(draft, q, p, generator)
        emitted = draft[: verdict.num_accepted].tolist() + [verdict.next_token]
        if len(emitted) < 3:
            continue
        if len(emitted) == 3:
            emitted.append(int(completion.choice(V, p=P_ROWS[3])))
        counts[emitted[2], emitted[3]] += 1
    return counts.reshape(-1)


def test_positions_3_and_4_of_a_later_step_have_the_targets_law():
    counts = late_position_counts(runs=4000, seed=5)
    assert 2500 < counts.sum() < 4000  # most steps, not all, reached position 3
    expected = np.outer(P_ROWS[2], P_ROWS[3]).reshape(-1)
    assert g_test_pvalue(counts, expected) > ALPHA
    # the claim, exactly, from the rule's law (fixed rows are tables that ignore the prefix):
    # over the steps that reach position 3, (y_3, y_4) completed by the target is p_3 x p_4
    target, draft = {y: P_ROWS[len(y)] for y in prefixes(4)}, {y: Q_ROWS[len(y)] for y in prefixes(3)}
    reached = np.zeros((V, V))
    for y, probability in rule_law(target, draft, 4).items():
        if len(y) >= 4:
            reached[y[2], y[3]] += probability
        elif len(y) == 3:
            reached[y[2]] += probability * P_ROWS[3]
    np.testing.assert_allclose((reached / reached.sum()).reshape(-1), expected, rtol=0, atol=1e-12)


def test_negative_control_a_residual_bug_shows_at_positions_3_and_4(monkeypatch):
    monkeypatch.setattr(verification, "_residual", lambda p, *args: p)
    counts = late_position_counts(runs=4000, seed=5)
    assert g_test_pvalue(counts, np.outer(P_ROWS[2], P_ROWS[3]).reshape(-1)) < 1e-6
