"""A cross-request draft store: the token sequences of earlier requests, indexed so that the
longest match of the current context's suffix proposes what followed it most often.

For every n-gram of MIN_NGRAM..MAX_NGRAM tokens the store counts the tokens that followed it.
A proposal walks greedily: the longest n-gram ending the context that the store has seen
gives its most frequent next token, if that token followed it more than MIN_SHARE of the
time; the token is appended and the walk goes on. So the draft is long where the history
agrees with itself (a repeated answer, a re-sent transcript) and short or empty where it
does not, as SuffixDecoding adapts its draft length to the match (Oliaro et al. 2024).
Drafts are verified like any other, so a stale or corrupt entry can only cost speed.

Shared through a backend (backends.py): a finished sequence is indexed here at once and
appended to the backend's log; the other processes' sequences are read from the log when a
request begins. Records are int32 arrays; a record that is not one, or holds ids outside
the vocabulary, is skipped.
"""

from __future__ import annotations

from array import array
from collections import deque

from specdecode.cache.backends import Backend

MIN_NGRAM, MAX_NGRAM = 2, 6
MIN_SHARE = 0.5  # the share of an n-gram's continuations its proposed token must exceed
MAX_TOKENS = 400_000  # tokens indexed; past it the oldest half of the sequences is forgotten


class DraftStore:
    def __init__(self, backend: Backend, namespace: str, vocab_size: int, max_tokens: int = MAX_TOKENS):
        self.backend, self.log, self.vocab_size, self.max_tokens = (
            backend,
            f"{namespace}:drafts",
            vocab_size,
            max_tokens,
        )
        self.sequences: deque[list[int]] = deque()
        self.tokens = 0
        self._next: dict[tuple[int, ...], dict[int, int]] = {}  # n-gram -> next token -> count
        self.skipped = 0  # records from the backend that were not valid sequences

    def __len__(self) -> int:
        return self.tokens

    def add(self, token_ids: list[int]) -> None:
        """Index a finished sequence (prompt and output) and share it."""
        self._index(token_ids)
        self.backend.append(self.log, array("i", token_ids).tobytes())

    def sync(self) -> None:
        """Index what other processes added since the last sync: one backend call."""
        for record in self.backend.read(self.log):
            token_ids = self._unpack(record)
            if token_ids is None:
                self.skipped += 1
            else:
                self._index(token_ids)

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens to follow context, as the store's history continues it."""
        walk, drafted = list(context[-MAX_NGRAM:]), []
        while len(drafted) < k:
            token = self._continuation(walk)
            if token is None:
                break
            drafted.append(token)
            walk = walk[1 - MAX_NGRAM :] + [token] if len(walk) >= MAX_NGRAM else walk + [token]
        return drafted

    def _continuation(self, walk: list[int]) -> int | None:
        for n in range(min(MAX_NGRAM, len(walk)), MIN_NGRAM - 1, -1):  # the longest match first
            followers = self._next.get(tuple(walk[-n:]))
            if followers:
                token, count = max(followers.items(), key=lambda item: item[1])
                return token if count > MIN_SHARE * sum(followers.values()) else None
        return None

    def _index(self, token_ids: list[int]) -> None:
        self.sequences.append(token_ids)
        self.tokens += len(token_ids)
        self._count(token_ids, +1)
        while self.tokens > self.max_tokens and len(self.sequences) > 1:
            old = self.sequences.popleft()
            self.tokens -= len(old)
            self._count(old, -1)

    def _count(self, token_ids: list[int], delta: int) -> None:
        for end in range(MIN_NGRAM, len(token_ids)):
            following = token_ids[end]
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                key = tuple(token_ids[end - n : end])
                followers = self._next.setdefault(key, {})
                count = followers.get(following, 0) + delta
                if count > 0:
                    followers[following] = count
                else:
                    followers.pop(following, None)
                    if not followers:
                        del self._next[key]

    def _unpack(self, record: bytes) -> list[int] | None:
        if not record or len(record) % 4:
            return None
        token_ids = array("i", record).tolist()
        return token_ids if all(0 <= t < self.vocab_size for t in token_ids) else None
