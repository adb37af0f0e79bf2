"""N-gram prompt lookup (Saxena 2023): copy what followed the latest earlier occurrence of
the sequence's last n tokens. It has no distribution, so its q is one-hot."""

from __future__ import annotations

import torch

from specdecode.drafters.base import Draft
from specdecode.errors import InvalidArgumentError
from specdecode.sampling import SamplingParams


class PromptLookupDrafter:
    name = "prompt-lookup"

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3):
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidArgumentError(
                f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}"
            )
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def propose(
        self, token_ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        if k <= 0:
            return Draft.empty()
        sequence = torch.tensor(token_ids, dtype=torch.long)
        # longer n-grams first: a longer match predicts its continuation better
        for n in range(min(self.max_ngram, len(token_ids) - 1), self.min_ngram - 1, -1):
            start = _latest_earlier_match(sequence, n)
            if start is not None:
                continuation = sequence[start + n : start + n + k]
                return Draft(continuation.clone(), None)
        return Draft.empty()

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        pass


def _latest_earlier_match(sequence: torch.Tensor, n: int) -> int | None:
    """Start of the latest n-gram equal to the last n tokens, excluding that suffix itself."""
    windows = sequence[:-1].unfold(0, n, 1)  # [len - n, n]: windows that have a next token
    hits = (windows == sequence[-n:]).all(dim=1).nonzero()
    return int(hits[-1]) if hits.numel() else None
