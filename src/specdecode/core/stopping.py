"""When a generation ends: token budget, context window, end-of-sequence tokens, stop strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Stop:
    keep: int  # how many generated tokens to keep
    reason: str  # "stop" (EOS or stop string) or "length", as OpenAI names them
    text_end: int | None = None  # where the text ends, for stop strings (the stop string is not returned)


@dataclass(frozen=True)
class StoppingCriteria:
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: Sequence[str] = ()
    decode: Callable[[list[int]], str] | None = None  # needed for stop strings

    def check(self, generated: list[int], num_new: int, context_full: bool) -> Stop | None:
        """Whether to stop after the last num_new of the generated tokens were appended."""
        first_new = len(generated) - num_new
        for i in range(first_new, len(generated)):
            if generated[i] in self.eos_token_ids:
                return Stop(i + 1, "stop")  # keep the EOS, drop what was accepted past it
        if self.stop_strings:
            stop = self._find_stop_string(generated)
            if stop is not None:
                return stop
        if len(generated) >= self.max_new_tokens:
            return Stop(self.max_new_tokens, "length")
        if context_full:
            return Stop(len(generated), "length")
        return None

    def _find_stop_string(self, generated: list[int]) -> Stop | None:
        assert self.decode is not None, "stop strings need a tokenizer"
        text = self.decode(generated)
        hits = [(text.find(s), s) for s in self.stop_strings if s in text]
        if not hits:
            return None
        text_end = min(hits)[0]
        # keep the tokens whose text lies wholly before the stop string
        keep = next(n for n in range(len(generated), -1, -1) if len(self.decode(generated[:n])) <= text_end)
        return Stop(keep, "stop", text_end)
