"""What was generated, next to how fast: a speedup only counts if the output is right.

Greedy runs: every output is compared with its reference's on the same prompt: a speculative
system's with the same framework's target-only output ((d) with (c), (f) with (e)), every other
system's with transformers' own greedy output (a). Where one differs, the target's two top
logits at the first differing position are kept: a gap of a few 1e-5 is a numerical near-tie (a
batched forward adds in another order), not a bug. Sampling runs: outputs cannot be compared
token by token, so each is scored by the target's perplexity of it (temperature 1, no
filtering); systems that sample the same distribution score alike on average.

The scripts in benchmarks/ score runners rather than systems: `runner_perplexity` of a fixed
text and `greedy_agreement` with a reference runner along a greedy path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.bench.measurement import Measurement
from specdecode.runners import ModelRunner

REFERENCE = {"a": "a", "b": "a", "c": "a", "d": "c", "e": "a", "f": "e"}  # each group's greedy reference


@dataclass
class Difference:
    system: str
    prompt_id: str
    category: str
    run: int
    position: int  # first new token that differs from its reference's output (REFERENCE)
    reference_token: int | None  # the reference's token there; None if the reference had ended
    system_token: int | None
    top_two: list[dict]  # the target's two most likely tokens there: token id, text, logit

    @property
    def logit_gap(self) -> float:
        return self.top_two[0]["logit"] - self.top_two[1]["logit"]

    def to_dict(self) -> dict:
        return {**vars(self), "logit_gap": self.logit_gap}


def compare_greedy(
    measurements: list[Measurement],
    prompt_ids: dict[str, list[int]],
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
) -> list[Difference]:
    """Set each measurement's first_difference from its reference's output; explain every difference.

    The reference of a speculative system is its own framework's target-only run, where there is
    one: this engine's (d) against (c), llama.cpp's prompt lookup (f) against its plain decoding
    (e), since speculation is exact relative to the target as that framework runs it. The
    engine's kernels (and llama.cpp's, on the .gguf's blocks) round some near-ties differently
    from transformers' (a), so (c) and (e) against (a) show the runner, and (d) against (c), (f)
    against (e), show speculation. Every other system's reference is (a)."""
    outputs = {(m.group, m.prompt_id, m.run): m.token_ids for m in measurements if m.group in REFERENCE.values()}
    differences = []
    for m in measurements:
        group = REFERENCE[m.group]
        group = group if (group, m.prompt_id, m.run) in outputs else "a"
        expected = outputs[(group, m.prompt_id, m.run)]
        m.first_difference = first_difference(expected, m.token_ids)
        if m.first_difference is None:
            continue
        position = m.first_difference
        context = prompt_ids[m.prompt_id] + expected[:position]
        differences.append(
            Difference(
                m.system,
                m.prompt_id,
                m.category,
                m.run,
                position,
                _token_at(expected, position),
                _token_at(m.token_ids, position),
                top_two_logits(model, tokenizer, context),
            )
        )
    return differences


def first_difference(expected: list[int], actual: list[int]) -> int | None:
    """The first position where the two differ (a length counts), or None if they are equal."""
    if expected == actual:
        return None
    return next((i for i, (e, a) in enumerate(zip(expected, actual)) if e != a), min(len(expected), len(actual)))


def top_two_logits(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, ids: list[int]) -> list[dict]:
    """The target's two most likely next tokens after ids, from one uncached forward."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device), logits_to_keep=1).logits[0, -1].float()
    values, tokens = logits.topk(2)
    return [
        {"token": int(t), "text": tokenizer.decode([int(t)]) if tokenizer else None, "logit": float(v)}
        for v, t in zip(values, tokens)
    ]


def add_perplexities(measurements: list[Measurement], prompt_ids: dict[str, list[int]], model: PreTrainedModel) -> None:
    """Set each measurement's perplexity; equal outputs of the same prompt are scored once."""
    scored: dict[tuple, float | None] = {}
    for m in measurements:
        key = (m.prompt_id, tuple(m.token_ids))
        if key not in scored:
            scored[key] = target_perplexity(model, prompt_ids[m.prompt_id], m.token_ids)
        m.perplexity = scored[key]


def target_perplexity(model: PreTrainedModel, prompt: list[int], generated: list[int]) -> float | None:
    """exp(mean negative log-likelihood) of the generated tokens under the target, given the prompt."""
    if not generated:
        return None
    ids = torch.tensor([prompt + generated], device=model.device)
    with torch.inference_mode():
        # the logits that predict each generated token: the last len(generated) + 1, less the final one
        logits = model(ids, logits_to_keep=len(generated) + 1).logits[0, :-1].float()
    nll = F.cross_entropy(logits, torch.tensor(generated, device=logits.device))
    return math.exp(float(nll))


def _token_at(tokens: list[int], position: int) -> int | None:
    return tokens[position] if position < len(tokens) else None


def runner_perplexity(runner: ModelRunner, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:] under the runner, in one uncached forward."""
    runner.reset()
    logits = runner.forward(torch.tensor(token_ids), len(token_ids))[:-1]  # [n - 1, vocab]
    nll = F.cross_entropy(logits.double(), torch.tensor(token_ids[1:]))
    return float(torch.exp(nll))


def chunked_perplexity(runner: ModelRunner, ids: torch.Tensor, chunk: int = 256) -> float:
    """exp(mean NLL of ids[1:]) under the runner, prefilled in chunks of `chunk` tokens with
    every row's logits (a large vocabulary's logits for a whole text do not fit at once)."""
    runner.reset()
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start : min(start + chunk, len(ids) - 1)]
        logits = runner.forward(piece, len(piece))
        targets = ids[start + 1 : start + 1 + len(piece)]
        nll += float(F.cross_entropy(logits.double(), targets, reduction="sum"))
        count += len(piece)
    return math.exp(nll / count)


def greedy_agreement(
    runner: ModelRunner, reference: ModelRunner, prompt_ids: list[int], greedy: list[int]
) -> tuple[float, float]:
    """(share of reference's greedy tokens the runner reproduces before its first difference, share
    of positions where the two argmaxes agree along that greedy path)."""
    sequence = prompt_ids + greedy
    argmaxes = []
    for r in (runner, reference):
        r.reset()
        argmaxes.append(r.forward(torch.tensor(sequence[:-1]), len(greedy)).argmax(-1))
    same = (argmaxes[0] == argmaxes[1]).tolist()
    prefix = same.index(False) if False in same else len(same)
    return prefix / len(greedy), sum(same) / len(same)
