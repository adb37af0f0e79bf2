"""Where cached bytes live: this process (the default), or a Redis server several processes share.

The interface is small: key-value pairs with a time to live (the response cache) and an
append-only log through which processes share records (the draft store's sequences; a
process never reads its own back, it has them already). One round trip per request at most:
the log is read when a request begins and written when it ends, never per token.

Redis failing (down at start, killed, slow) never fails a request: every call falls back to
the in-process backend, the error is counted (`errors`) and logged once, and Redis is tried
again after RETRY_S.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import OrderedDict
from typing import Protocol
from urllib.parse import urlparse

from specdecode.errors import InvalidArgumentError

logger = logging.getLogger("specdecode.cache")

RETRY_S = 5.0  # after a Redis error, how long the in-process backend serves alone
TIMEOUT_S = 0.5  # a Redis call slower than this counts as a failure
LOG_ENTRIES = 20_000  # records kept in a shared log (Redis trims older ones)


class Backend(Protocol):
    errors: int  # backend failures so far (served from the fallback)

    def get(self, key: str) -> bytes | None: ...

    def set(self, key: str, value: bytes, ttl_s: int | None) -> None: ...

    def append(self, log: str, value: bytes) -> None:
        """Share a record with the other processes (a hint: it may be lost)."""

    def read(self, log: str) -> list[bytes]:
        """The records other processes appended since this one last read."""


class InProcessBackend:
    """Bounded by bytes: the least recently used keys go first; a log keeps its last records."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self.errors = 0
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._expiry: dict[str, float] = {}
        self._bytes = 0

    def get(self, key: str) -> bytes | None:
        if key in self._expiry and self._expiry[key] < time.monotonic():
            self._drop(key)
        value = self._values.get(key)
        if value is not None:
            self._values.move_to_end(key)
        return value

    def set(self, key: str, value: bytes, ttl_s: int | None) -> None:
        self._drop(key)
        self._values[key] = value
        self._bytes += len(value)
        if ttl_s is not None:
            self._expiry[key] = time.monotonic() + ttl_s
        while self._bytes > self.max_bytes and self._values:
            self._drop(next(iter(self._values)))

    def append(self, log: str, value: bytes) -> None:
        pass  # no other process to share with

    def read(self, log: str) -> list[bytes]:
        return []

    def _drop(self, key: str) -> None:
        value = self._values.pop(key, None)
        self._expiry.pop(key, None)
        if value is not None:
            self._bytes -= len(value)


class RedisBackend:
    """Redis, with the in-process backend standing in whenever Redis fails."""

    def __init__(self, url: str, max_bytes: int = 256 << 20):
        import redis

        self.url = url
        self.errors = 0
        self.fallback = InProcessBackend(max_bytes)
        password = os.environ.get("REDIS_PASSWORD")
        options = dict(socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
        self.client = redis.Redis.from_url(url, **({"password": password} if password else {}) | options)
        self._down_until = 0.0
        self._cursors: dict[str, str] = {}  # a Redis stream's last id read, per log
        self.writer = uuid.uuid4().bytes  # this process's records, skipped when it reads

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def ping(self) -> bool:
        return self._call(lambda: bool(self.client.ping()), False)

    def get(self, key: str) -> bytes | None:
        return self._call(lambda: self.client.get(key), None, lambda: self.fallback.get(key))

    def set(self, key: str, value: bytes, ttl_s: int | None) -> None:
        self.fallback.set(key, value, ttl_s)  # also here: served while Redis is away
        self._call(lambda: self.client.set(key, value, ex=ttl_s), None)

    def append(self, log: str, value: bytes) -> None:
        record = {b"w": self.writer, b"v": value}
        self._call(lambda: self.client.xadd(log, record, maxlen=LOG_ENTRIES, approximate=True), None)

    def read(self, log: str) -> list[bytes]:
        def records() -> list[bytes]:
            entries = self.client.xrange(log, min=f"({self._cursors.get(log, '0-0')}", max="+", count=LOG_ENTRIES)
            if entries:
                self._cursors[log] = entries[-1][0].decode()
            return [fields.get(b"v", b"") for _, fields in entries if fields.get(b"w") != self.writer]

        return self._call(records, [])

    def _call(self, call, default, fallback=None):
        if self.available:
            try:
                result = call()
                if self._down_until:
                    logger.warning("Redis at %s answers again; the shared cache is back", _safe(self.url))
                    self._down_until = 0.0
                return result
            except Exception as error:  # noqa: BLE001 - any Redis failure: serve without it
                self.errors += 1
                if not self._down_until:
                    logger.warning("Redis at %s failed (%s); serving from this process's cache", _safe(self.url), error)
                self._down_until = time.monotonic() + RETRY_S
        return fallback() if fallback is not None else default


def open_backend(url: str | None, max_bytes: int = 256 << 20) -> InProcessBackend | RedisBackend:
    """The backend for --cache-url (None: in process). A malformed URL is an error here; an
    unreachable server is not (the caller decides: `generate` refuses, `serve` falls back)."""
    if url is None:
        return InProcessBackend(max_bytes)
    parsed = urlparse(url)
    if parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
        raise InvalidArgumentError(
            f"--cache-url must look like redis://HOST:PORT/DB (or rediss://), got '{url}'", "cache_url"
        )
    try:
        parsed.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise InvalidArgumentError(f"--cache-url has a bad port: '{url}'", "cache_url") from None
    return RedisBackend(url, max_bytes)


def _safe(url: str) -> str:
    """The URL without its password, for logs."""
    parsed = urlparse(url)
    return url if parsed.password is None else url.replace(f":{parsed.password}@", ":***@")
