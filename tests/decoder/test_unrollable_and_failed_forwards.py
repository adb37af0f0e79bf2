"""Caches that a crop cannot take back, and caches after a forward that failed part-way.

transformers' recurrent layers (Mamba's selective scan) keep a state that every token
advances in place: rejected drafts cannot be taken out of it, so such a target decodes
target-only, and says so in its stats. Its short-convolution layers (LFM2) record their past
and roll back exactly: such a target speculates. After a forward that failed part-way, the
runner's own cache length is the truth, and the decoder re-runs what the runner no longer holds.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Lfm2Config, Lfm2ForCausalLM, MambaConfig, MambaForCausalLM

from helpers import GREEDY_PROMPTS as PROMPTS
from helpers import VOCAB, assert_drafted_and_accepted, hf_greedy, nearby_draft, tiny_llama
from specdecode import SpeculativeEngine
from specdecode.decoder import SequenceState
from specdecode.drafters import ModelDrafter
from specdecode.engine import make_generator
from specdecode.runners import CachedSequence, HFModelRunner

NEW_TOKENS = 30
NO_ENDS = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def tiny_mamba(seed: int) -> MambaForCausalLM:
    torch.manual_seed(seed)
    config = MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, initializer_range=0.6, **NO_ENDS
    )
    return MambaForCausalLM(config).eval()


def tiny_lfm2(seed: int) -> Lfm2ForCausalLM:
    """Short convolutions and attention, alternating (as LFM2 does)."""
    torch.manual_seed(seed)
    config = Lfm2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        full_attn_idxs=[1, 3],
        max_position_embeddings=128,
        initializer_range=0.6,
        **NO_ENDS,
    )
    return Lfm2ForCausalLM(config).eval()


def decoder_layers(model) -> torch.nn.ModuleList:
    return model.backbone.layers if hasattr(model, "backbone") else model.model.layers


def test_the_transformers_runner_says_which_caches_roll_back():
    assert not HFModelRunner(tiny_mamba(seed=1)).rolls_back  # a recurrent state, advanced in place
    assert HFModelRunner(tiny_lfm2(seed=1)).rolls_back  # convolutions record their past
    assert HFModelRunner(tiny_llama(seed=1)).rolls_back


# what a speculative run asks of a draft model's cache: prefill, drafts, rollbacks
STEPS = [(list(range(1, 11)), 1), (list(range(1, 16)), 6), (list(range(1, 13)) + [5, 6], 3), (list(range(1, 14)), 1)]


@pytest.mark.parametrize("family", [tiny_mamba, tiny_lfm2], ids=["mamba", "lfm2"])
def test_logits_through_rollbacks_equal_a_fresh_forward(family):
    """A runner whose cache cannot roll back still answers exactly: a crop past its end empties
    it (cache_length says so, and CachedSequence re-runs the rest), and after a cached prefix
    it runs one token per model call (a longer chunk would restart Mamba's scan from zero)."""
    model = family(seed=3)
    cached = CachedSequence(HFModelRunner(model))
    for tokens, num_logits in STEPS:
        with torch.no_grad():
            fresh = model(torch.tensor([tokens])).logits[0, -num_logits:]
        torch.testing.assert_close(cached.logits(tokens, num_logits), fresh, atol=1e-5, rtol=1e-5)


def test_a_target_whose_cache_cannot_roll_back_decodes_target_only_and_says_so():
    target = tiny_mamba(seed=1)
    expected = [hf_greedy(target, prompt, NEW_TOKENS) for prompt in PROMPTS]
    engine = SpeculativeEngine(target, drafter=ModelDrafter(HFModelRunner(nearby_draft(target, 0.3))))
    for results in (
        engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS),
        engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, max_batch_size=8),
    ):
        assert [r.token_ids for r in results] == expected
        for result in results:
            stats = result.stats
            assert (stats.drafter, stats.num_speculative_tokens, stats.drafted_tokens) == ("none", 0, 0)
            assert "cannot be rolled back" in stats.note and stats.note in stats.summary()
            assert stats.to_dict()["note"] == stats.note


@pytest.mark.parametrize("noise", [0.0, 0.3], ids=["all-accepted", "some-rejected"])
def test_a_hybrid_target_whose_convolutions_roll_back_speculates_exactly(noise):
    target = tiny_lfm2(seed=1)
    expected = [hf_greedy(target, prompt, NEW_TOKENS) for prompt in PROMPTS]
    draft = ModelDrafter(HFModelRunner(nearby_draft(target, noise)))
    engine = SpeculativeEngine(target, drafter=draft, num_speculative_tokens=4)  # k pinned: adaptive off
    results = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert [r.token_ids for r in results] == expected
    assert_drafted_and_accepted(results)
    assert all(r.stats.note is None for r in results)
    if noise:
        assert sum(r.stats.drafted_tokens - r.stats.accepted_tokens for r in results) > 0  # rollbacks ran


class FailingLayer:
    """A forward pre-hook that raises as the layer starts, on the given calls of that layer."""

    def __init__(self, *calls: int):
        self.calls, self.count, self.raised = set(calls), 0, 0

    def __call__(self, module, args) -> None:
        self.count += 1
        if self.count in self.calls:
            self.raised += 1
            raise RuntimeError(f"injected fault in call {self.count}")


def decode_with_retries(
    engine: SpeculativeEngine, prompt: list[int], runner_lengths: list[int], fail_after_forward: int
) -> SequenceState:
    """Decode one greedy sequence, running a failed step again as the server's worker does;
    runner_lengths: the target runner's cache length after each failure. The first step from
    number fail_after_forward on whose forward runs fails after it (the server's injection point)."""
    decoder, steps, failed = engine.decoder, 0, []
    seq = engine.sequence(prompt, engine.settings(max_new_tokens=NEW_TOKENS), make_generator(0))

    def after_forward() -> None:
        if steps >= fail_after_forward and not failed:
            failed.append(steps)
            raise RuntimeError(f"injected fault after the forward of step {steps}")

    decoder.add(seq)
    while seq.finish is None:
        steps += 1
        try:
            decoder.step(after_forward=after_forward)
        except RuntimeError as error:
            if "injected fault" not in str(error):
                raise  # a failure of the rollback itself: retrying it would loop for ever
            runner_lengths.append(decoder.slots.slots[seq.slot].cache_length)
    decoder.remove(seq)
    return seq


@pytest.mark.parametrize("family", [tiny_lfm2, tiny_mamba], ids=["lfm2", "mamba"])
def test_a_forward_that_fails_part_way_is_retried_to_the_uninterrupted_output(family):
    """The fault is raised as a later layer starts, so the earlier ones have advanced their
    states: LFM2's cache is put back as it was (every layer's recorded states); Mamba's
    recurrent state cannot be, so its cache is emptied, cache_length says 0, and the decoder
    runs the sequence again (prompt, then its tokens one at a time, as they first ran). A step
    that fails after its forward is rolled back by a crop (which empties Mamba's cache too)."""
    target = family(seed=1)
    draft = ModelDrafter(HFModelRunner(nearby_draft(target, 0.3)))  # a model of its own: no hook
    k = 4 if family is tiny_lfm2 else 0
    for prompt in PROMPTS:
        expected = hf_greedy(target, prompt, NEW_TOKENS)
        engine = SpeculativeEngine(target, drafter=draft, num_speculative_tokens=k)
        hook = FailingLayer(3, 5, 8)  # the first call is the prefill: these are decoding steps
        handle = decoder_layers(target)[-1].register_forward_pre_hook(hook)
        lengths: list[int] = []
        try:
            seq = decode_with_retries(engine, prompt, lengths, fail_after_forward=7)
        finally:
            handle.remove()
        assert hook.raised == 3 and len(lengths) == 4
        assert seq.generated == expected, prompt
        if family is tiny_lfm2:
            assert seq.stats.drafted_tokens > 0 and seq.stats.replayed_tokens == 0  # nothing ran twice
        else:
            assert lengths[:3] == [0, 0, 0] and seq.stats.replayed_tokens > 0


def test_a_target_without_attention_takes_no_kv_cache_budget():
    """Mamba's state does not grow with the sequence: the server's KV budget counts 0 bytes a
    position for it (and still the real size for attention layers)."""
    from specdecode.runners.slots import kv_bytes_per_token
    from specdecode.server.app import batch_size_for_budget

    assert kv_bytes_per_token(HFModelRunner(tiny_mamba(seed=1))) == 0
    assert kv_bytes_per_token(HFModelRunner(tiny_llama(seed=1))) > 0
    engine = SpeculativeEngine(tiny_mamba(seed=1))
    assert batch_size_for_budget(engine, 8, kv_cache_gb=1e-6) == 8
