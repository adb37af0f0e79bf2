"""The accept/reject rule on hand-made p and q."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specdecode.core.sampling import SamplingParams, logits_to_probs, row_maxima, sample
from specdecode.core.verification import verify, verify_greedy, verify_logits


def _probs(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_draft_token_is_always_accepted_when_q_does_not_exceed_p():
    p = _probs([0.2, 0.5, 0.3], [0.1, 0.1, 0.8])
    q = _probs([0.4, 0.4, 0.2])  # q(x=1) = 0.4 <= p(x=1) = 0.5
    for seed in range(200):
        verdict = verify(torch.tensor([1]), q, p, torch.Generator().manual_seed(seed))
        assert verdict.num_accepted == 1


def test_token_the_target_cannot_produce_is_always_rejected_and_replaced_from_the_residual():
    p = _probs([0.0, 0.5, 0.5], [1.0, 0.0, 0.0])
    q = _probs([0.9, 0.05, 0.05])
    for seed in range(200):
        verdict = verify(torch.tensor([0]), q, p, torch.Generator().manual_seed(seed))
        assert verdict.num_accepted == 0
        assert verdict.next_token in (1, 2)  # residual max(0, p - q) has no mass on 0


def test_residual_sampling_follows_normalised_positive_part_of_p_minus_q():
    p = _probs([0.1, 0.3, 0.6], [1 / 3, 1 / 3, 1 / 3])
    q = _probs([0.7, 0.2, 0.1])
    # residual = norm(max(0, p - q)) = norm([0, 0.1, 0.5]) = [0, 1/6, 5/6]
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        verdict = verify(torch.tensor([0]), q, p, generator)  # p/q = 1/7 at x = 0: mostly rejected
        if verdict.num_accepted == 0:
            counts[verdict.next_token] += 1
    assert counts[0] == 0
    n = counts.sum().item()
    assert chisquare(counts[1:].numpy(), [n / 6, 5 * n / 6]).pvalue > 0.001


def test_bonus_token_comes_from_the_last_target_distribution_when_all_drafts_are_accepted():
    p = _probs([0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.25, 0.75, 0.0])
    q = _probs([0.0, 1.0, 0.0], [0.0, 0.0, 1.0])
    generator = torch.Generator().manual_seed(1)
    bonus = [verify(torch.tensor([1, 2]), q, p, generator) for _ in range(2000)]
    assert all(v.num_accepted == 2 for v in bonus)
    ones = sum(v.next_token == 1 for v in bonus)
    assert chisquare([2000 - ones, ones], [500, 1500]).pvalue > 0.001


def test_one_hot_drafter_is_accepted_with_probability_p_of_its_token():
    p = _probs([0.3, 0.7, 0.0], [1.0, 0.0, 0.0])
    generator = torch.Generator().manual_seed(2)
    verdicts = [verify(torch.tensor([1]), None, p, generator) for _ in range(3000)]
    accepted = sum(v.num_accepted for v in verdicts)
    assert chisquare([accepted, 3000 - accepted], [2100, 900]).pvalue > 0.001
    # on rejection the residual is p without the drafted token: always token 0 here
    assert all(v.next_token == 0 for v in verdicts if v.num_accepted == 0)


def test_first_emitted_token_is_distributed_as_p_whatever_q_is():
    p = _probs([0.5, 0.2, 0.2, 0.1], [0.25] * 4)
    q = _probs([0.1, 0.1, 0.1, 0.7])
    generator = torch.Generator().manual_seed(3)
    counts = torch.zeros(4)
    for _ in range(4000):
        draft = torch.multinomial(q[0], 1, generator=generator)
        verdict = verify(draft, q, p, generator)
        counts[draft.item() if verdict.num_accepted else verdict.next_token] += 1
    assert chisquare(counts.numpy(), (p[0] * 4000).numpy()).pvalue > 0.001
    # negative control: the same counts are far from the draft's distribution
    assert chisquare(counts.numpy(), (q[0] * 4000).numpy()).pvalue < 1e-6


def test_greedy_one_hot_p_and_q_accept_exactly_while_draft_equals_argmax():
    p = torch.eye(5)[[2, 4, 1, 3]]  # target argmax after each position: 2, 4, 1, then 3
    q = torch.eye(5)[[2, 4, 0]]
    verdict = verify(torch.tensor([2, 4, 0]), q, p, torch.Generator().manual_seed(0))
    assert verdict.num_accepted == 2 and verdict.next_token == 1


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(0, 5),
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 12),
    one_hot_draft=st.booleans(),
)
def test_the_greedy_shortcut_equals_the_rule_with_one_hot_p(k, seed, vocab, one_hot_draft):
    """verify_greedy decides exactly what verify decides with p one-hot on the argmax, for any
    draft and any q (ties in the logits included: small integers collide often)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 4, (k + 1, vocab), generator=g).float()
    draft = torch.randint(0, vocab, (k,), generator=g)
    q = None if one_hot_draft else torch.softmax(torch.randn(k, vocab, generator=g), dim=-1)
    p = logits_to_probs(logits, SamplingParams(0.0))
    assert verify_greedy(draft, logits) == verify(draft, q, p, torch.Generator().manual_seed(seed))


# --- non-finite numbers: tiny temperatures are greedy, NaN never passes for a probability ---


def test_a_tiny_temperature_is_greedy_and_gives_finite_one_hot_probabilities():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, 0.25, 0.0, 4.0]])
    for temperature in (1e-38, 1e-30, 1e-6):
        params = SamplingParams(temperature)
        assert params.greedy
        assert torch.equal(logits_to_probs(logits, params), torch.eye(4)[[1, 3]])
    assert not SamplingParams(1e-5).greedy and not SamplingParams(0.5).greedy
    # just above the threshold the tempered distribution is finite, and all but one-hot here
    probs = logits_to_probs(logits, SamplingParams(1e-5))
    assert torch.isfinite(probs).all() and torch.allclose(probs, torch.eye(4)[[1, 3]])


def test_a_tiny_temperature_through_the_engine_gives_the_greedy_output():
    from helpers import tiny_llama
    from specdecode import SpeculativeEngine
    from specdecode.drafters import PromptLookupDrafter

    engine = SpeculativeEngine(tiny_llama(seed=1), drafter=PromptLookupDrafter(), num_speculative_tokens=4)
    prompts = [[3, 5, 7, 2, 3, 5, 7], [20, 3, 20, 3, 20]]
    greedy = [r.token_ids for r in engine.generate(prompts, max_new_tokens=30, temperature=0.0)]
    for seed in (None, 0):
        results = engine.generate(prompts, max_new_tokens=30, temperature=1e-38, seed=seed)
        assert [r.token_ids for r in results] == greedy
    assert sum(r.stats.accepted_tokens for r in results) > 0  # drafts were verified and kept


def test_nan_in_p_rejects_that_draft():
    nan = float("nan")
    p = _probs([0.2, 0.8, 0.0], [nan, 0.5, 0.5], [0.1, 0.1, 0.8], [1.0, 0.0, 0.0])
    q = _probs([0.2, 0.8, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0])
    for seed in range(100):
        verdict = verify(torch.tensor([1, 0, 2]), q, p, torch.Generator().manual_seed(seed))
        # x_1 is always accepted (q <= p); x_2 = 0 has p = NaN: rejected, never accepted
        assert verdict.num_accepted == 1
        assert verdict.next_token in (1, 2)  # from the residual, which has no mass on the NaN
    # a NaN in the draft's q rejects too
    q_nan = _probs([nan, 0.5, 0.5])
    p_one = _probs([0.5, 0.5, 0.0], [1.0, 0.0, 0.0])
    for seed in range(20):
        assert verify(torch.tensor([0]), q_nan, p_one, torch.Generator().manual_seed(seed)).num_accepted == 0


@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.7, top_k=2, top_p=0.9)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_target_logits_raise_a_clear_error(params, bad):
    logits = torch.tensor([[1.0, 2.0, 0.5, 0.0], [0.0, 1.0, 2.0, 3.0]])
    logits[1, 2] = bad
    problem = "NaN" if bad != bad else r"\+inf"
    with pytest.raises(ValueError, match=problem):
        logits_to_probs(logits, params)
    with pytest.raises(ValueError, match=problem):
        verify_logits(torch.tensor([1]), None, logits, params, torch.Generator().manual_seed(0))
    every_token_masked = torch.full((2, 4), float("-inf"))
    with pytest.raises(ValueError, match="-inf"):
        logits_to_probs(every_token_masked, params)


def test_minus_inf_logits_and_masks_still_work():
    masked = torch.tensor([[float("-inf"), 2.0, 1.0, 0.0], [1.0, float("-inf"), float("-inf"), 0.0]])
    probs = logits_to_probs(masked, SamplingParams(1.0))
    assert torch.isfinite(probs).all() and probs[0, 0] == 0 and (probs[1, 1:3] == 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(2))
    assert torch.equal(logits_to_probs(masked, SamplingParams(1.0, top_k=1)), torch.eye(4)[[1, 0]])
    top_p = logits_to_probs(masked, SamplingParams(1.0, top_p=0.5))
    assert torch.equal(top_p > 0, torch.eye(4, dtype=torch.bool)[[1, 0]])
    assert torch.equal(logits_to_probs(masked, SamplingParams(0.0)), torch.eye(4)[[1, 0]])


@settings(max_examples=100, deadline=None)
@given(k=st.integers(0, 5), seed=st.integers(0, 2**31 - 1), greedy=st.booleans())
def test_a_chains_accepted_path_is_its_accepted_prefix(k, seed, greedy):
    """Every verdict names its accepted nodes; a chain's are 0 .. num_accepted - 1."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, 6, generator=g)
    draft = torch.randint(0, 6, (k,), generator=g)
    params = SamplingParams(0.0 if greedy else 1.0)
    verdict = verify_logits(draft, None, logits, params, torch.Generator().manual_seed(seed))
    assert verdict.path == tuple(range(verdict.num_accepted))


# --- drawing one token: sampling.sample inverts the cumulative sum at one uniform draw ---


def test_sample_draws_each_row_from_its_own_weights_and_never_a_zero():
    weights = torch.tensor([[0.0, 3.0, 1.0, 0.0, 4.0, 0.0], [2.0, 0.0, 0.0, 1.0, 0.0, 1.0]])  # unnormalised
    generator = torch.Generator().manual_seed(5)
    draws = torch.stack([sample(weights, generator) for _ in range(8000)])  # [8000, 2]
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=6).double()
        expected = weights[row].double() / weights[row].sum()
        assert counts[expected == 0].sum() == 0  # a token of weight 0 is never drawn
        seen = expected > 0
        assert chisquare(counts[seen].numpy(), (expected[seen] * 8000).numpy()).pvalue > 0.001
        # negative control: the other row's law is far off
        other = weights[1 - row].double() / weights[1 - row].sum()
        assert chisquare(counts.numpy() + 1, (other * 8000).numpy() + 1).pvalue < 1e-6


def test_a_uniform_draw_that_rounds_to_the_total_takes_the_last_token_with_weight(monkeypatch):
    """u * total < total exactly, but rounded it can reach it: the last token of weight > 0."""
    monkeypatch.setattr(torch, "rand", lambda *shape, **kwargs: torch.ones(*shape, dtype=torch.float64))
    assert sample(torch.tensor([[0.2, 0.5, 0.3, 0.0, 0.0]]), None).tolist() == [2]


def test_sample_refuses_rows_with_nothing_to_draw():
    for bad in ([0.0, 0.0, 0.0], [0.5, float("nan"), 0.5], [1.0, float("inf"), 0.0]):
        with pytest.raises(ValueError, match="not all zero"):
            sample(torch.tensor([bad]), None)


def test_row_maxima_are_torchs_max_on_ties_nans_infinities_and_views():
    """The greedy rule's argmax (numpy's, on float32 CPU rows): the first index on ties, NaN
    the largest, and the row's value there, as torch's max gives them."""
    nan, inf = float("nan"), float("inf")
    special = torch.tensor(
        [[1, nan, 3, nan], [2, 5, 5, 1], [-inf, -inf, -inf, -inf], [1, inf, inf, 0], [0.0, -0.0, 0.0, -1]]
    )
    wide = torch.randn(3, 49152, generator=torch.Generator().manual_seed(0))
    wide[1, 7] = wide[1, 9000] = wide[1].max() + 1  # a tie
    for logits in (special, wide, wide[:, ::3], wide[1], wide.bfloat16()):
        values, indices = row_maxima(logits)
        expected = logits.max(dim=-1)
        nan_rows = expected.values.isnan()
        assert torch.equal(indices, expected.indices) and torch.equal(values.isnan(), nan_rows)
        assert torch.equal(values[~nan_rows], expected.values[~nan_rows])
