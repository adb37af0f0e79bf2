"""Adaptive k: the cost model, the choice of k, and that it never changes the output."""

import math

import pytest

import specdecode.decoder
from helpers import GREEDY_PROMPTS as PROMPTS
from helpers import adapting_on_acceptance, hf_greedy, nearby_draft, tiny_gpt2, tiny_llama
from specdecode import SpeculativeEngine
from specdecode.core.adaptive import PROBE_EVERY, AdaptiveK, StepCosts, best_k, expected_tokens
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
