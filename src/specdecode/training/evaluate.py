"""Held-out acceptance of a draft head: tokens per target forward on prompts it never trained on.

HELD_OUT are open-ended chat prompts written for this purpose (not from Spec-Bench or any
benchmark); training leaves them out of its data (data.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.drafters.head import DraftHead, HeadDrafter

HELD_OUT = [
    "Write a short note to a neighbour asking them to water my plants while I am away.",
    "What are three good habits for keeping a small vegetable garden healthy?",
    "Explain to a ten-year-old why the sky looks blue during the day.",
    "Give me a simple recipe for a warm lentil soup.",
    "Describe a quiet morning in a mountain village in a few sentences.",
    "What should I pack for a two-day hiking trip in autumn?",
    "Suggest a name and a one-line description for a friendly robot in a children's story.",
    "How can I explain to my team that a project deadline needs to move by a week?",
]


@dataclass(frozen=True)
class Acceptance:
    tokens_per_forward: float  # generated tokens / target forwards (the prefill's included), all prompts
    acceptance_rate: float  # accepted / drafted tokens
    prompts: int
    k: int
    tree: bool

    def line(self) -> str:
        shape = "trees" if self.tree else "chains"
        return (
            f"{self.tokens_per_forward:.2f} tokens per target forward, acceptance {self.acceptance_rate:.0%} "
            f"({self.prompts} held-out prompts, greedy, k={self.k}, {shape})"
        )


def held_out_acceptance(
    engine,
    head: DraftHead,
    prompts: list[str] | list[list[int]] | None = None,
    k: int = 4,
    max_new_tokens: int = 64,
    tree: bool = False,
    chat: bool = True,
) -> Acceptance:
    """Greedy decoding of each prompt with the head drafting k tokens (nodes) every step, fixed k."""
    view = engine.with_drafter(HeadDrafter(head, tree=tree), k, adaptive=False)
    results = view.generate(prompts or HELD_OUT, max_new_tokens=max_new_tokens, chat=chat)
    generated = sum(r.stats.generated_tokens for r in results)
    forwards = sum(r.stats.target_forwards for r in results)
    drafted = sum(r.stats.drafted_tokens for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    return Acceptance(generated / max(forwards, 1), accepted / max(drafted, 1), len(results), k, tree)
