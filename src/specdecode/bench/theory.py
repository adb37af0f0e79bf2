"""The speedup speculative decoding should give, from acceptance and step costs
(Leviathan et al., 2023, "Fast Inference from Transformers via Speculative Decoding").

Their model: each draft token is accepted with the same probability alpha, independently,
and a step stops at the first rejection. A step with k drafts then emits on average
(1 - alpha^(k+1)) / (1 - alpha) tokens (the target's own token included), and costs one
proposal of k tokens plus one target forward over k + 1 tokens.
"""

from __future__ import annotations

from specdecode.core.adaptive import expected_tokens


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha), k + 1 at alpha = 1: the adaptive policy's own formula
    (core/adaptive.py) with the same acceptance at every position."""
    return expected_tokens([alpha] * k)


def per_token_acceptance(drafted_per_position: list[int], accepted_per_position: list[int]) -> float | None:
    """alpha: the chance a draft token is accepted when every one before it in its step was.

    The engine's acceptance rate (accepted / drafted) is lower than alpha: drafts after a
    rejection count as drafted but were never tested. Position i is tested only in the steps
    that accepted position i - 1 (and drafted position i), so those are the denominator.
    """
    if not drafted_per_position:
        return None
    tested = drafted_per_position[0] + sum(
        min(drafted, accepted_before)
        for drafted, accepted_before in zip(drafted_per_position[1:], accepted_per_position)
    )
    return sum(accepted_per_position) / tested if tested else None


def predicted_speedup(alpha: float, k: int, target_one_s: float, target_verify_s: float, proposal_s: float) -> float:
    """Tokens/s of (d) over target-only decoding (c), if the loop cost nothing but these calls."""
    step_s = proposal_s + target_verify_s
    return expected_tokens_per_step(alpha, k) * target_one_s / step_s
