"""N-gram prompt lookup (Saxena 2023): copy what followed the latest earlier occurrence of
the sequence's last n tokens, in the prompt and the text so far, and optionally in earlier
requests' text. It drafts deterministically from the tokens alone, so its q is one-hot.

As a tree (for a target that verifies trees), it merges several continuations into a trie:
the chain above first, then what followed other occurrences, earlier ones and shorter n-grams
after, while the budget of k nodes lasts."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch

from specdecode.core.sampling import SamplingParams
from specdecode.drafters.base import Draft, Drafter
from specdecode.drafters.tree import TreeBuilder
from specdecode.errors import InvalidArgumentError

SEPARATOR = -1  # between requests in the history; equals no token, so no match spans two requests
MAX_CONTINUATIONS = 64  # a tree's most continuations tried: a common token may occur thousands of times


class TokenHistory:
    """Earlier requests' tokens, each followed by SEPARATOR, the last `limit` kept; one
    object shared by a drafter and its forks, so every sequence of a batch (every request
    of the server) adds to and searches the same history."""

    def __init__(self, limit: int):
        self.limit = limit
        self.tokens = torch.zeros(0, dtype=torch.long)  # [<= limit]

    def add(self, token_ids: list[int]) -> None:
        self.tokens = torch.cat([self.tokens, torch.tensor(token_ids + [SEPARATOR])])[-self.limit :]


class PromptLookupDrafter(Drafter):
    name = "prompt-lookup"
    per_sequence = True

    def __init__(
        self,
        min_ngram: int = 1,
        max_ngram: int = 3,
        max_continuation: int | None = None,
        use_history: bool = False,
        history_tokens: int = 100_000,
        tree: bool = False,
    ):
        """max_continuation caps a draft below k (a tree: each continuation); use_history also
        searches earlier requests, keeping their last history_tokens tokens; tree: propose a
        trie of several continuations, k nodes at most, whose first path is the chain drafted
        without it (for a target that verifies trees)."""
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidArgumentError(
                f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}"
            )
        if max_continuation is not None and max_continuation < 1:
            raise InvalidArgumentError(f"max_continuation must be at least 1, got {max_continuation}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_continuation = max_continuation
        self.use_history = use_history
        self.depends_on_history = use_history
        self.history_tokens = history_tokens
        self.drafts_trees = tree
        self._history = TokenHistory(history_tokens)  # shared with forks
        self._last: list[int] = []  # the latest sequence seen, not yet in the history

    def cache_identity(self) -> list:
        tree = ["tree"] if self.drafts_trees else []  # a tree proposes other tokens than a chain
        return [self.min_ngram, self.max_ngram, self.max_continuation, *tree]

    def fork(self) -> PromptLookupDrafter:
        """A drafter for another sequence generated alongside (batching): same settings, and
        the same history, to which every sequence adds its text when it finishes."""
        return copy.copy(self)

    def begin(self, prompt_ids: list[int]) -> None:
        self._remember(self._last)

    def finish(self, token_ids: list[int]) -> None:
        self._remember(token_ids)

    def _remember(self, token_ids: list[int]) -> None:
        if self.use_history and token_ids:
            self._history.add(token_ids)
        self._last = []

    def propose(self, token_ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        self._last = token_ids
        if k <= 0:
            return Draft.empty()
        if self.drafts_trees:
            builder = TreeBuilder(k)
            self.add_to(builder, token_ids)
            return builder.draft()
        chain = next(self.continuations(token_ids, k), None)
        return Draft(chain, None) if chain is not None else Draft.empty()

    def continuations(self, token_ids: list[int], k: int) -> Iterator[torch.Tensor]:
        """What followed earlier occurrences of the sequence's last n tokens ([<= k] each, at
        most max_continuation): longer n-grams first (a longer match predicts its continuation
        better), and for each n the latest occurrence first, in the sequence, then in the
        history. The first is the chain this drafter proposes."""
        k = min(k, self.max_continuation or k)
        sequence = torch.tensor(token_ids, dtype=torch.long)
        for n in range(min(self.max_ngram, len(token_ids) - 1), self.min_ngram - 1, -1):
            yield from _continuations(sequence, sequence[-n:], k)  # the suffix itself has no next token
            if self.use_history:
                yield from _continuations(self._history.tokens, sequence[-n:], k)

    def add_to(self, builder: TreeBuilder, token_ids: list[int]) -> None:
        """The continuations as paths from the root of builder, merged as a trie, the first
        first, until its budget is spent (or MAX_CONTINUATIONS were tried)."""
        for tried, continuation in enumerate(self.continuations(token_ids, builder.budget)):
            builder.add_path(continuation.tolist())
            if builder.full or tried + 1 >= MAX_CONTINUATIONS:
                return

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        pass

    def learn(self, token_ids: list[int], draft: Draft, logits: torch.Tensor) -> None:
        pass


def _continuations(haystack: torch.Tensor, ngram: torch.Tensor, k: int) -> Iterator[torch.Tensor]:
    """Up to k tokens after each occurrence of ngram [n] in haystack [m] that has any, latest first."""
    n = ngram.shape[0]
    if haystack.shape[0] <= n:
        return
    windows = haystack[:-1].unfold(0, n, 1)  # [m - n, n]: windows that have a next token
    hits = (windows == ngram).all(dim=1).nonzero()
    for start in reversed(hits[:, 0].tolist()):
        following = haystack[start + n : start + n + k]
        stop = (following == SEPARATOR).nonzero()
        following = following[: int(stop[0])] if stop.numel() else following
        if following.numel():
            yield following.clone()
