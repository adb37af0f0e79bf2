"""When a generation ends: token budget, context window, end-of-sequence tokens, stop strings.

The earliest stop wins. An accepted block can hold an EOS token and a stop string; a stop
string counts only if its text ends before the EOS token (the text of the tokens before
it), and then the generation stops at the stop string, not at EOS. Tokens past the
budget, or past an EOS, are dropped and their text never counts.

Stop strings are found incrementally. The check runs after every step, so a new match
must end in the new tokens' text: only that text and the `longest - 1` characters before
it are searched, decoded from a window of tokens whose size depends on the stop strings,
not on the length of the generation. Only when a stop string is found is the whole text
decoded, once, to cut exactly where a search of the whole text would (see `Stop`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Stop:
    keep: int  # how many generated tokens to keep: for a stop string, those whose text lies wholly before it
    reason: str  # "stop" (EOS or stop string) or "length", as OpenAI names them
    text_end: int | None = None  # where the text ends, for stop strings (the stop string is not returned)


@dataclass(frozen=True)
class StoppingCriteria:
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: Sequence[str] = ()
    decode: Callable[[list[int]], str] | None = None  # needed for stop strings

    def check(self, generated: list[int], num_new: int, context_full: bool) -> Stop | None:
        """Whether to stop after the last num_new of the generated tokens were appended (the
        tokens before them were checked by earlier calls)."""
        first_new = len(generated) - num_new
        end = min(len(generated), self.max_new_tokens)  # tokens past the budget are dropped
        eos = next((i for i in range(first_new, end) if generated[i] in self.eos_token_ids), None)
        if self.stop_strings:
            # the earliest stop wins: a stop string ending before the EOS token comes first
            stop = self._find_stop_string(generated, first_new, end if eos is None else eos)
            if stop is not None:
                return stop
        if eos is not None:
            return Stop(eos + 1, "stop")  # keep the EOS, drop what was accepted past it
        if len(generated) >= self.max_new_tokens:
            return Stop(self.max_new_tokens, "length")
        if context_full:
            return Stop(len(generated), "length")
        return None

    def _find_stop_string(self, generated: list[int], first_new: int, end: int) -> Stop | None:
        """The first stop string in the text of generated[:end], if one ends in the text of
        generated[first_new:end]."""
        assert self.decode is not None, "stop strings need a tokenizer"
        if end <= first_new:
            return None  # no new text
        longest = max(len(s) for s in self.stop_strings)
        # a window of tokens before the new ones that holds at least `longest` characters:
        # guessed at two characters a token, doubled while short (tokens may decode to nothing)
        back = longest // 2 + 1
        while True:
            start = max(0, first_new - back)
            before = self.decode(generated[start:first_new]) if start < first_new else ""
            if start == 0 or len(before) >= longest:
                break
            back *= 2
        window = self.decode(generated[start:end])
        # the new text starts where the window leaves `before` (a decoder may rewrite the last
        # characters, e.g. complete an unfinished UTF-8 sequence); a new match ends after that
        common = len(before) if window.startswith(before) else len(os.path.commonprefix([before, window]))
        search_from = max(0, common - longest + 1)  # >= 1 when start > 0: the window's first character is never used
        if not any(window.find(s, search_from) >= 0 for s in self.stop_strings):
            return None
        # found: cut exactly where a search of the whole text does, once per generation
        text = window if start == 0 else self.decode(generated[:end])
        hits = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        if not hits:
            return None  # a decoder that disagrees with itself; the whole text decides
        text_end = min(hits)
        return Stop(self._tokens_before(generated, start, end, text_end), "stop", text_end)

    def _tokens_before(self, generated: list[int], start: int, end: int, text_end: int) -> int:
        """The most tokens n whose text decode(generated[:n]) ends at or before text_end, by
        bisection (the text grows with n): O(log) decodes, not one per token."""
        lo, hi = 0, end  # decode(generated[:0]) = "" fits; decode(generated[:end]) holds the stop string
        if start > 0 and len(self.decode(generated[:start])) <= text_end:
            lo = start  # the stop string lies in the window, as it does unless a decoder disagrees
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if len(self.decode(generated[:mid])) <= text_end:
                lo = mid
            else:
                hi = mid
        return lo
