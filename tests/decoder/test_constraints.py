"""Structured outputs (core/constraints.py): the constrained target's output, exactly, with
drafts. Greedy: equal to transformers' generate with the grammar as a logits processor, target-
only and speculative, with the grammar's forced tokens drafted and kept. Sampling: the G-test
against the constrained target's exact law, and a negative control (masks that do not follow
the draft) that must fail."""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from helpers import ALPHA, assert_drafted_and_accepted, byte_llama, g_test_pvalue
from specdecode import SpeculativeEngine
from specdecode.core import constraints
from specdecode.core.constraints import Constraint
from specdecode.drafters import ModelDrafter, PromptLookupDrafter
from specdecode.errors import InvalidArgumentError
from specdecode.runners import HFModelRunner

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "parrot"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json_schema": Constraint.json_schema(SCHEMA),
    "json": Constraint.json_object(),
    "regex": Constraint.regex(r"[a-c]{3}-[0-9]{2}"),
    "choice": Constraint.choice(["yes", "no", "maybe so"]),
    "grammar": Constraint.grammar('start: "items: [" item ("," item)* "]"\nitem: /[xyz]/'),
}


@pytest.fixture(scope="module")
def model():
    return byte_llama()


class GrammarProcessor(LogitsProcessor):
    """The grammar as transformers' logits processor: the reference, written on llguidance alone."""

    def __init__(self, tokenizer, constraint: Constraint, vocab_size: int, prompt_length: int):
        self.matcher = llguidance.LLMatcher(
            llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size), constraint.lark()
        )
        self.vocab_size, self.prompt_length, self.consumed = vocab_size, prompt_length, 0

    def __call__(self, input_ids, scores):
        new = input_ids[0, self.prompt_length :].tolist()
        for token in new[self.consumed :]:
            assert self.matcher.consume_token(token)
        self.consumed = len(new)
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: self.vocab_size].astype(bool))
        return scores.masked_fill(~allowed, float("-inf"))


def hf_constrained(target, tokenizer, prompt: str, constraint: Constraint, max_new_tokens: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    processor = GrammarProcessor(tokenizer, constraint, target.config.vocab_size, ids.shape[1])
    out = target.generate(
        ids,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        logits_processor=LogitsProcessorList([processor]),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    return out[0, ids.shape[1] :].tolist()


def follows(constraint: Constraint, text: str) -> bool:
    if constraint.kind in ("json", "json_schema"):
        value = json.loads(text)
        if constraint.kind == "json":
            return isinstance(value, dict)
        return set(value) == {"name", "age", "pet"} and value["pet"] in SCHEMA["properties"]["pet"]["enum"]
    if constraint.kind == "regex":
        return re.fullmatch(constraint.value, text) is not None
    if constraint.kind == "choice":
        return text in json.loads(constraint.value)
    return re.fullmatch(r"items: \[[xyz](,[xyz])*\]", text) is not None


def engines(target, tokenizer):
    yield "target-only", SpeculativeEngine(target, tokenizer, None)
    yield (
        "self-drafted",
        SpeculativeEngine(target, tokenizer, ModelDrafter(HFModelRunner(target)), num_speculative_tokens=4),
    )
    yield "prompt-lookup", SpeculativeEngine(target, tokenizer, PromptLookupDrafter(), num_speculative_tokens=4)


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_greedy_constrained_output_is_transformers_generate_with_the_grammar(model, kind):
    target, tokenizer = model
    constraint = CONSTRAINTS[kind]
    for prompt in ['{"name": "ann", "age": 3', "hello"]:
        expected = hf_constrained(target, tokenizer, prompt, constraint, 60)
        for name, engine in engines(target, tokenizer):
            result = engine.generate(prompt, max_new_tokens=60, constraint=constraint)[0]
            assert result.token_ids == expected, (kind, name, prompt)
            if result.finish_reason == "stop":
                assert follows(constraint, result.text), (kind, result.text)
            if name != "target-only" and kind in ("json_schema", "choice", "grammar"):
                # keys, quotes, braces and the rest of a choice are forced: drafted, verified and kept
                assert result.stats.forced_accepted > 0, (kind, name, result.stats)


def test_a_drafter_the_grammar_refuses_keeps_nothing_it_should_not(model):
    target, tokenizer = model
    constraint = CONSTRAINTS["regex"]
    # the prompt repeats text the grammar forbids: prompt lookup drafts it, verification rejects it
    prompt = "zzz-zz zzz-zz zzz-zz"
    engine = SpeculativeEngine(target, tokenizer, PromptLookupDrafter(), num_speculative_tokens=4)
    result = engine.generate(prompt, max_new_tokens=20, constraint=constraint)[0]
    assert result.token_ids == hf_constrained(target, tokenizer, prompt, constraint, 20)
    assert follows(constraint, result.text)


def test_a_bad_constraint_is_one_error_naming_it(model):
    target, tokenizer = model
    engine = SpeculativeEngine(target, tokenizer, None)
    with pytest.raises(InvalidArgumentError, match="regex constraint is not valid"):
        engine.generate("x", max_new_tokens=4, constraint=Constraint.regex("[a-"))
    with pytest.raises(InvalidArgumentError, match="unknown constraint"):
        Constraint("yaml")


def test_a_drafters_chain_is_cut_where_the_grammar_forbids_and_extended_where_it_forces(model):
    target, tokenizer = model
    matcher = SpeculativeEngine(target, tokenizer, None).grammars.matcher(CONSTRAINTS["regex"])  # [a-c]{3}-[0-9]{2}
    ids = lambda text: tokenizer(text).input_ids  # noqa: E731 - one token a byte
    assert matcher.checked_chain([], ids("abz1"), 8) == (2, [])  # z is forbidden: cut there
    assert matcher.checked_chain([], ids("abc"), 8) == (3, ids("-"))  # then the hyphen is forced
    assert matcher.checked_chain(ids("a"), ids("bc"), 8) == (2, ids("-"))  # behind forced tokens
    assert matcher.checked_chain([], ids("abc"), 0) == (3, [])
    assert matcher.allowed().sum() == 3  # the matcher was left at the start


def test_greedy_masks_keep_every_rows_masked_argmax(model):
    """Greedy rows whose argmax the grammar allows skip the mask: each row's argmax is still the
    masked argmax, on random logits and draft trees, through allowed and forbidden paths."""
    target, tokenizer = model
    grammars = SpeculativeEngine(target, tokenizer, None).grammars
    generator = torch.Generator().manual_seed(0)
    token = tokenizer.convert_tokens_to_ids
    skipped = 0
    for constraint in (CONSTRAINTS["regex"], CONSTRAINTS["json_schema"]):
        matcher = grammars.matcher(constraint)
        for trial in range(40):
            letters = [token(c) for c in "ab-1{"]
            tokens = [letters[int(i)] for i in torch.randint(len(letters), (4,), generator=generator)]
            parents = [-1, 0, 0, 1] if trial % 2 else [-1, 0, 1, 2]
            logits = torch.randn(5, len(tokenizer), generator=generator)
            if trial % 3 == 0:  # make an allowed token the argmax of some rows
                logits[:, token("a")] += 10
            fast = matcher.masked(logits, tokens, parents, greedy=True)
            full = matcher.masked(logits, tokens, parents)
            assert torch.equal(fast.argmax(-1), full.argmax(-1)), (constraint.kind, tokens, parents)
            skipped += int((fast == logits).all(-1).sum())
    assert skipped > 0  # some rows were kept as they were


# --- sampling: the constrained target's exact law ---

# two letters, then EOS: the second from another set than the first, so that a mask that does
# not follow the draft path is wrong at the draft's second row
TWO_LETTERS = Constraint.regex("[ab][cd]")
OUTCOMES = [a + b for a in "ab" for b in "cd"]
PROMPT_OF_LETTERS = "acbdadbcacbd"  # prompt lookup drafts letters from it: one-hot drafts the grammar allows
SAMPLED = dict(temperature=1.0)


def constrained_law(target, tokenizer, prompt: str) -> np.ndarray:
    """P(each of OUTCOMES) under the target with the grammar's masks, in float64."""
    model64 = target.to(torch.float64)
    ids = tokenizer(prompt).input_ids
    token = tokenizer.convert_tokens_to_ids

    def masked(prefix: list[int], letters: str) -> np.ndarray:
        with torch.no_grad():
            logits = model64(torch.tensor([ids + prefix])).logits[0, -1].numpy()
        allowed = [token(c) for c in letters]
        z = np.full_like(logits, -np.inf)
        z[allowed] = logits[allowed]
        p = np.exp(z - z.max())
        return p / p.sum()

    law = np.array([masked([], "ab")[token(o[0])] * masked([token(o[0])], "cd")[token(o[1])] for o in OUTCOMES])
    target.to(torch.float32)
    return law


def sampled_counts(engine, prompt: str, samples: int = 1500) -> tuple[np.ndarray, int]:
    results = engine.generate([prompt] * samples, max_new_tokens=5, seed=11, constraint=TWO_LETTERS, **SAMPLED)
    counts = np.zeros(len(OUTCOMES))
    for r in results:
        if r.text in OUTCOMES:
            counts[OUTCOMES.index(r.text)] += 1
    return counts, samples - int(counts.sum())


def sampling_engine(target, tokenizer):
    return SpeculativeEngine(target, tokenizer, PromptLookupDrafter(), num_speculative_tokens=3)


def test_sampled_constrained_output_has_the_constrained_targets_law(model):
    target, tokenizer = model
    counts, invalid = sampled_counts(sampling_engine(target, tokenizer), PROMPT_OF_LETTERS)
    assert invalid == 0
    assert g_test_pvalue(counts, constrained_law(target, tokenizer, PROMPT_OF_LETTERS)) > ALPHA


def test_negative_control_masks_that_ignore_the_draft_path_fail(model, monkeypatch):
    """The root's mask reused for every draft row (a matcher that does not follow the draft):
    a drafted second letter is judged by the first letter's set, so the answers leave the
    grammar (the engine refuses to commit them) or their law."""
    target, tokenizer = model

    def stale(self, logits, tokens, parents, greedy=False):
        return logits.masked_fill(~self.allowed(), float("-inf"))

    monkeypatch.setattr(constraints.Matcher, "masked", stale)
    try:
        counts, invalid = sampled_counts(sampling_engine(target, tokenizer), PROMPT_OF_LETTERS)
    except RuntimeError as error:  # a token outside the grammar reached the matcher
        assert "grammar refused" in str(error)
        return
    law = constrained_law(target, tokenizer, PROMPT_OF_LETTERS)
    assert invalid > 0 or g_test_pvalue(counts, law) < ALPHA


def test_drafts_were_verified_in_the_sampling_test(model):
    target, tokenizer = model
    engine = sampling_engine(target, tokenizer)
    results = engine.generate([PROMPT_OF_LETTERS] * 40, max_new_tokens=5, seed=3, constraint=TWO_LETTERS, **SAMPLED)
    assert_drafted_and_accepted(results)
