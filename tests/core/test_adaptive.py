"""Adaptive k: the cost model, the choice of k, and that it never changes the output."""

import math

import pytest

import specdecode.decoder
from helpers import GREEDY_PROMPTS as PROMPTS
from helpers import adapting_on_acceptance, hf_greedy, nearby_draft, tiny_gpt2, tiny_llama
from specdecode import SpeculativeEngine
from specdecode.core.adaptive import (
    EMA_WEIGHT,
    PROBE_EVERY,
    SPIKE_LIMIT,
    AdaptiveK,
    AdaptiveTree,
    StepCosts,
    best_k,
    best_tree_size,
    expected_tokens,
    tree_sizes,
)
from specdecode.drafters import AutoDrafter, ModelDrafter, PromptLookupDrafter
from specdecode.runners import HFModelRunner


def linear_costs(base: float = 0.030, per_token: float = 0.005, sizes=(1, 2, 5)) -> StepCosts:
    costs = StepCosts()
    for n in sizes:
        costs.record(n, base + per_token * (n - 1))
    return costs


def test_expected_tokens_is_leviathans_formula_for_constant_acceptance():
    for a in (0.0, 0.3, 0.8):
        for k in (0, 1, 4):
            assert math.isclose(expected_tokens([a] * k), (1 - a ** (k + 1)) / (1 - a))


def test_step_costs_interpolate_the_measured_sizes_and_stay_flat_beyond():
    costs = linear_costs(sizes=(2, 5))
    assert costs.estimate(3) == pytest.approx(costs.seconds[2] + (costs.seconds[5] - costs.seconds[2]) / 3)
    assert costs.estimate(9) == costs.seconds[5]  # optimistic beyond the largest size measured
    assert costs.estimate(1) == costs.seconds[2]
    assert StepCosts().estimate(1) is None


def test_best_k_weighs_acceptance_against_cost():
    verify = linear_costs().estimate
    assert best_k([1.0] * 8, 0.0, verify) == 8  # free, always-accepted drafts: draft all
    assert best_k([0.0] * 8, 0.0, verify) == 0  # never accepted: target-only
    assert best_k([0.9] * 8, 0.030, verify) == 0  # a draft as slow as the target never pays
    assert 0 < best_k([0.8] * 8, 0.003, verify) < 8


def test_policy_switches_off_then_probes_ever_more_rarely():
    policy = AdaptiveK(linear_costs())
    assert policy.choose(4) == 4  # nothing measured about the draft: try the most
    policy.record_draft(4, 0.004)
    policy.record_verdict(4, 0)
    for _ in range(10):
        policy.record_verdict(1, 0)
    ks = [policy.choose(4) for _ in range(PROBE_EVERY[0] * 7)]
    probes = [i for i, k in enumerate(ks) if k]
    assert all(ks[i] == 4 for i in probes)  # a probe tries every position
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # probes get rarer while they fail


def test_policy_switches_back_on_when_probes_succeed():
    policy = AdaptiveK(linear_costs())
    policy.record_draft(1, 0.001)
    for _ in range(10):
        policy.record_verdict(1, 0)
    assert policy.choose(4) == 0
    for _ in range(10):
        policy.record_verdict(1, 1)
    assert policy.choose(4) > 0


def test_the_first_forward_of_each_size_is_not_taken_for_its_cost(monkeypatch):
    """A cold first forward of a new shape (kernel choice and packing) once made `make run` choose
    k = 0 for good; here every size's first forward costs 1000 s more on the decoder's clock (a
    clock of the test's own, so a busy machine cannot move it), and none of it is kept."""
    engine = SpeculativeEngine(tiny_llama(seed=1), drafter=PromptLookupDrafter(), num_speculative_tokens=4)
    slots, seen = engine.decoder.slots, set()
    forward = slots.forward
    clock = [0.0]

    def perf_counter() -> float:
        clock[0] += 1e-3  # every reading a millisecond later: costs are never zero
        return clock[0]

    def cold_first(slot_ids, new_tokens, num_logits):
        size = sum(len(t) for t in new_tokens)
        if size not in seen:
            seen.add(size)
            clock[0] += 1000.0
        return forward(slot_ids, new_tokens, num_logits)

    monkeypatch.setattr(specdecode.decoder.time, "perf_counter", perf_counter)
    slots.forward = cold_first
    engine.generate([PROMPTS[0] * 3], max_new_tokens=40)
    assert len(seen) > 2 and engine.decoder.costs.seconds  # several sizes ran, some twice
    assert max(engine.decoder.costs.seconds.values()) < 1.0


@pytest.mark.parametrize("family", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_greedy_output_with_adaptive_k_equals_transformers_generate(family, monkeypatch):
    target = family(seed=1)
    expected = [hf_greedy(target, prompt, 40) for prompt in PROMPTS]
    engine = SpeculativeEngine(target, num_speculative_tokens=6, adaptive=True)
    # costs frozen: measured ones made drafting stop on a busy machine (then nothing was accepted)
    chosen = adapting_on_acceptance(engine, monkeypatch)
    drafters = {
        "lookup": PromptLookupDrafter(),
        "random draft": ModelDrafter(HFModelRunner(family(seed=99))),
        "nearby draft, stops when unsure": ModelDrafter(HFModelRunner(nearby_draft(target, 0.5)), min_confidence=0.6),
    }
    drafters["auto"] = AutoDrafter([drafters.pop("lookup"), drafters["random draft"]])
    for name, drafter in drafters.items():
        engine.drafter = drafter
        runs = []
        for _ in range(2):  # the second pass starts from what the first measured
            results = engine.generate(PROMPTS, max_new_tokens=40)
            assert [r.token_ids for r in results] == expected, name
            assert all(r.stats.k_policy == "adaptive" for r in results)
            runs += results
        assert sum(r.stats.drafted_tokens for r in runs) > 0, name
        if name != "random draft":  # whose drafts are there to be rejected
            assert sum(r.stats.accepted_tokens for r in runs) > 0, name
    assert len(set(chosen)) > 1  # k adapted


def test_rate_is_the_settled_steps_expected_tokens_per_second():
    costs = linear_costs()
    policy = AdaptiveK(costs)
    assert policy.rate() is None  # nothing drafted yet: unranked
    policy.record_draft(4, 0.004)
    assert policy.rate() is None  # drafted, but no verdict yet
    for _ in range(20):
        policy.record_verdict(4, 3)  # three of four accepted, every step
    k = policy.choose(4)
    assert k == policy.settled > 0
    expected = expected_tokens(policy.acceptance[:k]) / (k * 0.001 + costs.estimate(k + 1))
    assert policy.rate() == pytest.approx(expected)
    shared = expected_tokens(policy.acceptance[:k]) / (k * 0.001 + costs.estimate(2 * (k + 1)) / 2)
    assert policy.rate(batch_size=2) == pytest.approx(shared)  # its share of a forward with another sequence's
    for _ in range(40):
        policy.record_verdict(4, 0)  # nothing accepted any more: switched off
    policy.choose(4)
    assert policy.settled == 0 and policy.rate() == pytest.approx(1 / costs.estimate(1))  # target-only's
    tree = AdaptiveTree(tree_costs())
    tree.record_draft(8, 0.008)
    assert tree.rate() is None  # drafted, but no verdict yet
    for _ in range(30):
        tree.record_verdict(8, 3)
    tree.choose(8)
    n = tree.settled
    assert tree.rate() == pytest.approx((1 + tree.accepted_depth(n)) / (n * 0.001 + tree_costs().estimate(n + 1)))


@pytest.mark.parametrize("adaptive", [True, False], ids=["ranked", "given order (control)"])
def test_auto_tries_the_candidate_that_pays_most_first(adaptive, monkeypatch):
    """Two candidates that both pay, the better one given second: ranked by measured rate, the
    second drafts nearly every step (the first still now and then, so that it is measured
    again); in the given order (the control: fixed k) the first hides the second."""
    target = tiny_llama(seed=1)
    expected = [hf_greedy(target, prompt, 40) for prompt in PROMPTS]
    engine = SpeculativeEngine(target, num_speculative_tokens=4, adaptive=adaptive)
    adapting_on_acceptance(engine, monkeypatch)
    good = ModelDrafter(HFModelRunner(nearby_draft(target, 0.5)), name="good")
    better = ModelDrafter(HFModelRunner(nearby_draft(target, 0.0)), name="better")  # the target itself
    engine.drafter = AutoDrafter([good, better])
    results = engine.generate(PROMPTS, max_new_tokens=40)
    assert [r.token_ids for r in results] == expected
    drafted = {
        name: sum(r.stats.drafted_by_source.get(name, [0, 0])[0] for r in results) for name in ("good", "better")
    }
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert accepted > 0
    if adaptive:
        assert drafted["better"] > 4 * drafted["good"] > 0
    else:
        assert drafted["better"] == 0 and drafted["good"] > 0


# --- tree sizes (AdaptiveTree) ---


def tree_costs(base: float = 0.010, per_token: float = 0.001, sizes=(1, 2, 4, 8, 16, 33)) -> StepCosts:
    costs = StepCosts()
    for n in sizes:
        costs.record(n, base + per_token * (n - 1))
    return costs


def test_tree_sizes_are_a_ladder_capped_by_k_max():
    assert tree_sizes(32) == [0, 2, 4, 8, 12, 16, 24, 32]
    assert tree_sizes(10) == [0, 2, 4, 8, 10] and tree_sizes(1) == [0, 1]


def test_best_tree_size_weighs_accepted_depth_against_cost():
    verify = tree_costs().estimate
    sizes = tree_sizes(32)
    assert best_tree_size(sizes, lambda n: 0.0, float, 0.0, verify) == 0  # nothing accepted: target-only
    assert best_tree_size(sizes, lambda n: n / 4, float, 0.0, verify) == 32  # depth grows with size: the most
    saturating = {2: 0.6, 4: 1.0, 8: 1.5, 12: 1.6, 16: 1.65, 24: 1.7, 32: 1.72}
    rates = {n: (1 + a) / verify(n + 1) for n, a in saturating.items()}
    assert best_tree_size(sizes, saturating.get, float, 0.0, verify) == max(rates, key=rates.get)
    assert best_tree_size(sizes, saturating.get, float, 0.0, verify) not in (0, 32)
    # drafting dear: smaller trees, then none
    assert best_tree_size(sizes, saturating.get, float, 0.002, verify) < 8
    assert best_tree_size(sizes, saturating.get, float, 0.050, verify) == 0
    # a drafter that gives fewer nodes than asked costs what it gave
    few = best_tree_size(sizes, lambda n: min(n, 3) / 2, lambda n: min(n, 3.0), 0.0, verify)
    assert few == 4  # the smallest size that gets its 3 nodes


def measure(policy: AdaptiveTree, size: int, depth: float, steps: int = 10) -> None:
    """steps verdicts for size whose accepted depths (integers) average depth."""
    whole, extra = int(depth), round((depth - int(depth)) * steps)
    for i in range(steps):
        policy.record_verdict(size, whole + (i < extra), size)


def test_tree_policy_tries_the_most_first_and_guesses_unmeasured_sizes_from_larger_ones():
    policy = AdaptiveTree(tree_costs())
    assert policy.choose(32) == 32  # nothing measured
    policy.record_draft(32, 0.001)
    policy.record_verdict(32, 2, 32)
    assert policy.accepted == {32: 2.0}
    assert policy.accepted_depth(8) == 2.0 and policy.accepted_depth(1) == 1.0  # never more than its nodes
    assert policy.choose(32) == 2  # as deep (capped by its size), and cheaper: tried
    policy.record_verdict(2, 0, 2)
    assert policy.accepted[2] == 0.0 and policy.accepted_depth(4) == 2.0


def test_a_size_left_after_unlucky_steps_comes_back_as_its_measurements_fade():
    """Discounted UCB: a size's bonus grows while it is not measured, until it is tried again.
    Size 4 is the best (1 deep at 0.014 s, against 8's 1.5 at 0.018 s) but starts measured
    once at 0: it comes back, is measured right, and is then chosen most."""
    depths = {2: 0.5, 4: 1.0, 8: 1.5, 12: 1.6, 16: 1.65, 24: 1.7, 32: 1.75}
    policy = AdaptiveTree(tree_costs())
    policy.record_draft(1, 0.0)
    measure(policy, 8, 1.5, steps=20)
    policy.record_verdict(4, 0, 4)  # one unlucky step: 4 looks worse than it is
    assert policy.bonus(4) > policy.bonus(8) > 0 and policy.bonus(16) == 0
    chosen = simulate(policy, depths.get, 400)
    assert chosen[0] != 4 and 4 in chosen
    assert abs(policy.accepted[4] - 1.0) < 0.3
    late = chosen[200:]
    assert max(set(late), key=late.count) == 4, sorted(set(late))


def test_tree_policy_shrinks_trees_as_the_batch_grows():
    """Each node costs batch_size times more of a shared forward whose cost rises with its tokens."""
    costs = StepCosts()
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        costs.record(n, 0.010 + 0.0004 * n)
    policy = AdaptiveTree(costs)
    policy.record_draft(1, 0.0)
    for n, depth in {2: 0.6, 4: 1.0, 8: 1.4, 12: 1.6, 16: 1.7, 24: 1.8, 32: 1.9}.items():
        measure(policy, n, depth)
    sizes = [policy.choose(32, batch) for batch in (1, 2, 4, 8)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1], sizes


def test_tree_policy_switches_off_then_probes_ever_more_rarely_and_back_on():
    policy = AdaptiveTree(tree_costs())
    policy.record_draft(16, 0.016)
    for n in tree_sizes(16)[1:]:
        measure(policy, n, 0.0)
    sizes = [policy.choose(16) for _ in range(PROBE_EVERY[0] * 7)]
    probes = [i for i, n in enumerate(sizes) if n]
    assert len(probes) >= 3
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]  # probes get rarer while they fail
    policy.draft_seconds_per_token = 0.0
    measure(policy, 16, 4.0)
    assert policy.choose(16) > 0


def simulate(policy: AdaptiveTree, true_depth, steps: int, seed: int = 0) -> list[int]:
    """steps steps of a drafter whose accepted depth at size n is an integer of mean true_depth(n)."""
    import random

    rng, chosen = random.Random(seed), []
    for _ in range(steps):
        n = policy.choose(32)
        chosen.append(n)
        policy.record_draft(n, 0.0)
        if n:
            d = true_depth(n)
            policy.record_verdict(n, min(n, int(d) + (rng.random() < d - int(d))), n)
    return chosen


@pytest.mark.parametrize(
    "per_token,best", [(0.001, 4), (0.0003, 12), (0.003, 0)], ids=["a middle size", "a large size", "none"]
)
def test_tree_policy_gets_close_to_the_best_rate_of_a_simulated_drafter(per_token, best):
    """Steps drawn from a known accepted-depth curve (seeded): from past steps only, the sizes
    chosen once it has settled give at least 95% of the best size's tokens per second (98%
    where target-only is best: probes cost little)."""
    costs = tree_costs(per_token=per_token)

    def true_depth(n):
        return 1.8 * (1 - 0.75 ** (n / 2))

    def rate(n):
        return (1 + (true_depth(n) if n else 0.0)) / costs.estimate(n + 1)

    assert max(tree_sizes(32), key=rate) == best
    for seed in range(3):
        late = simulate(AdaptiveTree(costs), true_depth, 600, seed)[300:]
        achieved = sum(rate(n) for n in late) / len(late) / rate(best)
        assert achieved > (0.98 if best == 0 else 0.95), (seed, achieved)


def test_a_tree_policy_that_drafted_nothing_in_a_batch_counts_a_rejected_tree():
    policy = AdaptiveTree(tree_costs())
    policy.record_no_draft(8)
    assert policy.accepted == {8: 0.0} and policy.nodes_proposed(8) == 8.0


def test_a_stalled_step_moves_its_size_s_cost_by_a_bounded_amount():
    """A step ten times its usual time (the host stalled) moves the estimate as a step of
    SPIKE_LIMIT times would; steady slower steps still bring it to the new level; a size first
    measured during a stall is taken at most SPIKE_LIMIT times its neighbours' cost."""
    costs = linear_costs()  # 1: 30 ms, 2: 35 ms, 5: 50 ms
    costs.record(5, 0.500)
    assert costs.estimate(5) == pytest.approx(0.050 + EMA_WEIGHT * (SPIKE_LIMIT * 0.050 - 0.050))
    for _ in range(40):
        costs.record(1, 0.045)  # the machine really got slower
    assert costs.estimate(1) == pytest.approx(0.045, rel=1e-3)
    costs.record(8, 1.0)  # first measured in a stall: nearest measured size 5
    assert costs.estimate(8) == pytest.approx(SPIKE_LIMIT * 0.060)
