"""The session store's Redis client: one connection per router process, commands pipelined automatically.

Why not redis-py's asyncio client (kept for nothing on the hot path): measured on this project's 2-core machine, one
GET cost its caller 60-110 µs of CPU (a pool checkout under an asyncio lock, a readiness probe of the socket,
observability hooks awaited per command, a reply parser that awaits per line), and the router issues four commands a
turn: with two workers that was most of what they cost over one process (benchmarks/results/router/README.md). Here a
command is encoded into the connection's buffer, every command issued in the same event-loop iteration leaves in one
write, and replies are parsed synchronously as they arrive, in order, each completing its command's future.

Latency matters more than syscalls here: the router's turn waits for its lookup before P's request leaves, and on a
busy loop every extra loop iteration between a reply and its caller costs (measured: one process with sessions in
Redis through a pooled client lost a quarter of its throughput to the wait, not to CPU). So a command is written at
once (a pipeline's commands in one write), a reply completes its future directly from data_received, and callers
await that future itself (no asyncio.wait_for and its extra hop): one timer per connection bounds the oldest
unanswered command.

RESP2 only (what Redis speaks unless asked otherwise), the reply types of the commands the store uses. A reply that
does not come within `timeout` ends the connection (replies are ordered: a late one cannot be told from the next
command's) and fails every command waiting on it; the next command connects again.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from typing import Any
from urllib.parse import unquote, urlsplit


class RespError(Exception):
    """An error reply of the server (`-ERR ...`, `-NOAUTH ...`)."""


class RespConnectionError(Exception):
    """The connection failed, closed or timed out."""


class _Incomplete(Exception):
    pass


_CRLF = b"\r\n"


def encode(args: tuple[Any, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int):
            data = b"%d" % arg
        else:
            data = str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def parse(buf: bytes | bytearray, pos: int) -> tuple[Any, int]:
    """One reply at buf[pos:] → (value, position after it); raises _Incomplete when it has not all arrived. Error
    replies are returned as RespError values (a pipeline's other replies stay in order)."""
    eol = buf.find(_CRLF, pos)
    if eol < 0:
        raise _Incomplete
    kind = buf[pos]
    if kind == 36:  # $ bulk string
        n = int(buf[pos + 1 : eol])
        if n < 0:
            return None, eol + 2
        end = eol + 2 + n
        if len(buf) < end + 2:
            raise _Incomplete
        return bytes(buf[eol + 2 : end]), end + 2
    if kind == 58:  # : integer
        return int(buf[pos + 1 : eol]), eol + 2
    if kind == 43:  # + simple string
        return bytes(buf[pos + 1 : eol]), eol + 2
    if kind == 45:  # - error
        return RespError(bytes(buf[pos + 1 : eol]).decode(errors="replace")), eol + 2
    if kind == 42:  # * array
        n = int(buf[pos + 1 : eol])
        if n < 0:
            return None, eol + 2
        items = []
        at = eol + 2
        for _ in range(n):
            item, at = parse(buf, at)
            items.append(item)
        return items, at
    raise RespConnectionError(f"unexpected reply type {chr(kind)!r}")


class _Protocol(asyncio.Protocol):
    def __init__(self, owner: RespClient, timeout: float) -> None:
        self.owner = owner
        self.timeout = timeout
        self.transport: Any = None  # asyncio's or uvloop's transport
        self.pending: deque[tuple[asyncio.Future[Any], float]] = deque()  # (future, deadline)
        self.buf = bytearray()
        self.lost: Exception | None = None
        self.loop = asyncio.get_running_loop()
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos = 0
        try:
            while pos < len(buf):
                value, pos = parse(buf, pos)
                if not self.pending:
                    raise RespConnectionError("a reply no command asked for")
                fut, _ = self.pending.popleft()
                if not fut.done():  # a caller that went away still had its reply read: the order stays right
                    fut.set_result(value)
        except _Incomplete:
            pass
        except (RespConnectionError, ValueError) as exc:
            self.fail(RespConnectionError(str(exc)))
            return
        del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RespConnectionError(f"connection lost: {exc or 'closed by the server'}"))

    def send(self, data: bytes, futs: list[asyncio.Future[Any]]) -> None:
        """Write one or more encoded commands at once; futs get their replies in order."""
        if self.lost is not None:
            for fut in futs:
                fut.set_exception(self.lost)
            return
        deadline = self.loop.time() + self.timeout
        for fut in futs:
            self.pending.append((fut, deadline))
        self.transport.write(data)
        if self.timer is None:
            self.timer = self.loop.call_at(deadline, self.check_deadline)

    def check_deadline(self) -> None:
        self.timer = None
        if not self.pending or self.lost is not None:
            return
        deadline = self.pending[0][1]
        if self.loop.time() >= deadline:
            self.fail(RespConnectionError(f"no reply within {self.timeout:g} s"))
        else:
            self.timer = self.loop.call_at(deadline, self.check_deadline)

    def fail(self, exc: Exception) -> None:
        if self.lost is None:
            self.lost = exc
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        while self.pending:
            fut, _ = self.pending.popleft()
            if not fut.done():
                fut.set_exception(self.lost)
                fut.exception()  # retrieved here: a caller that went away must not log "never retrieved"
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()
        self.owner._lost(self)


class RespClient:
    """redis:// or rediss:// URL (host, port, /db, user:password@ — a password given apart wins)."""

    def __init__(
        self,
        url: str,
        timeout: float,
        password: str | None = None,
        ssl_ca_certs: str | None = None,
        ssl_check_hostname: bool = True,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"{url}: a redis:// or rediss:// URL")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 6379
        self.db = int(parts.path.lstrip("/") or 0)
        self.username = unquote(parts.username) if parts.username else None
        self.password = password if password is not None else (unquote(parts.password) if parts.password else None)
        self.timeout = timeout
        self.ssl: ssl.SSLContext | None = None
        if parts.scheme == "rediss":
            self.ssl = ssl.create_default_context(cafile=ssl_ca_certs)
            self.ssl.check_hostname = ssl_check_hostname
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self._scripts: dict[str, bytes] = {}
        self.commands = 0  # sent, for the benchmark's per-turn count

    def _lost(self, proto: _Protocol) -> None:
        if self._proto is proto:
            self._proto = None

    async def _connection(self) -> _Protocol:
        proto = self._proto
        if proto is not None and proto.lost is None:
            return proto
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Protocol(self, self.timeout),
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                ),
                self.timeout,
            )
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
            raise RespConnectionError(f"connect to {self.host}:{self.port}: {type(exc).__name__} {exc}") from None
        hello: list[tuple[Any, ...]] = []
        if self.password is not None:
            hello.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
        if self.db:
            hello.append(("SELECT", self.db))
        if hello:
            futs = [loop.create_future() for _ in hello]
            proto.send(b"".join(encode(args) for args in hello), futs)
            try:
                for fut in futs:
                    answer = await fut
                    if isinstance(answer, RespError):
                        raise answer
            except BaseException:
                proto.fail(RespConnectionError("set-up failed"))
                raise
        self._proto = proto
        return proto

    async def execute(self, *args: Any) -> Any:
        """One command; its reply (an error reply raises RespError)."""
        proto = self._proto
        if proto is None or proto.lost is not None:
            proto = await self._connection()
        fut = proto.loop.create_future()
        self.commands += 1
        proto.send(encode(args), [fut])
        answer = await fut
        if isinstance(answer, RespError):
            raise answer
        return answer

    async def pipeline(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Several commands in one write; their replies in order (error replies as RespError values)."""
        proto = self._proto
        if proto is None or proto.lost is not None:
            proto = await self._connection()
        futs = [proto.loop.create_future() for _ in commands]
        self.commands += len(commands)
        proto.send(b"".join(encode(args) for args in commands), futs)
        return [await fut for fut in futs]

    async def script(self, source: str, keys: list[Any], args: list[Any]) -> Any:
        """EVALSHA, loading the script once if the server does not know it (a restarted Redis forgets them)."""
        sha = self._scripts.get(source)
        if sha is None:
            sha = self._scripts[source] = hashlib.sha1(source.encode()).hexdigest().encode()
        try:
            return await self.execute("EVALSHA", sha, len(keys), *keys, *args)
        except RespError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            return await self.execute("EVAL", source, len(keys), *keys, *args)

    async def close(self) -> None:
        proto, self._proto = self._proto, None
        if proto is not None:
            if proto.timer is not None:
                proto.timer.cancel()
            if proto.transport is not None:
                proto.transport.close()
