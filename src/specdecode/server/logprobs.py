"""Log-probabilities in OpenAI's two shapes: the chat API's (a list of entries with bytes and
the likeliest tokens) and the completions API's (parallel lists), each token said by TokenTexts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property

from specdecode.core.logprobs import TokenLogprob
from specdecode.errors import SpecDecodeError
from specdecode.server import schemas


class TokenTexts:
    """What the log-probabilities say of a token: its text, its own decoding with special tokens
    written out (a token that holds part of a character decodes to U+FFFD, as in other servers
    that decode token by token), and its bytes, that part of the character, as llguidance reads
    the tokenizer (structured outputs read it the same way); where llguidance cannot, the
    text's UTF-8."""

    def __init__(self, engine):
        self._engine = engine

    def text(self, token: int) -> str:
        return self._engine.tokenizer.decode([token], skip_special_tokens=False)

    def bytes(self, token: int) -> bytes:
        reader = self._reader
        if reader is None or reader.is_special_token(token):
            return self.text(token).encode()
        return reader.decode_bytes([token])

    @cached_property
    def _reader(self):
        try:
            return self._engine.grammars.tokenizer  # built once per engine
        except SpecDecodeError:  # no llguidance, a tokenizer it cannot read, or no EOS token
            return None


def chat_logprobs(entries: Sequence[TokenLogprob], texts: TokenTexts) -> schemas.ChoiceLogprobs:
    def top(token: int, logprob: float) -> schemas.TopLogprob:
        return schemas.TopLogprob(token=texts.text(token), logprob=logprob, bytes=list(texts.bytes(token)))

    content = [
        schemas.TokenLogprob(**top(e.token, e.logprob).model_dump(), top_logprobs=[top(t, lp) for t, lp in e.top])
        for e in entries
    ]
    return schemas.ChoiceLogprobs(content=content)


def completion_logprobs(
    entries: Sequence[TokenLogprob], text: Callable[[int], str], offset: int = 0
) -> schemas.CompletionLogprobs:
    """offset: where the first token's text starts in the answer (a stream's earlier chunks)."""
    tokens = [text(e.token) for e in entries]
    offsets = []
    for word in tokens:
        offsets.append(offset)
        offset += len(word)
    asked_top = any(e.top for e in entries)
    return schemas.CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[{text(t): lp for t, lp in e.top} for e in entries] if asked_top else None,
        text_offset=offsets,
    )
