"""Drafts from the cross-request draft store (cache/draft_store.py): what followed the longest
match of the context's suffix in earlier requests, in this process or (through Redis) in
others. Deterministic from the tokens and the store, so its q is one-hot.

It runs on the engine's thread, so what others wrote to the store costs each request and step
a bounded time: a request begins with one bounded read of their records, and each proposal
first indexes at most the store's INDEX_BUDGET_TOKENS of what was read."""

from __future__ import annotations

import torch

from specdecode.cache.draft_store import INDEX_BUDGET_TOKENS, DraftStore
from specdecode.core.sampling import SamplingParams
from specdecode.drafters.base import Draft, Drafter


class SuffixDrafter(Drafter):
    name = "suffix"
    per_sequence = True  # forks share the store
    depends_on_history = True
    drafts_trees = False  # its store walks one continuation

    def __init__(self, store: DraftStore, learn: bool = True):
        """learn=False: draft from the store without adding to it (a benchmark's fixed history)."""
        self.store, self.adds_to_store = store, learn

    def fork(self) -> SuffixDrafter:
        return self  # no per-sequence state

    def begin(self, prompt_ids: list[int]) -> None:
        self.store.sync(INDEX_BUDGET_TOKENS)  # what other processes added: one bounded backend call per request

    def propose(self, token_ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        drafted = self.store.propose(token_ids, k)
        return Draft(torch.tensor(drafted, dtype=torch.long), None) if drafted else Draft.empty()

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        pass

    def learn(self, token_ids: list[int], draft: Draft, logits: torch.Tensor) -> None:
        pass

    def finish(self, token_ids: list[int]) -> None:
        if self.adds_to_store:
            self.store.add(list(token_ids))
