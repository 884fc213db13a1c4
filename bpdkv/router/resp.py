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

Failover (docs/router.md, "The session store"). `redis+sentinel://` / `rediss+sentinel://` URLs name Sentinels and a
master: every connect asks them for the current master (SENTINEL get-master-addr-by-name, the first Sentinel that
answers moves to the front), checks with ROLE that it is one, and a subscription to a Sentinel's +switch-master drops
the connection the moment the master moves. Whatever the URL: a READONLY (or MASTERDOWN/LOADING) error reply — a
master demoted under us, a managed Redis whose failover endpoint has not moved yet — ends the connection after its
replies are delivered, so the next command connects again, which re-resolves a DNS name (asyncio resolves at each
connect). A connect that fails makes the commands of the next `min(timeout, 0.25)` s fail at once instead of each
waiting for its own attempt: the store degrades to "no reuse" for the seconds a failover lasts, never slower turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import ssl
from collections import deque
from typing import Any
from urllib.parse import unquote, urlsplit

try:
    import hiredis
except ImportError:  # a dependency of bpdkv; without it, the parser below (same replies, more CPU)
    hiredis = None  # type: ignore[assignment]


class RespError(Exception):
    """An error reply of the server (`-ERR ...`, `-NOAUTH ...`)."""


class RespConnectionError(Exception):
    """The connection failed, closed or timed out."""


class _Incomplete(Exception):
    pass


_CRLF = b"\r\n"
# Error replies meaning "this server is not (or not yet) the master to write to": the connection ends after them.
FAILOVER_ERRORS = ("READONLY", "MASTERDOWN", "LOADING")
SENTINEL_PORT = 26379


def _host_port(item: str, default_port: int) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # [v6 address]:port
        host, _, rest = item[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else default_port
    host, sep, port = item.rpartition(":")
    if not sep:
        return item, default_port
    return host, int(port)


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int, str | None, str | None]:
    """`redis+sentinel://[user[:password]@]host[:port][,host[:port]...]/master[/db]` → (sentinels, master, db,
    username, password); the port defaults to 26379. ValueError saying what is wrong (not quoting the URL: it may hold
    a password)."""
    rest = url.split("://", 1)[1]
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        userinfo, hosts = "", netloc
    username, _, password = userinfo.partition(":")
    try:
        sentinels = [_host_port(h, SENTINEL_PORT) for h in hosts.split(",") if h.strip()]
    except ValueError:
        raise ValueError("a Sentinel port is not a number") from None
    if not sentinels or any(not h for h, _ in sentinels):
        raise ValueError("no Sentinel address (redis+sentinel://host:26379[,host:26379...]/master[/db])")
    segments = [unquote(x) for x in path.split("/") if x]
    if not segments or len(segments) > 2:
        raise ValueError("the path is /master-name[/db] (redis+sentinel://host:26379[,host:26379...]/master[/db])")
    try:
        db = int(segments[1]) if len(segments) == 2 else 0
    except ValueError:
        raise ValueError("the db after the master name is not a number") from None
    return sentinels, segments[0], db, unquote(username) or None, unquote(password) if password else None


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
        moved: RespError | None = None
        try:
            while pos < len(buf):
                value, pos = parse(buf, pos)
                if not self.pending:
                    raise RespConnectionError("a reply no command asked for")
                fut, _ = self.pending.popleft()
                if not fut.done():  # a caller that went away still had its reply read: the order stays right
                    fut.set_result(value)
                if type(value) is RespError and str(value).startswith(FAILOVER_ERRORS):
                    moved = value
        except _Incomplete:
            pass
        except (RespConnectionError, ValueError) as exc:
            self.fail(RespConnectionError(str(exc)))
            return
        del buf[:pos]
        if moved is not None:  # not the master (any more): the next command connects again (and discovers it)
            self.fail(RespConnectionError(f"{self.owner.address}: {str(moved)[:80]}"))

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


class _HiredisProtocol(_Protocol):
    """Replies parsed by hiredis (the C parser redis-py uses): ~10x less CPU per reply than parse() here
    (docs/router.md, "The session store": the figures); the same replies, error replies as RespError values."""

    def __init__(self, owner: RespClient, timeout: float) -> None:
        super().__init__(owner, timeout)
        self.reader = hiredis.Reader(replyError=RespError)

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        reader.feed(data)
        moved: RespError | None = None
        try:
            while (value := reader.gets()) is not False:
                if not self.pending:
                    raise RespConnectionError("a reply no command asked for")
                fut, _ = self.pending.popleft()
                if not fut.done():  # a caller that went away still had its reply read: the order stays right
                    fut.set_result(value)
                if type(value) is RespError and str(value).startswith(FAILOVER_ERRORS):
                    moved = value
        except (RespConnectionError, hiredis.ProtocolError) as exc:
            self.fail(RespConnectionError(str(exc)))
            return
        if moved is not None:  # not the master (any more): the next command connects again (and discovers it)
            self.fail(RespConnectionError(f"{self.owner.address}: {str(moved)[:80]}"))


# BPDKV_RESP_PARSER=python: the parser above instead of hiredis (benchmarks/redis_capacity.py's A/B of the two).
PROTOCOL: type[_Protocol] = (
    _HiredisProtocol if hiredis is not None and os.environ.get("BPDKV_RESP_PARSER", "hiredis") != "python" else _Protocol
)


class RespClient:
    """redis:// or rediss:// URL (host, port, /db, user:password@ — a password given apart wins), or
    redis+sentinel:// / rediss+sentinel:// (parse_sentinel_url): the master the Sentinels name. The password and TLS
    apply to the master; a Sentinel gets the password only if it asks for one (NOAUTH), and TLS with rediss+sentinel."""

    def __init__(
        self,
        url: str,
        timeout: float,
        password: str | None = None,
        ssl_ca_certs: str | None = None,
        ssl_check_hostname: bool = True,
    ) -> None:
        scheme = url.split("://", 1)[0] if "://" in url else ""
        if scheme not in ("redis", "rediss", "redis+sentinel", "rediss+sentinel"):
            raise ValueError(f"{url}: a redis://, rediss://, redis+sentinel:// or rediss+sentinel:// URL")
        self.sentinels: list[tuple[str, int]] = []
        self.master_name = ""
        url_password: str | None
        if scheme.endswith("+sentinel"):
            self.sentinels, self.master_name, self.db, self.username, url_password = parse_sentinel_url(url)
            self.host, self.port = "", 0  # discovered at each connect
        else:
            parts = urlsplit(url)
            self.host = parts.hostname or "127.0.0.1"
            self.port = parts.port or 6379
            self.db = int(parts.path.lstrip("/") or 0)
            self.username = unquote(parts.username) if parts.username else None
            url_password = unquote(parts.password) if parts.password else None
        self.password = password if password is not None else url_password
        self.timeout = timeout
        self.retry_after = min(timeout, 0.25)
        self._retry_at = 0.0
        self._last_error: RespConnectionError | None = None
        self._watch: asyncio.Task[None] | None = None
        self.switches = 0  # +switch-master messages seen for our master (tests read it)
        self.ssl: ssl.SSLContext | None = None
        if scheme.startswith("rediss"):
            self.ssl = ssl.create_default_context(cafile=ssl_ca_certs)
            self.ssl.check_hostname = ssl_check_hostname
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self._scripts: dict[str, bytes] = {}
        self.commands = 0  # sent, for the benchmark's per-turn count

    def _lost(self, proto: _Protocol) -> None:
        if self._proto is proto:
            self._proto = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}" if not self.sentinels else f"{self.master_name} at {self.host}:{self.port}"

    async def _connection(self) -> _Protocol:
        proto = self._proto
        if proto is not None and proto.lost is None:
            return proto
        if self._connecting is None:
            if self._last_error is not None and asyncio.get_running_loop().time() < self._retry_at:
                raise self._last_error  # a connect failed a moment ago: this command fails now, not after its own try
            self._connecting = asyncio.ensure_future(self._connect_or_note())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _connect_or_note(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            proto = await self._connect()
        except RespConnectionError as exc:
            self._last_error, self._retry_at = exc, loop.time() + self.retry_after
            raise
        self._last_error = None
        return proto

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        if self.sentinels:
            self.host, self.port = await self._discover()
            if self._watch is None or self._watch.done():
                self._watch = asyncio.ensure_future(self._watch_switches())
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(
                    lambda: PROTOCOL(self, self.timeout),
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                ),
                self.timeout,
            )
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
            raise RespConnectionError(f"connect to {self.address}: {type(exc).__name__} {exc}") from None
        hello: list[tuple[Any, ...]] = []
        if self.password is not None:
            hello.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
        if self.db:
            hello.append(("SELECT", self.db))
        if self.sentinels:
            hello.append(("ROLE",))  # a Sentinel that has not noticed the failover yet may name a demoted master
        if hello:
            futs = [loop.create_future() for _ in hello]
            proto.send(b"".join(encode(args) for args in hello), futs)
            try:
                for fut in futs:
                    answer = await fut
                    if isinstance(answer, RespError):
                        raise answer
                if self.sentinels and not (isinstance(answer, list) and answer and answer[0] == b"master"):
                    role = answer[0].decode(errors="replace") if isinstance(answer, list) and answer else "?"
                    raise RespConnectionError(f"{self.address}: not the master (role {role}); the Sentinels have not moved it yet")
            except RespError as exc:
                proto.fail(RespConnectionError("set-up failed"))
                if str(exc).startswith(FAILOVER_ERRORS):
                    raise RespConnectionError(f"{self.address}: {exc}") from None
                raise
            except BaseException:
                proto.fail(RespConnectionError("set-up failed"))
                raise
        self._proto = proto
        return proto

    async def _ask(self, host: str, port: int, commands: list[tuple[Any, ...]]) -> list[Any]:
        """One short exchange with a Sentinel: the replies of `commands` (error replies as values), then closed."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=self.ssl, server_hostname=host if self.ssl else None), self.timeout
        )
        try:
            writer.write(b"".join(encode(args) for args in commands))
            buf = bytearray()
            replies: list[Any] = []
            pos = 0
            while len(replies) < len(commands):
                chunk = await asyncio.wait_for(reader.read(65536), self.timeout)
                if not chunk:
                    raise RespConnectionError("closed by the Sentinel")
                buf += chunk
                try:
                    while len(replies) < len(commands):
                        value, pos = parse(buf, pos)
                        replies.append(value)
                except _Incomplete:
                    pass
            return replies
        finally:
            writer.close()

    async def _ask_sentinel(self, host: str, port: int, command: tuple[Any, ...]) -> Any:
        (answer,) = await self._ask(host, port, [command])
        if isinstance(answer, RespError) and str(answer).startswith("NOAUTH") and self.password is not None:
            _, answer = await self._ask(host, port, [("AUTH", self.password), command])
        if isinstance(answer, RespError):
            raise answer
        return answer

    async def _discover(self) -> tuple[str, int]:
        """The master's address from the first Sentinel that knows it (that one is asked first next time)."""
        problems = []
        for i, (host, port) in enumerate(list(self.sentinels)):
            try:
                answer = await self._ask_sentinel(host, port, ("SENTINEL", "get-master-addr-by-name", self.master_name))
            except (OSError, asyncio.TimeoutError, ssl.SSLError, RespError, RespConnectionError, ValueError) as exc:
                problems.append(f"{host}:{port}: {type(exc).__name__} {exc}")
                continue
            if not (isinstance(answer, list) and len(answer) == 2):
                problems.append(f"{host}:{port}: does not monitor {self.master_name!r}")
                continue
            if i:
                self.sentinels.insert(0, self.sentinels.pop(i))
            return answer[0].decode(), int(answer[1])
        raise RespConnectionError(f"no Sentinel named the master {self.master_name!r}: " + "; ".join(problems))

    async def _watch_switches(self) -> None:
        """Subscribed to +switch-master on one Sentinel at a time: when our master moves, the connection ends at once
        (the next command discovers the new one) instead of waiting for an error from the old one. Ends at close()."""
        while self.sentinels:
            host, port = self.sentinels[0]
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port, ssl=self.ssl, server_hostname=host if self.ssl else None), self.timeout
                )
            except (OSError, asyncio.TimeoutError, ssl.SSLError):
                self.sentinels.append(self.sentinels.pop(0))
                await asyncio.sleep(1.0)
                continue
            try:
                writer.write(encode(("SUBSCRIBE", "+switch-master")))
                authed = False
                buf = bytearray()
                while True:
                    chunk = await reader.read(65536)
                    if not chunk:
                        break
                    buf += chunk
                    pos = 0
                    try:
                        while pos < len(buf):
                            value, pos = parse(buf, pos)
                            if isinstance(value, RespError):
                                if str(value).startswith("NOAUTH") and self.password is not None and not authed:
                                    authed = True
                                    writer.write(encode(("AUTH", self.password)) + encode(("SUBSCRIBE", "+switch-master")))
                                    continue
                                raise RespConnectionError(str(value))
                            if isinstance(value, list) and len(value) == 3 and value[0] == b"message":
                                if value[2].split(b" ", 1)[0] == self.master_name.encode():
                                    self.switches += 1
                                    proto = self._proto
                                    if proto is not None:
                                        proto.fail(RespConnectionError(f"{self.master_name}: +switch-master {value[2].decode()}"))
                    except _Incomplete:
                        pass
                    del buf[:pos]
            except (OSError, RespConnectionError, ValueError):
                pass
            finally:
                writer.close()
            self.sentinels.append(self.sentinels.pop(0))
            await asyncio.sleep(1.0)

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
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watch
        proto, self._proto = self._proto, None
        if proto is not None:
            if proto.timer is not None:
                proto.timer.cancel()
            if proto.transport is not None:
                proto.transport.close()
