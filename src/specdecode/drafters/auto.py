"""Several drafters behind one: each step, the first candidate that proposes anything drafts.

Candidates come cheapest first (prompt lookup before a draft model). Wrapped in
`adaptive.AdaptiveDrafter`, each measures its own acceptance and cost and proposes nothing
while it does not pay, so the next candidate, or target-only decoding, takes over.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specdecode.drafters.base import Draft, Drafter
from specdecode.sampling import SamplingParams


class AutoDrafter:
    name = "auto"

    def __init__(self, candidates: list[Drafter]):
        self.candidates = candidates
        self._last: Drafter | None = None  # the candidate whose draft is being verified
        policies = {getattr(c, "k_policy", "fixed") for c in candidates}
        self.k_policy = policies.pop() if len(policies) == 1 else "mixed"

    def begin(self, prompt_ids: list[int]) -> None:
        for candidate in self.candidates:
            candidate.begin(prompt_ids)

    def propose(
        self, token_ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        self._last = None
        for candidate in self.candidates:
            draft = candidate.propose(token_ids, k, params, generator)
            if len(draft):
                self._last = candidate
                return replace(draft, source=candidate.name)
        return Draft.empty()

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if self._last is not None:
            self._last.observe(num_drafted, num_accepted)
