"""A runner's cache kept in step with a sequence that grows and rolls back.

Drafters ask for logits after a token list that differs from the last one only at its end
(their own rejected drafts); `CachedSequence` crops the cache to the common prefix and runs
only the new suffix, so accepted tokens are never recomputed.
"""

from __future__ import annotations

import torch

from specdecode.runners.base import ModelRunner


class CachedSequence:
    """A runner whose cache always holds a prefix of the sequence last asked about."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.runner.reset()
        self._tokens: list[int] = []

    def logits(self, token_ids: list[int], num_logits: int = 1) -> torch.Tensor:
        """Logits [num_logits, vocab] after each of the last num_logits positions of token_ids."""
        # never more than the runner holds: after a forward that failed, _tokens ran ahead of it
        keep = min(common_prefix_length(self._tokens, token_ids), len(token_ids) - num_logits, self.runner.cache_length)
        self.runner.crop(keep)  # roll back rejected tokens; never recompute the accepted ones
        keep = self.runner.cache_length  # less where the crop could not be done (hf.py): run the rest
        logits = self.runner.forward(torch.tensor(token_ids[keep:], dtype=torch.long), num_logits)
        self._tokens = list(token_ids)
        return logits


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    return next(i for i in range(n) if a[i] != b[i])
