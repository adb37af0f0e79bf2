"""Rolling the cache back to the accepted prefix gives the same logits as recomputing it."""

import torch

from helpers import tiny_gpt2, tiny_llama
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
