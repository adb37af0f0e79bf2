"""The rest of the sampling API, exact under speculation: logit bias and penalties
(core/adjustments.py), min_p, stop_token_ids and log-probabilities (core/logprobs.py).

Greedy: equal to transformers' generate with the same options (its own repetition penalty and
min_p, and logits processors written here for OpenAI's presence and frequency penalties and
logit bias), target-only and speculative, with drafts kept. Sampling: the G-test against the
adjusted target's exact law, computed here in float64, and a negative control (penalties that
do not count the draft path) that must fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import MinPLogitsWarper

from helpers import ALPHA, assert_drafted_and_accepted, byte_llama, byte_tokenizer, g_test_pvalue, head64_llama
from specdecode import SpeculativeEngine
from specdecode.core import adjustments
from specdecode.core.constraints import Constraint
from specdecode.core.sampling import SamplingParams, logits_to_probs
from specdecode.drafters import ModelDrafter, PromptLookupDrafter, RecyclingDrafter
from specdecode.errors import InvalidArgumentError
from specdecode.runners import HFModelRunner

TOKENIZER = byte_tokenizer()
PROMPTS = ["the cat sat on the mat. the cat sat on the", "abcabcabc abcabc ab"]


@pytest.fixture(scope="module")
def model():
    return byte_llama(seed=2)


@pytest.fixture(scope="module")
def letters_model():
    """A model whose law over OUTCOMES below is spread (seed 2's puts nearly all on one)."""
    return byte_llama(seed=5)


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens, then its logit bias:
    the reference, written from OpenAI's definition alone."""

    def __init__(self, prompt_length: int, presence: float, frequency: float, bias: dict[int, float]):
        self.prompt_length, self.presence, self.frequency, self.bias = prompt_length, presence, frequency, bias

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        generated = input_ids[0, self.prompt_length :].tolist()
        for token in set(generated):
            scores[0, token] -= self.frequency * generated.count(token) + self.presence
        for token, bias in self.bias.items():
            scores[0, token] += bias
        return scores


def hf_reference(target, tokenizer, prompt: str, max_new_tokens: int, **options) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    penalties = OpenAIPenalties(
        ids.shape[1],
        options.get("presence_penalty", 0.0),
        options.get("frequency_penalty", 0.0),
        options.get("logit_bias", {}),
    )
    out = target.generate(
        ids,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        repetition_penalty=options.get("repetition_penalty", 1.0),
        logits_processor=LogitsProcessorList([penalties]),
        eos_token_id=[tokenizer.eos_token_id, *options.get("stop_token_ids", [])],
        pad_token_id=tokenizer.eos_token_id,
    )
    return out[0, ids.shape[1] :].tolist()


def engines(target, tokenizer):
    yield "target-only", SpeculativeEngine(target, tokenizer, None)
    yield (
        "self-drafted",
        SpeculativeEngine(target, tokenizer, ModelDrafter(HFModelRunner(target)), num_speculative_tokens=4),
    )
    yield "prompt-lookup", SpeculativeEngine(target, tokenizer, PromptLookupDrafter(), num_speculative_tokens=4)


def tid(char: str) -> int:
    (token,) = TOKENIZER(char).input_ids
    return token


OPTIONS = {
    "repetition": dict(repetition_penalty=1.4),
    "presence and frequency": dict(presence_penalty=1.2, frequency_penalty=0.7),
    "logit bias": dict(logit_bias={tid(" "): 4.0, tid("t"): -100.0, tid("a"): 2.5}),
    "all": dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=0.4, logit_bias={tid("e"): 3.0}),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_greedy_adjusted_output_is_transformers_generate_with_the_same_options(model, name):
    target, tokenizer = model
    options = OPTIONS[name]
    for prompt in PROMPTS:
        expected = hf_reference(target, tokenizer, prompt, 40, **options)
        plain = hf_reference(target, tokenizer, prompt, 40)
        assert expected != plain, "the options must change the answer, or this test proves nothing"
        for engine_name, engine in engines(target, tokenizer):
            result = engine.generate(prompt, max_new_tokens=40, **options)[0]
            assert result.token_ids == expected, (name, engine_name, prompt)
            if engine_name == "self-drafted":
                assert_drafted_and_accepted([result], engine_name)


def test_stop_token_ids_end_the_answer_as_eos_does(model):
    target, tokenizer = model
    prompt = PROMPTS[0]
    plain = hf_reference(target, tokenizer, prompt, 40)
    stop = plain[5]  # a token the answer holds
    expected = hf_reference(target, tokenizer, prompt, 40, stop_token_ids=[stop])
    assert len(expected) == plain.index(stop) + 1
    for name, engine in engines(target, tokenizer):
        result = engine.generate(prompt, max_new_tokens=40, stop_token_ids=[stop])[0]
        assert result.token_ids == expected and result.finish_reason == "stop", name


def test_min_p_is_transformers_min_p():
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(0)) * 3
    for min_p in (0.01, 0.1, 0.5):
        ours = logits_to_probs(logits, SamplingParams(temperature=0.7, min_p=min_p))
        warped = MinPLogitsWarper(min_p)(None, logits / 0.7)
        assert torch.allclose(ours, torch.softmax(warped, dim=-1), atol=1e-6), min_p
        assert ((ours > 0).sum(-1) < 300).all()  # it cut something
    assert torch.equal(
        logits_to_probs(logits, SamplingParams(min_p=0.5)), logits_to_probs(logits, SamplingParams())
    )  # greedy ignores it


def test_logprobs_are_the_targets_own_with_and_without_drafts(model):
    target, tokenizer = model
    prompt = PROMPTS[0]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = target.generate(
        ids,
        max_new_tokens=24,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    reference = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)  # [24, vocab]
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    for name, engine in engines(target, tokenizer):
        result = engine.generate(prompt, max_new_tokens=24, logprobs=3)[0]
        assert result.token_ids == tokens, name
        assert [lp.token for lp in result.logprobs] == tokens
        chosen = torch.tensor([lp.logprob for lp in result.logprobs])
        assert torch.allclose(chosen, reference[torch.arange(24), tokens], atol=1e-4), name
        for i, lp in enumerate(result.logprobs):
            assert [t for t, _ in lp.top] == reference[i].topk(3).indices.tolist(), (name, i)
            assert lp.top[0] == (lp.token, lp.logprob)  # greedy: the chosen token is the likeliest
        if name == "self-drafted":
            assert_drafted_and_accepted([result], name)
    assert engine.generate(prompt, max_new_tokens=4)[0].logprobs is None  # only when asked


def test_bad_options_are_one_error_naming_them(model):
    target, tokenizer = model
    engine = SpeculativeEngine(target, tokenizer, None)
    bad = [
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={5: 101}), "logit_bias"),
        (dict(logit_bias={10_000: 1.0}), "logit_bias"),
        (dict(logit_bias={"x": 1.0}), "logit_bias"),
        (dict(logit_bias={i: 1.0 for i in range(adjustments.MAX_LOGIT_BIAS_TOKENS + 1)}), "logit_bias"),
        (dict(min_p=1.5), "min_p"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=list(range(100))), "stop_token_ids"),
        (dict(logprobs=21), "logprobs"),
    ]
    for options, param in bad:
        with pytest.raises(InvalidArgumentError) as error:
            engine.generate("x", max_new_tokens=4, **options)
        assert error.value.param == param, options


# --- sampling: the adjusted target's exact law ---

# three letters, then EOS: the third's penalties count the second, a draft token when the
# second and third are drafted together (the first is never drafted: a prefill drafts nothing)
THREE_LETTERS = Constraint.regex("[ab][ab][ab]")
OUTCOMES = [x + y + z for x in "ab" for y in "ab" for z in "ab"]
PROMPT_OF_LETTERS = "abbaabab aabbab"  # prompt lookup drafts letters from it: one-hot drafts
SAMPLED = dict(
    temperature=1.0,
    presence_penalty=1.0,
    frequency_penalty=0.5,
    repetition_penalty=1.2,
    logit_bias={tid("b"): 0.3},
    min_p=0.05,
)


def adjusted_law(target, tokenizer, prompt: str) -> np.ndarray:
    """P(each of OUTCOMES) under the target with SAMPLED's options and the grammar's masks, in float64
    (temperature 1: the tempered logits are the logits)."""
    model64 = target.to(torch.float64)
    ids = tokenizer(prompt).input_ids
    letters = {"a": tid("a"), "b": tid("b")}

    def letter_probs(generated: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model64(torch.tensor([ids + generated])).logits[0, -1].numpy().copy()
        for token in set(ids + generated):  # repetition: the prompt and the generated tokens
            r = SAMPLED["repetition_penalty"]
            logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
        for token in set(generated):  # presence and frequency: the generated tokens
            logits[token] -= SAMPLED["frequency_penalty"] * generated.count(token) + SAMPLED["presence_penalty"]
        for token, bias in SAMPLED["logit_bias"].items():
            logits[token] += bias
        z = np.array([logits[t] for t in letters.values()])
        p = np.exp(z - z.max())
        p = np.where(p < SAMPLED["min_p"] * p.max(), 0.0, p)  # min_p, after the grammar's mask
        return dict(zip(letters.values(), p / p.sum(), strict=True))

    def probability(outcome: str) -> float:
        tokens = [letters[c] for c in outcome]
        return float(np.prod([letter_probs(tokens[:i])[t] for i, t in enumerate(tokens)]))

    law = np.array([probability(o) for o in OUTCOMES])
    target.to(torch.float32)
    return law


def sampled_counts(engine, prompt: str, samples: int = 1500) -> tuple[np.ndarray, int]:
    results = engine.generate([prompt] * samples, max_new_tokens=5, seed=7, constraint=THREE_LETTERS, **SAMPLED)
    counts = np.zeros(len(OUTCOMES))
    for r in results:
        if r.text in OUTCOMES:
            counts[OUTCOMES.index(r.text)] += 1
    return counts, samples - int(counts.sum())


def sampling_engine(target, tokenizer):
    return SpeculativeEngine(target, tokenizer, PromptLookupDrafter(), num_speculative_tokens=3)


def test_sampled_adjusted_output_has_the_adjusted_targets_law(letters_model):
    target, tokenizer = letters_model
    counts, invalid = sampled_counts(sampling_engine(target, tokenizer), PROMPT_OF_LETTERS)
    assert invalid == 0
    assert g_test_pvalue(counts, adjusted_law(target, tokenizer, PROMPT_OF_LETTERS)) > ALPHA


def test_negative_control_penalties_that_ignore_the_draft_path_fail(letters_model, monkeypatch):
    """Every row penalized by the committed tokens alone (a draft's own tokens not counted): a
    drafted third letter escapes the penalty for repeating the drafted second, and the law moves."""
    target, tokenizer = letters_model
    real = adjustments._counts_per_row

    def without_paths(generated, tokens, parents, vocab_size):
        counts = real(generated, tokens, parents, vocab_size)
        return counts[:1].expand_as(counts).clone()

    monkeypatch.setattr(adjustments, "_counts_per_row", without_paths)
    counts, _ = sampled_counts(sampling_engine(target, tokenizer), PROMPT_OF_LETTERS)
    assert g_test_pvalue(counts, adjusted_law(target, tokenizer, PROMPT_OF_LETTERS)) < ALPHA


def test_drafts_were_verified_in_the_sampling_test(letters_model):
    target, tokenizer = letters_model
    engine = sampling_engine(target, tokenizer)
    results = engine.generate([PROMPT_OF_LETTERS] * 40, max_new_tokens=5, seed=3, constraint=THREE_LETTERS, **SAMPLED)
    assert_drafted_and_accepted(results)


def test_trees_see_each_nodes_own_penalties():
    """Token recycling's trees on the fast runner: every node's row adjusted by its own path,
    equal to the same runner's target-only decoding with the same options."""
    tokenizer = TOKENIZER
    target = head64_llama(2, torch.float32, len(tokenizer))  # head_dim 64: the tree kernel's
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    options = OPTIONS["all"]
    drafter = RecyclingDrafter(len(tokenizer), 4, PromptLookupDrafter(tree=True))
    trees = SpeculativeEngine(target, tokenizer, drafter, num_speculative_tokens=6, runner="fast")
    alone = SpeculativeEngine(target, tokenizer, None, runner="fast")
    if not trees.decoder.verifies_trees:
        pytest.skip("the fast runner verifies trees only with its C kernel")
    stats = []
    for prompt in PROMPTS * 2:  # the second time round, the table has learnt the answers
        result = trees.generate(prompt, max_new_tokens=40, **options)[0]
        assert result.token_ids == alone.generate(prompt, max_new_tokens=40, **options)[0].token_ids
        stats.append(result.stats)
    assert sum(s.tree_steps for s in stats) > 0 and sum(s.tree_accepted_depth for s in stats) > 0
