"""A stream's text as its tokens arrive, at a cost per step that does not grow with the answer.

Decoding every generated token again at every step costs the whole text per step: quadratic in
the answer's length. `IncrementalText` decodes a window instead: the tokens since its last cut,
after the tokens of the cut before as context, and keeps what the window adds past its
context (the prefix and read offsets of transformers' and vLLM's streamers). The context is
there because a tokenizer may write a token differently at the start of a decode
(SentencePiece drops a word's leading space). A window whose text ends in U+FFFD, a character
whose bytes have not all arrived, is held until they have.

`Holdback` then sends only what cannot still turn into a stop string: the answer's text ends
where a stop string begins (core/stopping.py), so an ending that may grow into one waits for
the next tokens. Together they send exactly the answer's text, a piece at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder writes for a character whose bytes are incomplete


class IncrementalText:
    """The text of a growing list of token ids, decoded a window at a time."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # the context starts here
        self._read = 0  # ... and ends here: the text up to it has been given out

    def extend(self, generated: Sequence[int]) -> str:
        """The text that the ids of generated past those seen before add ("" while it is held);
        generated: the whole list so far, of which the ids seen before are a prefix."""
        self.ids.extend(generated[len(self.ids) :])
        context = self.decode(self.ids[self._prefix : self._read])
        text = self.decode(self.ids[self._prefix :])
        if len(text) <= len(context) or text.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(context) :]


class Holdback:
    """Text to send, less any ending that may still grow into one of the stop strings."""

    def __init__(self, stop_strings: Sequence[str]):
        self.stop_strings = [s for s in stop_strings if s]
        self.held = ""  # decoded but not sent: a possible start of a stop string

    def release(self, new_text: str) -> str:
        """What of held + new_text can be sent now. Only the held text and the new text need a
        look: an ending that began in text already sent would have been held then."""
        text = self.held + new_text
        keep = max((n for s in self.stop_strings for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]
