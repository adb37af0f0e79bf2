"""Stopping: EOS (tokens accepted past it are dropped), stop strings, token budget."""

from helpers import hf_greedy, tiny_llama, tiny_tokenizer
from specdecode import SpeculativeEngine
from specdecode.core.stopping import StoppingCriteria
from specdecode.drafters import ModelDrafter
from specdecode.runners import HFModelRunner

PROMPT = [3, 5, 7, 2]


def test_eos_accepted_mid_draft_ends_generation_like_transformers():
    target = tiny_llama(seed=1)
    free_run = hf_greedy(target, PROMPT, 30)
    eos = free_run[6]
    target.generation_config.eos_token_id = eos
    # the target drafting for itself accepts all 4 drafts, so EOS arrives inside an accepted run
    engine = SpeculativeEngine(target, drafter=ModelDrafter(HFModelRunner(target)), num_speculative_tokens=4)
    result = engine.generate([PROMPT], max_new_tokens=30)[0]
    assert result.token_ids == hf_greedy(target, PROMPT, 30)
    assert result.token_ids[-1] == eos and eos not in result.token_ids[:-1]
    assert result.finish_reason == "stop"
    assert result.stats.generated_tokens == len(result.token_ids)


def test_stop_string_cuts_text_and_tokens():
    tokenizer = tiny_tokenizer()
    target = tiny_llama(seed=1)
    free_run = hf_greedy(target, PROMPT, 20)
    stop_word = tokenizer.decode([free_run[6]])
    text = tokenizer.decode(free_run, skip_special_tokens=True)
    assert text.find(stop_word) == len(tokenizer.decode(free_run[:6], skip_special_tokens=True)) + 1
    engine = SpeculativeEngine(target, tokenizer, ModelDrafter(HFModelRunner(target)), num_speculative_tokens=4)
    engine.eos_token_ids = frozenset()  # like transformers' generate of this model, which knows no EOS
    result = engine.generate([PROMPT], max_new_tokens=20, stop=stop_word)[0]
    first = 6
    assert result.finish_reason == "stop"
    assert result.token_ids == free_run[:first]
    assert result.text.rstrip() == tokenizer.decode(free_run[:first], skip_special_tokens=True)
    assert stop_word not in result.text


def test_budget_and_eos_in_the_same_step():
    criteria = StoppingCriteria(max_new_tokens=5, eos_token_ids=frozenset({9}))
    assert criteria.check([1, 2, 3, 9, 4, 5], num_new=4, context_full=False).keep == 4
    assert criteria.check([1, 2, 3, 4, 5, 6], num_new=4, context_full=False).keep == 5
    assert criteria.check([1, 2], num_new=2, context_full=False) is None
    assert criteria.check([1, 2], num_new=2, context_full=True).reason == "length"
