"""Rolling the cache back to the accepted prefix gives the same logits as recomputing it."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from helpers import tiny_causal_lm, tiny_gpt2, tiny_llama
from specdecode.runners import CachedSequence, HFModelRunner


def fresh_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def test_logits_after_rollback_equal_a_fresh_forward_over_the_accepted_sequence():
    for model in (tiny_llama(seed=3), tiny_gpt2(seed=3)):
        cached = CachedSequence(HFModelRunner(model))
        prompt, drafts = [3, 5, 7, 2, 9], [4, 4, 11, 6]
        cached.logits(prompt + drafts, num_logits=len(drafts) + 1)  # verify 4 drafts
        accepted = prompt + drafts[:1] + [13]  # one accepted, then a recovered token
        next_step = cached.logits(accepted + [8, 1], num_logits=3)
        assert cached.runner.cache_length == len(accepted) + 2
        for i, length in enumerate(range(len(accepted), len(accepted) + 3)):
            torch.testing.assert_close(
                next_step[i], fresh_logits(model, (accepted + [8, 1])[:length]), atol=1e-5, rtol=1e-5
            )


def test_only_the_new_suffix_is_run():
    runner = HFModelRunner(tiny_llama(seed=3))
    fed = []
    forward = runner.forward
    runner.forward = lambda ids, n: fed.append(ids.tolist()) or forward(ids, n)
    cached = CachedSequence(runner)
    cached.logits([1, 2, 3, 4])  # prefill once
    cached.logits([1, 2, 3, 4, 5, 6], num_logits=3)  # pending token + 2 drafts
    cached.logits([1, 2, 3, 4, 5, 7, 8], num_logits=2)  # draft 6 rejected, 7 recovered
    assert fed == [[1, 2, 3, 4], [4, 5, 6], [7, 8]]


def tiny_sliding_mistral(seed: int):
    """Sliding-window attention (window 4, shorter than the prompts below)."""
    return tiny_causal_lm(MistralForCausalLM, MistralConfig, seed, initializer_range=0.6, sliding_window=4)


@pytest.mark.parametrize("family", [tiny_llama, tiny_sliding_mistral], ids=["llama", "sliding-window"])
def test_a_forward_that_fails_part_way_leaves_the_cache_at_its_prefix(family):
    """An exception inside the model (out of memory, an injected fault) after its first layer
    ran has appended the new positions to that layer's cache only (transformers' crop, relative
    to the end, then leaves the layers at different lengths). The runner must still hold
    exactly the prefix: a retry gives the logits of a runner that never failed."""
    model = family(seed=3)
    prefix, new = torch.tensor([3, 5, 7, 2, 9, 1]), torch.tensor([4, 11, 6])
    fresh = HFModelRunner(model)
    fresh.forward(prefix, 1)
    expected = fresh.forward(new, len(new))

    runner = HFModelRunner(model)
    runner.forward(prefix, 1)
    failures = [RuntimeError("injected fault in layer 1")]

    def fail_once(module, args):
        if failures:
            raise failures.pop()

    # raised as the second layer starts: the first has cached the new positions, it has not
    hook = model.model.layers[1].register_forward_pre_hook(fail_once)
    try:
        with pytest.raises(RuntimeError, match="injected fault"):
            runner.forward(new, len(new))
    finally:
        hook.remove()
    assert runner.cache_length == len(prefix)
    assert [runner._cache.get_seq_length(i) for i in range(2)] == [len(prefix)] * 2  # every layer, not only the count
    runner.crop(len(prefix))
    torch.testing.assert_close(runner.forward(new, len(new)), expected, atol=1e-6, rtol=1e-6)
    assert runner.cache_length == len(prefix) + len(new)
