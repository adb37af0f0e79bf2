"""Log-probabilities in OpenAI's two shapes: the chat API's (a list of entries with bytes and
the likeliest tokens) and the completions API's (parallel lists). A token's text is its own
decoding, special tokens written out; its bytes are that text's UTF-8 (a token holding part of a
character decodes to U+FFFD, as in other servers that decode token by token)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specdecode.core.logprobs import TokenLogprob
from specdecode.server import schemas


def token_text(tokenizer) -> Callable[[int], str]:
    return lambda token: tokenizer.decode([token], skip_special_tokens=False)


def chat_logprobs(entries: Sequence[TokenLogprob], text: Callable[[int], str]) -> schemas.ChoiceLogprobs:
    def top(token: int, logprob: float) -> schemas.TopLogprob:
        word = text(token)
        return schemas.TopLogprob(token=word, logprob=logprob, bytes=list(word.encode()))

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
