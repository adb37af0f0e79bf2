"""Log-probabilities of the emitted tokens (OpenAI's `logprobs`), from the verification forward.

They are the target's own: the log-softmax, in float32, of the target's logits at the position
each token was emitted from, before any bias, penalty, grammar or temperature (vLLM's default,
"raw" log-probabilities). Under speculation each emitted token's row comes from the forward
that verified it (the root's row for the first, then the row after each accepted node), the
same row target-only decoding computes: the values are the target-only run's, bit for bit where
the runner's rows do not depend on the forward's other rows (the fast runners on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the likeliest tokens there, most likely first


def token_logprobs(
    logits: torch.Tensor,  # [n, vocab] the target's raw logits at each emitted token's position
    tokens: list[int],  # [n] the emitted tokens
    top: int,  # how many of the likeliest tokens to list at each position
) -> list[TokenLogprob]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    if top == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen, strict=True)]
    values, ids = logprobs.topk(top, dim=-1)  # [n, top]
    return [
        TokenLogprob(t, lp, tuple(zip(i, v, strict=True)))
        for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist(), strict=True)
    ]
