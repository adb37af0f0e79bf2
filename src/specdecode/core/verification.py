"""The accept/reject rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023),
for chains and for trees of draft tokens (SpecInfer, Miao et al. 2024; Sequoia, Chen et al. 2024).

Vocabulary used throughout the package:
- draft tokens: the tokens x_1..x_k a drafter proposed, drawn from its distributions q_i; a
  chain, or the nodes of a tree (drafters/base.py: each node's parent, the root being the
  sequence's last token).
- accepted tokens: the longest prefix of a chain that survives the rule below; of a tree, the
  accepted path: the nodes, root to leaf, that the tree rule below follows.
- accepted depth: the length of the accepted path (of a chain: the accepted tokens).
- recovered token: at the first rejection, a token drawn from norm(max(0, p_i - q_i)),
  the part of the target's distribution the draft under-covers.
- bonus token: when all k drafts are accepted, a token drawn from the target's
  distribution after the last draft, p_{k+1}; the target forward computed it for free.

Every verification step therefore emits accepted + 1 tokens, and the emitted sequence
is distributed exactly as if the target had sampled it token by token. A drafter
without a distribution (n-gram lookup) counts as one-hot q. With temperature 0 both p
and q are one-hot (see sampling.py), and the rule reduces to "accept while the draft
equals the target's argmax, then emit the target's argmax".

Trees (`verify_tree`). The target's logits come for every node: row 0 after the root, row
1 + i after node i. From the root, the rule draws y from the target's distribution p at the
current node (greedy: y is its argmax), moves to the child whose token is y, and goes on
from there; where no child has y, y is the step's next token. Every emitted token is then a
draw from p after exactly the tokens before it, so the output follows the target's law for
any temperature, top-k and top-p, and at temperature 0 it is the target's own greedy text.
This is exact for drafts that do not depend on the draws (one-hot drafts: a function of the
context), whatever their shape; if two children share a token the first one wins, and the
later one is never reached. Trees are one-hot only (`Draft` refuses probs with parents):
drafts drawn from a q, with several children, would need recursive rejection with q
renormalised over the children not yet tried (SpecInfer, Sequoia) to use q; stochastic
drafts are chains, verified by the chain rule above. A chain is verified by the chain rule
even when it could go through the tree rule (the same law for one-hot drafts, but other
random numbers): seeded chain samples stay what they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.core.sampling import SamplingParams, check_finite, logits_to_probs, row_maxima, sample


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # the accepted depth
    next_token: int  # the recovered token, or the bonus token when all drafts were accepted
    path: tuple[int, ...]  # the accepted nodes' indices, root to leaf; a chain's: 0 .. num_accepted - 1


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
        return Verdict(k, int(sample(target_probs[k], generator)), tuple(range(k)))
    first = int(rejected[0])
    recovered = int(sample(_residual(target_probs[first], draft_probs, draft_tokens, first), generator))
    return Verdict(first, recovered, tuple(range(first)))


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
    row_max, argmax = row_maxima(target_logits)  # [k + 1], the first index on ties, as logits_to_probs
    check_finite(target_logits, row_max)
    drafted, predicted = draft_tokens.tolist(), argmax.tolist()  # a few tokens: lists, not torch's ops
    accepted = next((i for i, (d, p) in enumerate(zip(drafted, predicted)) if d != p), len(drafted))
    return Verdict(accepted, predicted[accepted], tuple(range(accepted)))


def verify_tree(
    draft_tokens: torch.Tensor,  # [n] int64, the tree's nodes in topological order
    parents: torch.Tensor | list[int],  # [n] parents[i] < i, or -1 for the root
    target_logits: torch.Tensor,  # [n + 1, vocab] raw logits: row 0 after the root, row 1 + i after node i
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    """The tree rule (module docstring) for one-hot drafts: from the root, draw y from the
    target at the current node (its argmax when greedy), follow the first child whose token is
    y, and emit y where none is. Only the rows on the accepted path are processed and drawn
    from. Raises NonFiniteLogitsError for NaN or +inf logits in any row, as the chain rule does."""
    row_max, argmax = row_maxima(target_logits)  # the first index on ties, as logits_to_probs
    check_finite(target_logits, row_max)
    children = _children(draft_tokens.tolist(), parents.tolist() if isinstance(parents, torch.Tensor) else parents)
    path: list[int] = []
    node = -1  # the root
    while True:
        row = node + 1
        if params.greedy:
            y = int(argmax[row])
        else:
            y = int(sample(logits_to_probs(target_logits[row], params), generator))
        child = children[row].get(y)
        if child is None:
            return Verdict(len(path), y, tuple(path))
        path.append(child)
        node = child


def _children(tokens: list[int], parents: list[int]) -> list[dict[int, int]]:
    """For the root (index 0) and each node i (index 1 + i): its children, token -> the first
    child with that token (a later child with the same token is never reached)."""
    if len(parents) != len(tokens) or any(not -1 <= p < i for i, p in enumerate(parents)):
        raise ValueError(f"a tree's parents must come before their children (-1 for the root), got {parents}")
    children: list[dict[int, int]] = [{} for _ in range(len(tokens) + 1)]
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        children[parent + 1].setdefault(token, i)
    return children
