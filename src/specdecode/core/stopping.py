"""When a generation ends: token budget, context window, end-of-sequence tokens, stop strings.

The earliest stop wins, as if the tokens came one at a time: a generation stops at the first
token whose text completes a stop string, or at the first EOS token, whichever comes first,
however many tokens a step accepted. The tokens kept are those up to and including that one
(usage counts them: they were generated); the text returned ends where the stop string
begins, as OpenAI's API returns it, so a stop string that begins inside a token keeps that
token's text before it. Tokens past the budget, or past an EOS, are dropped and their text
never counts. That one rule makes the answer a function of the target's tokens alone, the
same with speculation or without, and a stream that holds back what may begin a stop string
(server/worker.py) sends exactly the answer's text.

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
    keep: int  # how many generated tokens to keep: through the EOS, or the token completing a stop string
    reason: str  # "stop" (EOS or stop string) or "length", as OpenAI names them
    text_end: int | None = None  # where the text ends, for stop strings: where the stop string begins


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
        """The first of generated[first_new:end] whose text completes a stop string, if any;
        the text then ends where the earliest stop string begins."""
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

        def completes(n: int) -> bool:  # whether the text of generated[:n] holds a new stop string
            text = window if n == end else self.decode(generated[start:n])
            return any(text.find(s, search_from) >= 0 for s in self.stop_strings)

        if not completes(end):
            return None
        # the first token that completes one, by bisection (the text grows with n): O(log) decodes
        lo, hi = first_new, end
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if completes(mid) else (mid, hi)
        # cut exactly where a search of the whole text does, once per generation
        text = self.decode(generated[:hi])
        hits = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        if not hits:
            return None  # a decoder that disagrees with itself; the whole text decides
        return Stop(hi, "stop", min(hits))
