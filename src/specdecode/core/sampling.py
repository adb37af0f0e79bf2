"""Logits processing and sampling, shared by target and drafters.

The same `SamplingParams` must be applied to the target's logits (giving p) and to
the draft's logits (giving q): the accept/reject rule is exact only for the p and q
the tokens were really drawn from. Temperature 0 means greedy and gives a one-hot
distribution on the argmax, so greedy decoding runs through the same rule.

Temperatures below GREEDY_BELOW (1e-5, where vLLM draws the same line) are greedy too:
dividing logits by 1e-38 overflows to inf and the softmax to NaN, and a temperature
that small is greedy in all but ties anyway.

Logits must be finite, or -inf for a token that cannot be produced: NaN or +inf in a
model's output, or a row with every token at -inf, raises NonFiniteLogitsError rather
than being sampled from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from specdecode.errors import InvalidArgumentError

GREEDY_BELOW = 1e-5  # temperatures under this are greedy


class NonFiniteLogitsError(ValueError):
    """The model's logits hold NaN or +inf (or a row is -inf everywhere): nothing can be drawn.

    A ValueError, but not a SpecDecodeError: the request was valid, the model's numbers were not."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None  # drop tokens less likely than min_p times the likeliest (after temperature)

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # NaN and inf too
            raise InvalidArgumentError(
                f"temperature must be >= 0 and finite (0 means greedy), got {self.temperature}", "temperature"
            )
        if self.top_k is not None and self.top_k < 1:
            raise InvalidArgumentError(f"top_k must be a positive integer or None, got {self.top_k}", "top_k")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgumentError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small (< GREEDY_BELOW) that it is treated as 0."""
        return self.temperature < GREEDY_BELOW


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits [..., vocab] into the distribution tokens are drawn from [..., vocab].
    Raises NonFiniteLogitsError for NaN or +inf logits, or a row that is -inf everywhere."""
    if params.greedy:
        check_finite(logits)
        return greedy_probs(logits)
    logits = logits.float() / params.temperature
    check_finite(logits)  # after the division, which can overflow
    return _processed_probs(logits, params)


def greedy_probs(logits: torch.Tensor) -> torch.Tensor:
    """One-hot on the argmax (first index on ties, as torch.argmax and transformers do)."""
    return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def row_maxima(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [..., vocab] -> [...], [...] int64
    """Each row's largest logit and its first index, NaN the largest (torch's `max(dim=-1)`):
    by numpy's vectorized argmax where the rows are float32 on the CPU, which takes a tenth of
    torch's reduction over a vocabulary of 49k (a greedy step's decision, per sequence)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.requires_grad:
        values, indices = logits.max(dim=-1)
        return values, indices
    rows = logits.numpy().reshape(-1, logits.shape[-1])  # [n, vocab]
    argmax = rows.argmax(axis=-1)
    values = rows[np.arange(rows.shape[0]), argmax]
    shape = logits.shape[:-1]
    return torch.from_numpy(values).reshape(shape), torch.from_numpy(argmax).reshape(shape)


def check_finite(logits: torch.Tensor, row_max: torch.Tensor | None = None) -> None:
    """Raise NonFiniteLogitsError unless every row's largest logit is finite: no NaN (max
    propagates it), no +inf, and no row masked to -inf everywhere; -inf elsewhere is a mask.
    row_max: logits.amax(-1), when the caller has it already."""
    row_max = logits.amax(dim=-1) if row_max is None else row_max
    if all(map(math.isfinite, row_max.reshape(-1).tolist())):  # a few maxima: Python's test, not torch's ops
        return
    if bool(torch.isnan(logits).any()):
        problem = "NaN"
    elif bool(torch.isposinf(logits).any()):
        problem = "+inf (or a value the temperature overflowed)"
    else:
        problem = "a row that is -inf for every token"
    raise NonFiniteLogitsError(f"the model's logits contain {problem}; there is no distribution to sample from")


def _processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Top-k, top-p, min-p (in transformers' order) and softmax of finite, tempered float32 logits."""
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        logits = _mask_outside_top_p(logits, params.top_p)
    if params.min_p:
        # p_i < min_p * p_max  <=>  x_i - x_max < log(min_p): the same in logits, whatever was masked
        top = logits.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(logits - top < math.log(params.min_p), float("-inf"))
    return torch.softmax(logits, dim=-1)


def _mask_outside_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    # keep the smallest set of most likely tokens whose mass reaches top_p (always >= 1 token)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of probs [..., vocab] -> [...]: non-negative weights (a softmax,
    or a residual clipped at 0), not necessarily summing to 1.

    By inverting each row's cumulative sum, in float64, at one uniform draw: the first token
    whose cumulative mass exceeds u * total. torch.multinomial draws one exponential per token
    of the vocabulary for each sample, several times slower for a vocabulary as large as the
    default model's (benchmarks/results/sampling-cost.md): a sampled token cost more than a
    drafted one. A token of weight 0 is never drawn: its cumulative mass equals its
    predecessor's, so it is never the first to exceed u * total."""
    flat = probs.reshape(-1, probs.shape[-1])  # [rows, vocab]
    cumulative = flat.cumsum(dim=-1, dtype=torch.float64)  # [rows, vocab]
    total = cumulative[:, -1:]  # [rows, 1]
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError("probabilities to sample from must be finite and not all zero")
    u = torch.rand(flat.shape[0], 1, dtype=torch.float64, generator=generator)  # [rows, 1] in [0, 1)
    tokens = torch.searchsorted(cumulative, u * total, right=True)  # [rows, 1]
    # u * total < total exactly; rounded, it can equal total, past every index: take the last
    # token with mass instead (about once in 2^53 draws)
    for row in (tokens[:, 0] >= flat.shape[-1]).nonzero()[:, 0].tolist():
        tokens[row, 0] = int(flat[row].nonzero()[-1])
    return tokens.reshape(probs.shape[:-1])
