"""What a client can hold of the server: bounded before it authenticates, and after.

- The API key is checked from the headers alone, before any body is read (`KeyCheck`): a
  client without the key is answered 401 at once and its body is never buffered.
- A body is read counted, up to max_body_bytes, whatever its framing (`BodyLimit`).
- HTTP runs on h11 with limits of the server's config (`BoundedH11Protocol`): at most
  max_connections open at once (one more is answered 503 and closed), request headers of at
  most max_header_bytes (more: 400 and closed), and a request that has not arrived whole
  within read_timeout_s of its first byte (or of the connection's opening) is closed. Idle
  keep-alive connections close after uvicorn's own timeout.

So a client that has not authenticated holds at most one connection's header bytes, for at
most read_timeout_s, in at most max_connections connections (docs/serving.md: "Limits").
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable

import h11
import uvicorn
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from specdecode.server.config import ServerConfig
from specdecode.server.errors import RETRY_AFTER_S

KEEP_ALIVE_S = 5  # an idle connection between requests (uvicorn's default)


class KeyCheck:
    """Refuses a request without the API key before the app reads a byte of its body. Open
    without the key: the paths in `open_paths` (/health; /metrics when asked). Pure ASGI,
    outermost, so no other middleware buffers the body first."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str], refuse: Callable[[], JSONResponse]):
        self.app, self.key, self.open_paths, self.refuse = app, api_key.encode(), open_paths, refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        await self.refuse()(scope, receive, send)

    def _authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        # compare_digest: the time taken must not tell how much of the key was right
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


class BodyLimit:
    """Refuses bodies over max_bytes before the app reads them. The limit holds on the bytes
    actually received, whatever the framing: a Content-Length over the limit is refused at
    once, and every body is read here, counted, up to the limit, then handed on. A declared
    length alone is not to be trusted: a request that sends both Content-Length and chunked
    encoding is read by its chunks under h11, past the length it declared. Pure ASGI:
    FastAPI's @app.middleware wrapper would hide client disconnects from the handlers."""

    def __init__(self, app, max_bytes: int, refuse: Callable[[str], JSONResponse]):
        self.app, self.max_bytes, self.refuse = app, max_bytes, refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self.refuse(f"{int(length)} bytes")(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before it finished sending
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self.refuse(f"more than {self.max_bytes} bytes")(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()  # from here on: the disconnect, when it comes
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a cap on open connections and a deadline on reading a
    request (uvicorn has neither: its limit_concurrency answers 503 but keeps every connection,
    and a request that never finishes arriving is waited for without end)."""

    max_connections = 256
    read_timeout_s = 30.0
    _read_deadline: asyncio.TimerHandle | None = None
    _BUSY = (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"retry-after: %d\r\ncontent-length: %d\r\n\r\n%s"
    )

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            body = (
                b'{"error": {"message": "the server has too many open connections; retry later", '
                b'"type": "server_error", "param": null, "code": "too_many_connections"}}'
            )
            transport.write(self._BUSY % (RETRY_AFTER_S[503], len(body), body))
            transport.close()
            return
        self._start_reading()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._stop_reading()  # the request is in whole: its answer may take as long as it takes
        elif self._read_deadline is None:
            self._start_reading()  # the first bytes of the next request on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_reading()
        super().connection_lost(exc)

    def _start_reading(self) -> None:
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _stop_reading(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.conn.their_state not in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
            self.transport.close()  # a handler still waiting for the body sees a disconnect


def bounded_protocol(config: ServerConfig) -> type[BoundedH11Protocol]:
    """The protocol class with this config's limits (uvicorn instantiates it per connection)."""
    return type(
        "BoundedH11Protocol",
        (BoundedH11Protocol,),
        {"max_connections": config.max_connections, "read_timeout_s": config.read_timeout_s},
    )


def uvicorn_config(app, config: ServerConfig, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """How `specdecode serve` runs app: its config's limits on connections, headers and reads."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=bounded_protocol(config),
        h11_max_incomplete_event_size=config.max_header_bytes,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
