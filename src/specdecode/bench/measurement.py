"""One timed generation: which system, which prompt, what it produced and how long it took."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Measurement:
    system: str
    group: str  # a to f, see systems.py
    prompt_id: str
    category: str
    run: int
    order: int  # place of this system among those run on this prompt in this run (the order is shuffled)
    prompt_tokens: int
    token_ids: list[int]
    wall_time_s: float
    stats: (
        dict | None
    )  # GenerationStats.to_dict() for this engine's systems, LlamaCppCounts' for llama.cpp's, None for transformers
    # filled in after timing, by quality.py
    first_difference: int | None = None  # greedy: first position differing from its reference; None when identical
    perplexity: float | None = None  # sampling: the target's perplexity of the generated tokens

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def time_per_token_s(self) -> float:
        """Wall time over new tokens, prefill included, as every system pays it."""
        return self.wall_time_s / max(self.new_tokens, 1)

    def to_dict(self) -> dict:
        return {**vars(self), "new_tokens": self.new_tokens, "tokens_per_second": self.tokens_per_second}
