"""Several drafters behind one name: each step, the first candidate that proposes drafts.

Candidates come cheapest first (prompt lookup before a draft model). The decoder chooses
each candidate's k from that candidate's own measured acceptance and cost (core/adaptive.py),
so a candidate that does not pay proposes nothing and the next one, or target-only
decoding, takes over. `AutoDrafter` only names the candidates; the decoder runs them.
"""

from __future__ import annotations

from specdecode.drafters.base import Drafter


class AutoDrafter:
    name = "auto"

    def __init__(self, candidates: list[Drafter]):
        self.candidates = tuple(candidates)
        self.per_sequence = all(c.per_sequence for c in self.candidates)
        self.drafts_trees = any(getattr(c, "drafts_trees", False) for c in self.candidates)

    def fork(self) -> AutoDrafter:
        return AutoDrafter([c.fork() for c in self.candidates])


def candidates_of(drafter: Drafter | AutoDrafter | None) -> tuple[Drafter, ...]:
    """The drafters a sequence tries each step, in order."""
    if drafter is None:
        return ()
    return drafter.candidates if isinstance(drafter, AutoDrafter) else (drafter,)
