"""The router's HTTP/1.1 client for its upstreams (P's one-token prefill, D's whole answer or stream, health checks)
on asyncio Protocols with httptools' response parser (installed with uvicorn[standard]).

Why not aiohttp: through it a streamed token costs a parser callback, a StreamReader feed, a task wake-up and an
async-iterator step before the router may write it. Here D's body bytes reach a callback inside data_received, and
the relay writes them to the client's transport from there: no task runs per token. Connections are kept alive
per upstream origin. Every failure is an `UpstreamFailure` subclass; its class name is the `kind` label of
bpdkv_router_upstream_errors_total and the reason in a 502's text.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

# Idle connections older than this are not reused: uvicorn (vLLM's server) closes them after 5 s by default.
IDLE_REUSE_S = 4.0
MAX_IDLE_PER_ORIGIN = 512


class UpstreamFailure(Exception):
    """An upstream exchange failed: the turn logic counts it against the upstream and tries the next one."""


class ConnectFailed(UpstreamFailure):
    pass


class UpstreamTimeout(UpstreamFailure):
    pass


class ConnectionLost(UpstreamFailure):
    """The upstream closed or reset the connection before its response ended."""


class BadResponse(UpstreamFailure):
    """Bytes that are not an HTTP/1.1 response."""


@dataclass(frozen=True)
class Answer:
    """A whole upstream response."""

    status: int
    content_type: str
    content: bytes


@dataclass(frozen=True)
class Origin:
    host: str
    port: int
    tls: bool
    host_header: bytes


BodySink = Callable[[bytes], None]
EndSink = Callable[["UpstreamFailure | None"], None]


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection, one exchange at a time. Timeouts: until the first body byte, a deadline (first
    byte); after it, the longest silence between two reads (idle). One timer per exchange, re-armed lazily."""

    def __init__(self, origin: Origin, loop: asyncio.AbstractEventLoop) -> None:
        self.origin = origin
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.active = False  # an exchange is under way (from send until the pool takes the connection back)
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.content_type = ""
        self.keep_alive = False
        self.until_close = True  # no content-length, not chunked: the body ends with the connection
        self.parts: list[bytes] = []
        self.sink: BodySink | None = None
        self.on_end: EndSink | None = None
        self.got_headers = False
        self.got_body = False
        self.complete = False
        self.received = 0
        self.error: UpstreamFailure | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.until = "end"  # what the waiter waits for: headers, body (its first bytes) or end
        self.first_byte_s = 0.0
        self.first_deadline = 0.0
        self.idle_s = 0.0
        self.last_read = 0.0
        self.paused = False
        self.timer: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol ----------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport is no asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        self.last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(BadResponse(f"unparseable response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.active:
            return  # idle in the pool: it is skipped there
        if self.got_headers and self.until_close and not self.complete and exc is None:
            self.on_message_complete()
            return
        self._fail(ConnectionLost("connection reset" if exc else "connection closed before the response ended"))

    # ---- httptools callbacks ---------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-type":
            self.content_type = value.decode("latin-1")
        elif lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
            self.until_close = False

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.got_headers = True
        if self.until == "headers":
            self._wake()

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            self.sink(body)
            return
        self.parts.append(body)
        if not self.got_body:
            self.got_body = True
            if self.until == "body":
                self._wake()

    def on_message_complete(self) -> None:
        if self.complete or self.error is not None:
            return
        self.complete = True
        self._stop_timer()
        self._wake()
        if self.on_end is not None:
            self.on_end(None)

    # ---- the exchange ----------------------------------------------------------------------------------------
    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamFailure) -> None:
        if self.complete or self.error is not None:
            return
        self.error = error
        self._stop_timer()
        self.abort()
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        if self.on_end is not None:
            self.on_end(error)

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _limit(self) -> float:
        return self.first_deadline if not self.got_body and self.first_deadline else self.last_read + self.idle_s

    def _check_time(self) -> None:
        self.timer = None
        if self.complete or self.error is not None:
            return
        now = self.loop.time()
        if self.paused:  # the client is slow, not the upstream: silence while paused does not count
            self.last_read = now
        limit = self._limit()
        if now >= limit:
            first = not self.got_body and self.first_deadline
            self._fail(UpstreamTimeout(f"no first byte within {self.first_byte_s}s" if first else f"no bytes for {self.idle_s}s"))
            return
        self.timer = self.loop.call_at(limit, self._check_time)

    def send(self, request: bytes, first_byte_s: float, idle_s: float) -> None:
        self._reset()
        self.active = True
        now = self.loop.time()
        self.last_read = now
        self.first_byte_s = first_byte_s
        self.first_deadline = now + first_byte_s if first_byte_s else 0.0
        self.idle_s = idle_s
        self.timer = self.loop.call_at(self._limit(), self._check_time)
        assert self.transport is not None
        self.transport.write(request)

    async def wait(self, until: str) -> None:
        """Until the headers, the first body bytes or the end of the response arrived (the end wakes every wait)."""
        if self.error is not None:
            raise self.error
        if self.complete or (until == "headers" and self.got_headers) or (until == "body" and self.got_body):
            return
        self.until = until
        self.waiter = self.loop.create_future()
        await self.waiter

    async def whole(self) -> Answer:
        await self.wait("end")
        return Answer(self.status, self.content_type or "application/json", b"".join(self.parts))

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.lost and self.transport is not None and not self.transport.is_closing()

    def abort(self) -> None:
        self._stop_timer()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()
        self.lost = True

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.last_read = self.loop.time()
            if not self.transport.is_closing():
                self.transport.resume_reading()


class UpstreamStream:
    """D's streamed answer after its first body bytes. `attach` hands later bytes (and those that came meanwhile)
    to a callback; `on_end` runs once, with None at the normal end or the failure. `close` exactly once."""

    def __init__(self, client: UpstreamClient, conn: UpstreamConnection) -> None:
        self.client = client
        self.conn = conn
        self.content_type = conn.content_type or "text/event-stream"
        self.first = b"".join(conn.parts)
        conn.parts = []
        self._closed = False

    def attach(self, sink: BodySink, on_end: EndSink) -> None:
        conn = self.conn
        if conn.parts:
            pending, conn.parts = b"".join(conn.parts), []
            sink(pending)
        conn.sink = sink
        if conn.complete or conn.error is not None:
            on_end(conn.error)
        else:
            conn.on_end = on_end

    def pause(self) -> None:
        self.conn.pause()

    def resume(self) -> None:
        self.conn.resume()

    def close(self, reusable: bool) -> None:
        """Release the connection to the pool (D's answer ended and the client got it all), or drop it — which
        cancels D's request when it is still running."""
        if self._closed:
            return
        self._closed = True
        conn = self.conn
        conn.sink = None
        conn.on_end = None
        if reusable and conn.reusable():
            self.client.release(conn)
        else:
            conn.abort()


class UpstreamClient:
    def __init__(self, connect_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self._idle: dict[Origin, list[UpstreamConnection]] = {}
        self._origins: dict[str, tuple[Origin, bytes]] = {}
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    def _split(self, url: str) -> tuple[Origin, bytes]:
        known = self._origins.get(url)
        if known is not None:
            return known
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConnectFailed(f"not an http(s) URL: {url}")
        port = parts.port or (443 if tls else 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        origin = Origin(parts.hostname, port, tls, (parts.netloc.rsplit("@", 1)[-1]).encode("idna"))
        if len(self._origins) < 4096:  # upstream URLs × routes: a handful in practice
            self._origins[url] = (origin, target.encode())
        return origin, target.encode()

    async def _connect(self, origin: Origin) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        if origin.tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: UpstreamConnection(origin, loop),
                    origin.host,
                    origin.port,
                    ssl=self._tls if origin.tls else None,
                ),
                self.connect_timeout,
            )
        except asyncio.TimeoutError:
            raise ConnectFailed(f"connect to {origin.host}:{origin.port}: no answer within {self.connect_timeout}s") from None
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(f"connect to {origin.host}:{origin.port}: {exc.strerror or exc}") from None
        return conn

    def _idle_connection(self, origin: Origin) -> UpstreamConnection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        horizon = asyncio.get_running_loop().time() - IDLE_REUSE_S
        while idle:
            conn = idle.pop()
            if not conn.lost and conn.idle_since > horizon and conn.transport is not None and not conn.transport.is_closing():
                return conn
            conn.abort()
        return None

    def release(self, conn: UpstreamConnection) -> None:
        idle = self._idle.setdefault(conn.origin, [])
        if self._closed or len(idle) >= MAX_IDLE_PER_ORIGIN:
            conn.abort()
            return
        conn.sink = None
        conn.on_end = None
        conn.active = False
        conn.idle_since = conn.loop.time()
        idle.append(conn)

    async def _start(
        self, method: bytes, url: str, body: bytes | None, headers: dict[str, str], first_byte_s: float, idle_s: float, until: str
    ) -> UpstreamConnection:
        """Send the request and wait for its headers (or first body bytes). A reused connection that the upstream
        closed before answering anything is replaced once by a fresh one (a keep-alive race, not a failure)."""
        origin, target = self._split(url)
        lines = [method, b" ", target, b" HTTP/1.1\r\nhost: ", origin.host_header, b"\r\n"]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:  # a value could otherwise start a header (or request) of its own
                raise ValueError(f"upstream request header {name}: line break in its value")
            lines += [name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n"]
        if body is not None:
            lines += [b"content-length: ", str(len(body)).encode(), b"\r\n\r\n", body]
        else:
            lines.append(b"\r\n")
        request = b"".join(lines)
        for _attempt in range(2):
            conn = self._idle_connection(origin)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(origin)
            try:
                conn.send(request, first_byte_s, idle_s)
                await conn.wait(until)
            except ConnectionLost:
                if reused and conn.received == 0:
                    continue
                raise
            except BaseException:  # cancelled (client gone) or failed: the connection is never reused
                conn.abort()
                raise
            return conn
        raise ConnectionLost("connection closed before the response started")

    async def fetch(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str], timeout: float, idle_s: float | None = None
    ) -> Answer:
        """A whole response; `timeout` bounds its first byte, `idle_s` (default: the same) every silence after it."""
        conn = await self._start(method.encode(), url, body, headers, timeout, timeout if idle_s is None else idle_s, "headers")
        return await self._rest(conn)

    async def _rest(self, conn: UpstreamConnection) -> Answer:
        """The rest of a whole response; then the connection goes back to the pool or is dropped."""
        try:
            answer = await conn.whole()
        except BaseException:
            conn.abort()
            raise
        if conn.reusable():
            self.release(conn)
        else:
            conn.abort()
        return answer

    async def open_stream(
        self, url: str, body: bytes, headers: dict[str, str], first_byte_s: float, idle_s: float
    ) -> UpstreamStream | Answer:
        """D's streamed answer once its first body bytes arrived; a non-200 answer comes back whole."""
        conn = await self._start(b"POST", url, body, headers, first_byte_s, idle_s, until="body")
        if conn.status != 200:
            return await self._rest(conn)
        return UpstreamStream(self, conn)

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
        self._idle.clear()
