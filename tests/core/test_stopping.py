"""Stopping: EOS (tokens accepted past it are dropped), stop strings, token budget."""

import pytest

from helpers import assert_drafted_and_accepted, hf_greedy, tiny_llama, tiny_tokenizer
from specdecode import SpeculativeEngine
from specdecode.core.stopping import Stop, StoppingCriteria
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
    assert_drafted_and_accepted([result])


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
    assert result.finish_reason == "stop"
    assert result.token_ids == free_run[:7]  # through the token that completes the stop string
    assert result.text == tokenizer.decode(free_run[:6], skip_special_tokens=True) + " "  # up to the stop string
    assert stop_word not in result.text
    assert_drafted_and_accepted([result])


def test_budget_and_eos_in_the_same_step():
    criteria = StoppingCriteria(max_new_tokens=5, eos_token_ids=frozenset({9}))
    assert criteria.check([1, 2, 3, 9, 4, 5], num_new=4, context_full=False).keep == 4
    assert criteria.check([1, 2, 3, 4, 5, 6], num_new=4, context_full=False).keep == 5
    assert criteria.check([1, 2], num_new=2, context_full=False) is None
    assert criteria.check([1, 2], num_new=2, context_full=True).reason == "length"


# --- stop strings: an incremental check, exactly as if the tokens came one at a time ---


def _word_decode():
    tokenizer = tiny_tokenizer()
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _word(i: int) -> int:
    return i + 2  # the id of "w{i}"


class CountingDecode:
    """A decode function that counts its calls and the tokens it was given."""

    def __init__(self, decode):
        self.decode, self.calls, self.tokens = decode, 0, 0

    def __call__(self, ids: list[int]) -> str:
        self.calls += 1
        self.tokens += len(ids)
        return self.decode(ids)


def _token_by_token(criteria: StoppingCriteria, generated: list[int]) -> Stop | None:
    """The reference semantics: the first token whose text holds a stop string, the text cut
    where the earliest one begins (what a decoding of one token a step finds)."""
    for n in range(1, len(generated) + 1):
        text = criteria.decode(generated[:n])
        hits = [text.find(s) for s in criteria.stop_strings if s in text]
        if hits:
            return Stop(n, "stop", min(hits))
    return None


def _run_steps(check, tokens: list[int], step_sizes: list[int]) -> tuple[Stop | None, int]:
    """Append tokens step by step (sizes repeat cyclically), checking after each; the first stop."""
    end, i = 0, 0
    while end < len(tokens):
        num_new = min(step_sizes[i % len(step_sizes)], len(tokens) - end)
        end, i = end + num_new, i + 1
        stop = check(tokens[:end], num_new)
        if stop is not None:
            return stop, end
    return None, end


def test_the_stop_string_check_decodes_a_bounded_window_each_step():
    decode = CountingDecode(_word_decode())
    criteria = StoppingCriteria(1000, frozenset(), ["w3 w2", "w19 w19", "zz"], decode)
    tokens = [_word(i % 20) for i in range(200)]  # w0 w1 ... w19 w0 w1 ...: no stop string
    per_step = []
    for n in range(1, len(tokens) + 1):
        before = (decode.calls, decode.tokens)
        assert criteria.check(tokens[:n], 1, context_full=False) is None
        per_step.append((decode.calls - before[0], decode.tokens - before[1]))
    # the work of a step does not grow with the text: a few calls on a window of a few tokens
    assert max(calls for calls, _ in per_step) <= 3, per_step
    assert max(decoded for _, decoded in per_step) <= 30, per_step
    assert decode.calls <= 3 * len(tokens) and decode.tokens <= 30 * len(tokens)
    # the stop string arrives: found, cut exactly, in a few calls
    decode.calls = 0
    tokens += [_word(3), _word(2)]
    assert criteria.check(tokens[:-1], 1, context_full=False) is None
    stop = criteria.check(tokens, 1, context_full=False)
    text = decode.decode(tokens)
    assert stop == Stop(202, "stop", text.find("w3 w2")) and text.find("w3 w2") == len(decode.decode(tokens[:200])) + 1
    assert decode.calls <= 3 + 12


def test_finding_which_tokens_to_keep_is_not_quadratic():
    decode = CountingDecode(_word_decode())
    criteria = StoppingCriteria(1000, frozenset(), ["w3 w2"], decode)
    tokens = [_word(3), _word(2)] + [_word(i % 20) for i in range(198)]  # the stop string at the very start
    assert criteria.check(tokens, len(tokens), context_full=False) == Stop(2, "stop", 0)
    assert decode.calls <= 12  # a bisection over the block (a scan would make one call per token, each O(n))


def _char_decode():
    # pieces of 0 to 3 characters (a token that decodes to nothing, as skipped special tokens do)
    pieces = ["", "a", "b", "c", "ab", "bc", "abc", " ", "x", "yz"]
    return pieces, lambda ids: "".join(pieces[i] for i in ids)


STOP_CASES = [
    # (decode, tokens, stop strings): stop strings spanning two tokens, starting mid-token,
    # starting in an earlier step's tokens, at the very start, several at once, none at all
    ("words", [2, 3, 7, 8, 9, 10, 11, 12, 13], ["w5 w6"]),
    ("words", [2, 3, 7, 8, 9, 10, 11, 12, 13], ["5 w6"]),
    ("words", [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], ["w3 w4 w5 w6 w7"]),
    ("words", [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], ["w8", "w4 w5"]),
    ("words", [2, 3, 4, 5], ["w0"]),
    ("words", [2, 3, 4, 5], ["w0 w1 w2 w3"]),
    ("words", [12, 13, 14, 15, 16], ["w1"]),  # "w1" inside the first token, "w10"
    ("words", [2, 3, 4, 5, 6, 7], ["w9"]),
    ("chars", [1, 2, 0, 0, 3, 4, 5, 0, 6, 7, 8, 9, 1, 2, 3], ["cab"]),
    ("chars", [1, 2, 0, 0, 3, 4, 5, 0, 6, 7, 8, 9, 1, 2, 3], ["bcabc xyzab"]),
    ("chars", [0, 0, 0, 0, 6, 6, 6, 0, 0, 0, 0, 0, 0, 1, 3], ["cabcac"]),
    ("chars", [0, 0, 0, 0, 6, 6, 6, 0, 0, 0, 0, 0, 0, 1, 3], ["abcabcabc"]),
    ("chars", [4, 6, 6, 8, 9], ["a", "xyz"]),
    ("chars", [4, 6, 6, 8, 9], ["q"]),
    # overlapping stops: "c" completes first though "abcx" begins first; a block of every step
    # size must stop where one token a step does
    ("chars", [4, 3, 8, 1], ["abcx", "c"]),
    ("chars", [1, 5, 8, 2], ["bcx", "abc"]),
]


@pytest.mark.parametrize("step_sizes", [[1], [3], [2, 5], [100]], ids=lambda s: f"steps{s}")
@pytest.mark.parametrize("case", STOP_CASES, ids=range(len(STOP_CASES)))
def test_incremental_stop_strings_cut_exactly_where_the_whole_text_search_did(case, step_sizes):
    kind, tokens, stop_strings = case
    decode = _word_decode() if kind == "words" else _char_decode()[1]
    criteria = StoppingCriteria(len(tokens), frozenset(), stop_strings, decode)
    expected = _token_by_token(criteria, tokens)
    found, _ = _run_steps(lambda g, n: criteria.check(g, n, context_full=False), tokens, step_sizes)
    if expected is None:  # no stop string: the budget ends it
        assert found == Stop(len(tokens), "length")
    else:
        assert found == expected
        text = decode(tokens[: found.keep])
        assert any(text.startswith(s, found.text_end) for s in stop_strings)
        assert not any(s in decode(tokens[: found.keep - 1]) for s in stop_strings)


# --- EOS and a stop string in the same accepted block: the earliest wins ---


def test_a_stop_string_before_eos_in_the_same_block_wins():
    decode = _word_decode()
    eos = 0
    criteria = StoppingCriteria(50, frozenset({eos}), ["w5 w6"], decode)
    # w0 w1 | w5 w6 w7 <eos> w8: the block holds the stop string, then EOS, then a draft past it
    generated = [_word(0), _word(1), _word(5), _word(6), _word(7), eos, _word(8)]
    stop = criteria.check(generated, num_new=5, context_full=False)
    assert stop == Stop(4, "stop", len("w0 w1 "))
    kept = generated[: stop.keep]
    assert decode(kept)[: stop.text_end] == "w0 w1 " and eos not in kept
    # the stop string ending on the very token before EOS still wins
    generated = [_word(0), _word(1), _word(5), _word(6), eos, _word(8)]
    assert criteria.check(generated, num_new=4, context_full=False) == Stop(4, "stop", len("w0 w1 "))


def test_eos_before_a_stop_string_in_the_same_block_wins():
    decode = _word_decode()
    eos = 0
    criteria = StoppingCriteria(50, frozenset({eos}), ["w5 w6"], decode)
    generated = [_word(0), _word(1), eos, _word(5), _word(6), _word(7)]  # what follows EOS is dropped
    assert criteria.check(generated, num_new=4, context_full=False) == Stop(3, "stop")
    # and a stop string that is completed only by tokens after EOS does not count
    generated = [_word(0), _word(5), eos, _word(6)]
    assert criteria.check(generated, num_new=3, context_full=False) == Stop(3, "stop")


def test_stop_string_then_eos_in_one_accepted_block_keeps_tokens_text_and_usage_together():
    tokenizer = tiny_tokenizer()
    target = tiny_llama(seed=1)
    free_run = hf_greedy(target, PROMPT, 20)
    # the target drafting for itself accepts every draft: steps emit tokens 0 | 1-5 | 6-10 | ...
    stop_word = tokenizer.decode([free_run[6]])
    text = tokenizer.decode(free_run, skip_special_tokens=True)
    assert text.find(stop_word) == len(tokenizer.decode(free_run[:6], skip_special_tokens=True)) + 1
    # EOS: a later token of the same step, first seen there
    eos = next(free_run[i] for i in range(7, 11) if free_run[i] not in free_run[:i])
    engine = SpeculativeEngine(target, tokenizer, ModelDrafter(HFModelRunner(target)), num_speculative_tokens=4)
    engine.eos_token_ids = frozenset({eos})
    result = engine.generate([PROMPT], max_new_tokens=20, stop=stop_word)[0]
    assert result.finish_reason == "stop"
    assert result.token_ids == free_run[:7]
    assert result.stats.generated_tokens == 7
    assert result.text == tokenizer.decode(free_run[:6], skip_special_tokens=True) + " "
    assert stop_word not in result.text
