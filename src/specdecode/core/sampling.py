"""Logits processing and sampling, shared by target and drafters.

The same `SamplingParams` must be applied to the target's logits (giving p) and to
the draft's logits (giving q): the accept/reject rule is exact only for the p and q
the tokens were really drawn from. Temperature 0 means greedy and gives a one-hot
distribution on the argmax, so greedy decoding runs through the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.errors import InvalidArgumentError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InvalidArgumentError(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature}", "temperature"
            )
        if self.top_k is not None and self.top_k < 1:
            raise InvalidArgumentError(f"top_k must be a positive integer or None, got {self.top_k}", "top_k")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits [..., vocab] into the distribution tokens are drawn from [..., vocab]."""
    if params.greedy:
        # one-hot on the argmax (first index on ties, as torch.argmax and transformers do)
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    logits = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        logits = _mask_outside_top_p(logits, params.top_p)
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
    """Draw one token per row of probs [..., vocab] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
