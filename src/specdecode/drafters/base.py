"""The drafter interface: propose up to k tokens, then learn from what the target accepted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdecode.core.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [k] int64, k may be smaller than asked for, or 0
    probs: torch.Tensor | None  # [k, vocab] the q each token was drawn from; None = one-hot
    source: str | None = None  # which drafter of a composite (auto) proposed it

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty() -> Draft:
        return Draft(torch.zeros(0, dtype=torch.long), None)


class Drafter(Protocol):
    """One-hot drafters (probs None) must draft deterministically from token_ids alone:
    then q is the point mass on their token and the accept/reject rule stays exact.

    k is chosen by the decoder (decoder.py), never by a drafter. Capabilities are declared:
    `per_sequence` drafters give each sequence of a batch a state of its own with `fork()`;
    the others hold one shared state (a draft model's cache), so the decoder runs them on
    batches of one sequence.
    """

    name: str
    per_sequence: bool
    # declared: drafts depend on earlier requests (a history, a shared store), not on the
    # sequence alone; seeded sampling skips such drafters, so that its samples repeat
    depends_on_history: bool

    def begin(self, prompt_ids: list[int]) -> None:
        """A new sequence starts with these prompt tokens."""

    def propose(
        self,
        token_ids: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        """Up to k tokens to follow token_ids, drawn with the same params as the target."""

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """How many of the last proposal's tokens the target accepted."""

    def finish(self, token_ids: list[int]) -> None:
        """The sequence ended (or left) with these tokens, prompt included."""

    def fork(self) -> Drafter:
        """A drafter with the same settings for one more sequence (only if per_sequence)."""
