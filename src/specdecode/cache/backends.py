"""Where cached bytes live: this process (the default), or a Redis server several processes share.

The interface is small: key-value pairs with a time to live (the response cache) and an
append-only log through which processes share records (the draft store's sequences; a
process never reads its own back, it has them already). One round trip per request at most:
the log is read when a request begins and written when it ends, never per token.

Redis failing (down at start, killed, slow) never fails a request: every call falls back to
the in-process backend, the error is counted (`errors`) and logged once, and Redis is tried
again after RETRY_S.

A read of the log is bounded whatever others wrote to it: at most READ_ENTRIES records and
READ_BYTES bytes, and a record larger than the reader allows is not even sent (a script
on the Redis server filters the stream; where scripts are refused, the client drops it). A
new reader starts from the newest records, not from the start of the stream. No message
shows a password (`mask_password`).
"""

from __future__ import annotations

import logging
import os
import re
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
READ_ENTRIES = 256  # most records one read of a log returns
READ_BYTES = 4 << 20  # most bytes of records one read returns (one record at least)

# a bounded read of a stream, on the server: KEYS[1] the log; ARGV: the last id read ("" for
# the newest entries), the most entries, the most bytes of one record's value, the most bytes
# in all. Returns [id, writer, value, oversized] per entry, oldest first; an oversized
# record's value is left out (and counted by the reader), so its bytes never cross the network.
READ_SCRIPT = """
local entries
if ARGV[1] == '' then
  entries = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', ARGV[2])
else
  entries = redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2])
end
local per_record, budget, out = tonumber(ARGV[3]), tonumber(ARGV[4]), {}
for _, entry in ipairs(entries) do
  local fields, writer, value = entry[2], '', ''
  for i = 1, #fields, 2 do
    if fields[i] == 'w' then writer = fields[i + 1] elseif fields[i] == 'v' then value = fields[i + 1] end
  end
  local oversized = #value > per_record
  if oversized then value = '' end
  if #out > 0 and #value > budget then break end
  budget = budget - #value
  out[#out + 1] = {entry[1], writer, value, oversized and '1' or '0'}
end
if ARGV[1] == '' then
  local reversed = {}
  for i = #out, 1, -1 do reversed[#reversed + 1] = out[i] end
  out = reversed
end
return out
"""


class Backend(Protocol):
    errors: int  # backend failures so far (served from the fallback)

    def get(self, key: str) -> bytes | None: ...

    def set(self, key: str, value: bytes, ttl_s: int | None) -> None: ...

    def append(self, log: str, value: bytes) -> None:
        """Share a record with the other processes (a hint: it may be lost)."""

    def read(
        self,
        log: str,
        max_entries: int = READ_ENTRIES,
        max_record_bytes: int | None = None,
        max_bytes: int = READ_BYTES,
    ) -> list[bytes | None]:
        """The records other processes appended since this one last read (the newest ones, on
        a first read), at most max_entries and max_bytes of them; None for each record over
        max_record_bytes, whose bytes were not read."""


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

    def read(
        self,
        log: str,
        max_entries: int = READ_ENTRIES,
        max_record_bytes: int | None = None,
        max_bytes: int = READ_BYTES,
    ) -> list[bytes | None]:
        return []  # no other process's records (the bounds: as Backend.read)

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
        self._secrets = [s for s in (password, urlparse(url).password) if s]  # never in a message
        self._down_until = 0.0
        self._cursors: dict[str, str] = {}  # a Redis stream's last id read, per log
        self._scripts = True  # False once the server refused READ_SCRIPT: the client filters
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

    def read(
        self,
        log: str,
        max_entries: int = READ_ENTRIES,
        max_record_bytes: int | None = None,
        max_bytes: int = READ_BYTES,
    ) -> list[bytes | None]:
        per_record = max_bytes if max_record_bytes is None else min(max_record_bytes, max_bytes)

        def records() -> list[bytes | None]:
            entries = self._read_entries(log, self._cursors.get(log, ""), max_entries, per_record, max_bytes)
            if entries:
                self._cursors[log] = entries[-1][0].decode()
            return [None if oversized else value for _, writer, value, oversized in entries if writer != self.writer]

        return self._call(records, [])

    def _read_entries(self, log: str, after: str, count: int, per_record: int, budget: int) -> list[tuple]:
        """[(id, writer, value, oversized)], oldest first: filtered on the server (READ_SCRIPT),
        or here where the server refuses scripts (then a large record's bytes are read, and dropped)."""
        import redis

        if self._scripts:
            try:
                found = self.client.eval(READ_SCRIPT, 1, log, after, count, per_record, budget)
                return [(entry_id, writer, value, oversized == b"1") for entry_id, writer, value, oversized in found]
            except redis.ResponseError as error:  # scripting disabled or not allowed (ACL): read plainly
                if str(error).startswith("WRONGTYPE"):
                    raise  # not a stream: a plain read fails as well
                logger.warning(
                    "Redis at %s refuses scripts (%s); the client bounds the draft log's records",
                    self.masked_url,
                    self._mask(error),
                )
                self._scripts = False
        if after:
            entries = self.client.xrange(log, min=f"({after}", max="+", count=count)
        else:  # the newest first, so that the budget keeps them
            entries = self.client.xrevrange(log, max="+", min="-", count=count)
        found = []
        for entry_id, fields in entries:
            value = fields.get(b"v", b"")
            oversized = len(value) > per_record
            if found and not oversized and len(value) > budget:
                break
            budget -= 0 if oversized else len(value)
            found.append((entry_id, fields.get(b"w", b""), b"" if oversized else value, oversized))
        return found if after else found[::-1]

    @property
    def masked_url(self) -> str:
        return mask_password(self.url)

    def _mask(self, error: object) -> str:
        """An error's text without this backend's passwords (the URL's and REDIS_PASSWORD)."""
        text = str(error)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return mask_password(text)

    def _call(self, call, default, fallback=None):
        if self.available:
            try:
                result = call()
                if self._down_until:
                    logger.warning("Redis at %s answers again; the shared cache is back", self.masked_url)
                    self._down_until = 0.0
                return result
            except Exception as error:  # noqa: BLE001 - any Redis failure: serve without it
                self.errors += 1
                if not self._down_until:
                    logger.warning(
                        "Redis at %s failed (%s); serving from this process's cache", self.masked_url, self._mask(error)
                    )
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
            f"--cache-url must look like redis://HOST:PORT/DB (or rediss://), got '{mask_password(url)}'", "cache_url"
        )
    try:
        parsed.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise InvalidArgumentError(f"--cache-url has a bad port: '{mask_password(url)}'", "cache_url") from None
    try:
        return RedisBackend(url, max_bytes)
    except ValueError as error:  # redis-py's own checks of the URL's arguments
        raise InvalidArgumentError(f"--cache-url '{mask_password(url)}': {error}", "cache_url") from None


_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)?(?P<userinfo>[^\s]*)@(?P<rest>[^@\s]*)$")
_PASSWORD_ARGUMENT = re.compile(r"(?i)(password=)[^&#\s]*")


def mask_password(url: str) -> str:
    """url, for messages: a password in it replaced by *** (user:***@host; a user name alone is
    masked too, as some give the password there), also in a URL that does not parse, with
    several @, and in a password=... query argument (which redis-py accepts)."""
    match = _USERINFO.match(url)
    if match is not None:
        userinfo = match["userinfo"]
        user = userinfo.split(":", 1)[0] + ":" if ":" in userinfo else ""
        url = f"{match['scheme'] or ''}{user}***@{match['rest']}"
    return _PASSWORD_ARGUMENT.sub(r"\1***", url)
