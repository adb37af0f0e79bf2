"""Several drafters behind one name: each step, the first candidate that proposes drafts.

Candidates are given cheapest first (prompt lookup before a draft model). `AutoDrafter` is a
`Drafter` like the others, so the engine holds one drafter whatever was asked; the decoder
runs its candidates one by one (`candidates_of`) to choose each candidate's k from that
candidate's own measured acceptance and cost (core/adaptive.py), so a candidate that does
not pay proposes nothing and the next one, or target-only decoding, takes over; with adaptive
k it tries them best first, by the tokens per second each is measured to give (Decoder._ranked).
Its own `propose` (first candidate with a draft, all at the same k, in the given order) is for a
caller without those policies.
"""

from __future__ import annotations

import torch

from specdecode.core.sampling import SamplingParams
from specdecode.drafters.base import Draft, Drafter


class AutoDrafter(Drafter):
    name = "auto"

    def __init__(self, candidates: list[Drafter]):
        self.candidates = tuple(candidates)
        self.per_sequence = all(c.per_sequence for c in self.candidates)
        self.depends_on_history = any(getattr(c, "depends_on_history", False) for c in self.candidates)
        self.drafts_trees = any(getattr(c, "drafts_trees", False) for c in self.candidates)
        self._proposer: Drafter | None = None  # the candidate whose draft was proposed last

    def begin(self, prompt_ids: list[int]) -> None:
        for candidate in self.candidates:
            candidate.begin(prompt_ids)

    def propose(self, token_ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        self._proposer = None
        for candidate in self.candidates:
            draft = candidate.propose(token_ids, k, params, generator)
            if len(draft):
                self._proposer = candidate
                return draft
        return Draft.empty()

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if self._proposer is not None:
            self._proposer.observe(num_drafted, num_accepted)

    def learn(self, token_ids: list[int], draft: Draft, logits: torch.Tensor) -> None:
        for candidate in self.candidates:  # learn is optional for a drafter of one's own (as in the decoder)
            if (learn := getattr(candidate, "learn", None)) is not None:
                learn(token_ids, draft, logits)

    def finish(self, token_ids: list[int]) -> None:
        for candidate in self.candidates:
            candidate.finish(token_ids)

    def fork(self) -> AutoDrafter:
        return AutoDrafter([c.fork() for c in self.candidates])


def candidates_of(drafter: Drafter | None) -> tuple[Drafter, ...]:
    """The drafters a sequence tries each step, in order."""
    if drafter is None:
        return ()
    return drafter.candidates if isinstance(drafter, AutoDrafter) else (drafter,)
