"""The router's own HTTP/1.1 upstream client and the relay's direct-transport path, against real sockets on loopback."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from bpdkv.lab.ports import free_port
from bpdkv.router import relay
from bpdkv.router.relay import _direct_cycle
from bpdkv.router.upstream_http import Answer, ConnectFailed, ConnectionLost, UpstreamClient, UpstreamStream, UpstreamTimeout
from bpdkv.testing.vllm_emulator import ServerGroup

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.AbstractServer, str, list[int]]:
    """A raw HTTP server on loopback; handler(reader, writer, connection number). Returns the accepted count too."""
    accepted = [0]

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        try:
            await handler(reader, writer, accepted[0])
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", accepted


def _against(handler: Handler, scenario: Callable[[UpstreamClient, str, list[int]], Awaitable[None]]) -> None:
    """scenario(client, server URL, accepted count) against a raw server; both closed afterwards."""

    async def main() -> None:
        server, url, accepted = await _serve(handler)
        client = UpstreamClient(connect_timeout=2)
        try:
            await scenario(client, url, accepted)
        finally:
            await client.close()
            server.close()

    asyncio.run(main())


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


def test_connection_closed_while_idle_is_replaced_not_failed() -> None:
    """vLLM's server closes idle keep-alive connections: the next request goes out on a fresh one, no failure."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await _read_request(reader)
        answer = b'{"n": %d}' % n
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer))
        await writer.drain()
        # keep-alive announced, then the connection closes (an idle timeout on the server's side)

    async def scenario(client: UpstreamClient, url: str, accepted: list[int]) -> None:
        first = await client.fetch("POST", url + "/x", b"{}", {}, 5)
        await asyncio.sleep(0.1)  # the server's close reaches the idle connection
        second = await client.fetch("POST", url + "/x", b"{}", {}, 5)
        assert (first.status, first.content, second.content) == (200, b'{"n": 1}', b'{"n": 2}')
        assert accepted[0] == 2

    _against(handler, scenario)


def test_keepalive_reuses_one_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        for _ in range(3):
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async def scenario(client: UpstreamClient, url: str, accepted: list[int]) -> None:
        answers = [await client.fetch("GET", url + "/health", None, {}, 5) for _ in range(3)]
        assert all(a == Answer(200, "application/json", b"ok") for a in answers) and accepted[0] == 1

    _against(handler, scenario)


def test_failures_are_typed_and_bounded() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        request = await _read_request(reader)
        if b"/silent" in request:
            await asyncio.sleep(5)
        elif b"/stall" in request:  # headers and one event, then nothing
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"a\r\ndata: {}\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(5)
        elif b"/cut" in request:  # a declared body cut short
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
            await writer.drain()
        # /closed: the connection closes without an answer

    outcomes: dict[str, str] = {}

    async def scenario(client: UpstreamClient, url: str, accepted: list[int]) -> None:
        for path in ("/silent", "/cut", "/closed"):
            t0 = time.monotonic()
            try:
                await client.fetch("POST", url + path, b"{}", {}, 0.3)
                outcomes[path] = "answered"
            except (UpstreamTimeout, ConnectionLost) as exc:
                outcomes[path] = type(exc).__name__
            assert time.monotonic() - t0 < 2
        stream = await client.open_stream(url + "/stall", b"{}", {}, 2, 0.3)
        assert isinstance(stream, UpstreamStream) and stream.first == b"data: {}\n\n"
        ended: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        stream.attach(lambda data: None, ended.set_result)
        error = await asyncio.wait_for(ended, 2)
        outcomes["/stall"] = type(error).__name__
        stream.close(False)
        port = free_port()  # nothing listens there
        try:
            await client.fetch("GET", f"http://127.0.0.1:{port}/health", None, {}, 1)
        except ConnectFailed:
            outcomes["refused"] = "ConnectFailed"

    _against(handler, scenario)
    assert outcomes == {
        "/silent": "UpstreamTimeout",
        "/cut": "ConnectionLost",
        "/closed": "ConnectionLost",
        "/stall": "UpstreamTimeout",
        "refused": "ConnectFailed",
    }


def test_router_fleet_relays_on_the_direct_transport_path() -> None:
    """The relay's fast path (D's bytes written to uvicorn's transport) is the one the router's server and the test
    fleet take: the fleet tests exercise it, not the ASGI fallback."""
    seen: list[bool] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        seen.append(_direct_cycle(send) is not None)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    group = ServerGroup([app])
    (url,) = group.start()
    try:
        assert httpx.get(url + "/", timeout=5).text == "ok"
    finally:
        group.stop()
    assert seen == [True]


def test_slow_client_gets_a_long_stream_whole(fleet_factory, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Backpressure: a client reading slowly through a small receive buffer pauses reading from D (the router's
    write buffer passes its high-water mark) and still gets every event, in order, once."""
    from bpdkv.router.turn import DecodeStream

    pauses: list[int] = []
    pause = DecodeStream.pause

    def counted(self: DecodeStream) -> None:
        pauses.append(1)
        pause(self)

    monkeypatch.setattr(DecodeStream, "pause", counted)
    direct_cycle = relay._direct_cycle

    def small_buffers(send: Any) -> Any:
        # Loopback's kernel buffers would absorb megabytes: shrink the router side's so a few hundred kB suffice.
        cycle = direct_cycle(send)
        cycle.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        cycle.transport.set_write_buffer_limits(high=16384)
        return cycle

    monkeypatch.setattr(relay, "_direct_cycle", small_buffers)
    fleet = fleet_factory()
    n = 3000
    body = b'{"model":"emulated","messages":[{"role":"user","content":"long"}],"max_tokens":%d,"ignore_eos":true,"stream":true}' % n
    host, port = fleet.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(20)
    sock.connect((host, int(port)))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (len(body), body)
    )
    time.sleep(1.0)  # let the router fill its buffers while nothing is read
    data = bytearray()
    deadline = time.monotonic() + 30
    while not data.endswith(b"0\r\n\r\n") and time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    sock.close()
    head, _, chunked = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    payload, rest = bytearray(), chunked
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        payload += rest[:size]
        rest = rest[size + 2 :]
    events = [e for e in bytes(payload).split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and b"kv_transfer_params" not in payload
    assert sum(1 for e in events if b'"content"' in e) >= n
    assert fleet.metric("bpdkv_router_requests_total", status="200") == 1
    assert pauses  # the path under test was taken
