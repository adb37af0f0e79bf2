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
request begins. Records are int32 arrays (behind an HMAC of the operator's secret, when one
is set); a record that is not one, holds ids outside the vocabulary, fails its HMAC, or is
longer than a sequence can be (max_record_tokens) is skipped and counted (`skipped`).

What others wrote costs the engine a bounded amount of time, whatever they wrote: one read
returns a bounded batch (backends.READ_ENTRIES records, READ_BYTES bytes, none over
max_record_tokens), and the records read wait in `pending` until a step indexes them, at
most INDEX_BUDGET_TOKENS tokens a step (one record at least), before it proposes.
"""

from __future__ import annotations

import hashlib
import hmac
from array import array
from collections import deque

from specdecode.cache.backends import READ_ENTRIES, Backend

MIN_NGRAM, MAX_NGRAM = 2, 6
MIN_SHARE = 0.5  # the share of an n-gram's continuations its proposed token must exceed
MAX_TOKENS = 400_000  # tokens indexed; past it the oldest half of the sequences is forgotten
MAX_RECORD_TOKENS = 1 << 20  # the longest record, where the caller gives no bound (its context)
INDEX_BUDGET_TOKENS = 4096  # most tokens of others' records indexed before one proposal
MAC_BYTES = 16


class DraftStore:
    READ_ENTRIES = READ_ENTRIES
    INDEX_BUDGET_TOKENS = INDEX_BUDGET_TOKENS

    def __init__(
        self,
        backend: Backend,
        namespace: str,
        vocab_size: int,
        max_tokens: int = MAX_TOKENS,
        max_record_tokens: int | None = None,
        secret: str | bytes | None = None,
    ):
        """max_record_tokens: the most tokens a record may hold (the engine's max_model_len: no
        sequence is longer); secret: the operator's key, with which records are signed and checked."""
        self.backend, self.log, self.vocab_size, self.max_tokens = (
            backend,
            f"{namespace}:drafts",
            vocab_size,
            max_tokens,
        )
        self.max_record_tokens = max_record_tokens or MAX_RECORD_TOKENS
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self.sequences: deque[list[int]] = deque()
        self.tokens = 0
        self._next: dict[tuple[int, ...], dict[int, int]] = {}  # n-gram -> next token -> count
        self.pending: deque[bytes] = deque()  # records read from the backend, not indexed yet
        self._pending_tokens = 0
        self.skipped = 0  # records from the backend that were not valid sequences (or too long)

    def __len__(self) -> int:
        return self.tokens

    @property
    def pending_records(self) -> int:
        return len(self.pending)

    def add(self, token_ids: list[int]) -> None:
        """Index a finished sequence (prompt and output) and share it."""
        self._index(token_ids)
        self.backend.append(self.log, self._pack(token_ids))

    def sync(self, budget: int | None = None) -> None:
        """Read what other processes added since the last sync (one bounded backend call) and
        index up to budget tokens of it (None: all; the rest waits for the next proposals)."""
        overhead = MAC_BYTES if self._secret else 0
        for record in self.backend.read(self.log, max_record_bytes=4 * self.max_record_tokens + overhead):
            if record is None or len(record) > 4 * self.max_record_tokens + overhead:
                self.skipped += 1  # longer than any sequence: not read (or not kept)
                continue
            self.pending.append(record)
            self._pending_tokens += len(record) // 4
        while self._pending_tokens > self.max_tokens and len(self.pending) > 1:
            self._pending_tokens -= len(self.pending.popleft()) // 4  # would be forgotten at once anyway
        self.index_pending(budget)

    def index_pending(self, budget: int | None = INDEX_BUDGET_TOKENS) -> None:
        """Index records read but not indexed yet: up to budget tokens (one record at least), or all."""
        while self.pending and (budget is None or budget > 0):
            record = self.pending.popleft()
            self._pending_tokens -= len(record) // 4
            if budget is not None:
                budget -= len(record) // 4 or 1
            token_ids = self._unpack(record)
            if token_ids is None:
                self.skipped += 1
            else:
                self._index(token_ids)

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens to follow context, as the store's history continues it."""
        self.index_pending()
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

    def _pack(self, token_ids: list[int]) -> bytes:
        payload = array("i", token_ids).tobytes()
        return self._mac(payload) + payload if self._secret else payload

    def _unpack(self, record: bytes) -> list[int] | None:
        if self._secret:
            mac, record = record[:MAC_BYTES], record[MAC_BYTES:]
            if len(mac) < MAC_BYTES or not hmac.compare_digest(mac, self._mac(record)):
                return None
        if not record or len(record) % 4 or len(record) > 4 * self.max_record_tokens:
            return None
        token_ids = array("i", record).tolist()
        return token_ids if all(0 <= t < self.vocab_size for t in token_ids) else None

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._secret, self.log.encode() + b"\0" + payload, hashlib.sha256).digest()[:MAC_BYTES]
