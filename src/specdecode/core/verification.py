"""The accept/reject rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

Vocabulary used throughout the package:
- draft tokens: the k tokens x_1..x_k a drafter proposed, drawn from its distributions q_i.
- accepted tokens: the longest prefix of the draft that survives the rule below.
- recovered token: at the first rejection, a token drawn from norm(max(0, p_i - q_i)),
  the part of the target's distribution the draft under-covers.
- bonus token: when all k drafts are accepted, a token drawn from the target's
  distribution after the last draft, p_{k+1}; the target forward computed it for free.

Every verification step therefore emits accepted + 1 tokens, and the emitted sequence
is distributed exactly as if the target had sampled it token by token. A drafter
without a distribution (n-gram lookup) counts as one-hot q. With temperature 0 both p
and q are one-hot (see sampling.py), and the rule reduces to "accept while the draft
equals the target's argmax, then emit the target's argmax".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.core.sampling import SamplingParams, check_finite, logits_to_probs, sample


@dataclass(frozen=True)
class Verdict:
    num_accepted: int
    next_token: int  # the recovered token, or the bonus token when all drafts were accepted


def verify(
    draft_tokens: torch.Tensor,  # [k] int64
    draft_probs: torch.Tensor | None,  # [k, vocab] q, or None for a one-hot drafter
    target_probs: torch.Tensor,  # [k + 1, vocab] p, after the same logits processing as q
    generator: torch.Generator | None,
) -> Verdict:
    k = draft_tokens.shape[0]
    positions = torch.arange(k)
    p_of_draft = target_probs[positions, draft_tokens]  # [k]
    q_of_draft = torch.ones(k) if draft_probs is None else draft_probs[positions, draft_tokens]  # [k]
    # accept x_i with probability min(1, p(x_i) / q(x_i)); u < p/q  <=>  u * q < p. Written
    # as "accepted iff u * q < p" so that a NaN in p or q (every comparison False) rejects
    u = torch.rand(k, generator=generator)
    rejected = (~(u * q_of_draft < p_of_draft)).nonzero()
    if rejected.numel() == 0:
        # all accepted: the bonus token comes from the target's distribution after the last draft
        return Verdict(k, int(sample(target_probs[k], generator)))
    first = int(rejected[0])
    return Verdict(first, int(sample(_residual(target_probs[first], draft_probs, draft_tokens, first), generator)))


def _residual(
    p: torch.Tensor,  # [vocab] target distribution at the rejected position
    draft_probs: torch.Tensor | None,  # [k, vocab]
    draft_tokens: torch.Tensor,  # [k]
    position: int,
) -> torch.Tensor:  # [vocab]
    """norm(max(0, p - q)): what p has that q lacks at the rejected position."""
    if draft_probs is None:
        q = torch.zeros_like(p)
        q[draft_tokens[position]] = 1.0
    else:
        q = draft_probs[position]
    residual = p - q
    residual = residual.where(residual > 0, 0.0)  # max(0, p - q), with a NaN counted as 0
    total = residual.sum()
    # p == q up to rounding: a rejection then had probability ~0, and p itself is the right law
    return residual / total if total > 1e-12 else p


def verify_logits(
    draft_tokens: torch.Tensor,  # [k] int64
    draft_probs: torch.Tensor | None,  # [k, vocab] q, or None for a one-hot drafter
    target_logits: torch.Tensor,  # [k + 1, vocab] the target's raw logits
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    """`verify` on the target's logits. At temperature 0, p is one-hot on the argmax, so the
    rule is decided by comparing with the argmax directly: no distributions built, no draws.
    Raises NonFiniteLogitsError (sampling.py) for NaN or +inf logits."""
    if params.greedy:
        return verify_greedy(draft_tokens, target_logits)
    return verify(draft_tokens, draft_probs, logits_to_probs(target_logits, params), generator)


def verify_greedy(
    draft_tokens: torch.Tensor,  # [k] int64
    target_logits: torch.Tensor,  # [k + 1, vocab]
) -> Verdict:
    """Accept while the draft equals the target's argmax; then the argmax (the bonus token if
    all were accepted). Equal to `verify` with one-hot p, whatever q was. Raises
    NonFiniteLogitsError for NaN or +inf logits, as logits_to_probs does."""
    row_max, argmax = target_logits.max(dim=-1)  # [k + 1], the first index on ties, as logits_to_probs
    check_finite(target_logits, row_max)
    k = draft_tokens.shape[0]
    mismatches = (draft_tokens != argmax[:k]).nonzero()
    accepted = int(mismatches[0]) if mismatches.numel() else k
    return Verdict(accepted, int(argmax[accepted]))
