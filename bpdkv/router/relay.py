"""Server-sent events: D's stream relayed to the client (the one SSE parser and `Reply` live in bpdkv.sse).

The relay forwards D's bytes as they arrive, cut at event boundaries (so an event is never split between the
client and the router's edits) and coalesced (whatever one socket read brought goes out in one write). Only an
event carrying kv_transfer_params — D's last — is parsed on the way, to take the params out. The assistant reply
the next turn's identity needs is rebuilt from the kept bytes after the stream ended, and only when it will be
stored.

A stream for another client API (Anthropic Messages, OpenAI Responses: router/surface.py) goes through its surface's
translator: D's chat events, params taken out and kept as they are for the next turn's identity, become that API's
events; its closing events go out once D's stream ended, after what they announce is stored.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.types import Send

from bpdkv import contracts
from bpdkv.router import jsonbytes
from bpdkv.router.surface import StreamTranslator, chat_chunks
from bpdkv.sse import Reply as Reply  # re-exported: the router's modules and tests import it from here

EVENT_END = b"\n\n"
DONE_EVENT = b"data: [DONE]\n\n"
PARAMS_MARK = contracts.KV_TRANSFER_PARAMS.encode()
ASGI_QUEUE_HIGH = 256 * 1024  # bytes of D's events waiting for ASGI send before reading D pauses


def strip_params(events: bytes) -> tuple[bytes, dict[str, Any] | None]:
    """Remove kv_transfer_params from every event of a block of whole events; a chunk that carried only the params
    disappears. Returns the block to send and the params found."""
    out: list[bytes] = []
    found: dict[str, Any] | None = None
    for event in events.split(EVENT_END):
        if not event:
            continue
        if PARAMS_MARK not in event or not event.startswith(b"data:"):
            out.append(event + EVENT_END)
            continue
        try:
            data = jsonbytes.loads(event[5:])
        except ValueError:
            out.append(event + EVENT_END)
            continue
        if not isinstance(data, dict):
            out.append(event + EVENT_END)
            continue
        params = data.pop(contracts.KV_TRANSFER_PARAMS, None)
        if isinstance(params, dict):
            found = params
        for choice in data.get("choices") or ():
            if isinstance(choice, dict) and contracts.KV_TRANSFER_PARAMS in choice:
                inner = choice.pop(contracts.KV_TRANSFER_PARAMS)
                if isinstance(inner, dict):
                    found = inner
        if not data.get("choices") and set(data) - {"choices"} <= {"id", "object", "created", "model"}:
            continue  # a chunk that only carried the params: the client never sees it
        out.append(b"data: " + jsonbytes.dumps(data) + EVENT_END)
    return b"".join(out), found


@dataclass
class RelayOutcome:
    completed: bool  # D's stream ended normally and the client got all of it
    params: dict[str, Any] | None
    kept: bytes  # D's events (params removed), when asked to keep them
    error: str | None = None  # mid-stream upstream failure kind, or "client <kind>"


class UpstreamBody(Protocol):
    """D's open stream as the relay drives it (bpdkv.router.turn.DecodeStream)."""

    first: bytes
    content_type: str

    def attach(self, sink: Callable[[bytes], None], on_end: Callable[[BaseException | None], None]) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def close(self, reusable: bool) -> None: ...


def _direct_cycle(send: Send) -> Any:
    """uvicorn's httptools request cycle behind `send`, when the router is served by it (the router's own server and
    the test fleet): its transport takes D's bytes directly. None under any other ASGI server."""
    cycle = getattr(send, "__self__", None)
    if type(cycle).__module__ != "uvicorn.protocols.http.httptools_impl":
        return None
    if not all(
        hasattr(cycle, a) for a in ("transport", "flow", "chunked_encoding", "disconnected", "response_started", "keep_alive", "scope")
    ):
        return None
    return cycle


def _close_delimit(cycle: Any) -> bool:
    """Make an HTTP/1.0 request's stream close-delimited; whether it is.

    HTTP/1.0 has no chunked coding (RFC 9112 §7): a 1.0 client — or nginx, which speaks 1.0 to its upstreams by default
    — would read the chunk-size lines as part of the event stream. A response without a length is then delimited by
    the connection's close (RFC 9112 §6.3). uvicorn's httptools cycle turns chunked on for any response without a
    length whatever the request's version, unless its framing was decided before the head is written: `chunked_encoding
    = False` here keeps `transfer-encoding` out of the head, `keep_alive = False` puts `connection: close` in it and
    closes after the last write. (h11 frames a 1.0 response this way itself; the relay's ASGI path leaves it to it.)"""
    if cycle.scope.get("http_version") != "1.0":
        return False
    cycle.chunked_encoding = False
    cycle.keep_alive = False
    return True


class _HeadHold:
    """The client's transport while uvicorn writes the response head: the head is kept, and goes out with D's first
    events in one write (one system call here, one read at the client, instead of two each)."""

    __slots__ = ("transport", "head")

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.head = b""

    def write(self, data: bytes) -> None:
        self.head += data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class SseRelay:
    """One streamed response: D's stream → the client. `close()` runs exactly once, whatever happened — client gone
    before the first byte, mid-stream, or a failing write — and hands the outcome to `on_close`.

    Under uvicorn's httptools server, D's bytes are cut at event boundaries and written to the client's transport
    (chunked framing done here, or none for an HTTP/1.0 request: close-delimited) from D's data_received callback: no
    task switch per token. When the client's
    transport is over its high-water mark, reading from D pauses until it drained. Under any other ASGI server the
    same events go through ASGI `send` from this coroutine."""

    def __init__(
        self,
        upstream: UpstreamBody,
        on_close: Callable[[RelayOutcome], Awaitable[None]],
        on_first_byte: Callable[[], None],
        keep: bool,
        translate: StreamTranslator | None = None,
    ) -> None:
        self.upstream = upstream
        self.translate = translate
        self.content_type = upstream.content_type.encode("latin-1")
        self.on_close = on_close
        self.on_first_byte = on_first_byte
        self.keep = keep
        self.status_code = 200
        self._closed = False
        self._params: dict[str, Any] | None = None
        self._kept: list[bytes] = []
        self._pending = b""
        self._held = b""  # D's [DONE] event, written with the response's end (one write for both)
        self._head = b""  # uvicorn's response head, written with D's first events (one write for both)
        self._first_sent = False
        self._out: list[bytes] = []  # blocks for the ASGI path
        self._wake: asyncio.Future[None] | None = None
        self._end: asyncio.Future[BaseException | None] | None = None
        self._client_error: str | None = None

    def _edit(self, block: bytes) -> bytes:
        if PARAMS_MARK in block:
            block, params = strip_params(block)
            if params is not None:
                self._params = params
        if self.keep and block:
            self._kept.append(block)
        if self.translate is not None and block:
            return self.translate.feed(chat_chunks(block))
        return block

    def _whole_events(self, data: bytes) -> bytes:
        """The complete events so far, edited; an incomplete tail waits for the next bytes."""
        if self._pending:
            data = self._pending + data
            self._pending = b""
        if not data.endswith(EVENT_END):
            cut = data.rfind(EVENT_END)
            if cut < 0:
                self._pending = data
                return b""
            self._pending = data[cut + 2 :]
            data = data[: cut + 2]
        return self._edit(data)

    def _ended(self, error: BaseException | None) -> None:
        if self._end is not None and not self._end.done():
            self._end.set_result(error)

    async def send_to(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        self._end = loop.create_future()
        completed = False
        error: str | None = None
        start = {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", self.content_type), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")],
        }
        try:
            cycle = _direct_cycle(send)
            if cycle is not None:
                raw_end = _close_delimit(cycle)
                hold = _HeadHold(cycle.transport)
                cycle.transport = hold
                try:
                    await send(start)
                finally:
                    cycle.transport = hold.transport
                self._head = hold.head
                upstream_error = await self._relay_direct(cycle)
                if self._head and self._client_error is None:  # no event went out: the head goes before the end
                    cycle.transport.write(self._head)
                    self._head = b""
            else:
                raw_end = False
                await send(start)
                upstream_error = await self._relay_asgi(send)
            if self._client_error is not None:
                error = self._client_error
            elif upstream_error is not None:
                # Mid-stream failure: the client already has bytes, so no retry; end the stream with an error event.
                error = type(upstream_error).__name__
                err = {"error": {"message": f"decode failed mid-stream: {error}", "type": "upstream_error"}}
                if self.translate is not None:
                    body = self._held + self.translate.failed(err["error"]["message"])
                else:
                    body = self._held + b"data: " + json.dumps(err).encode() + EVENT_END
                await self._last(send, cycle if raw_end else None, body)
            else:
                tail = self._held + (self._edit(self._pending) if self._pending else b"")
                if self.translate is not None:
                    tail += await self.translate.finish()  # after what it announces is stored (responses.py)
                await self._last(send, cycle if raw_end else None, tail)
                completed = True
        except OSError as exc:  # the client's socket failed under send
            error = f"client {type(exc).__name__}"
        finally:
            # Cancelled (the client went away): close() drops D's connection, which cancels D's request.
            await self.close(completed, error)

    @staticmethod
    async def _last(send: Send, raw_cycle: Any, body: bytes) -> None:
        """The response's last bytes, and its end. A close-delimited response's bytes go to the transport as they are
        (uvicorn would count them against a Content-Length of 0); the empty last message ends it (and closes)."""
        if raw_cycle is not None and body:
            if not (raw_cycle.disconnected or raw_cycle.transport.is_closing()):
                raw_cycle.transport.write(body)
            body = b""
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _relay_direct(self, cycle: Any) -> BaseException | None:
        transport, flow = cycle.transport, cycle.flow
        framed = bool(cycle.chunked_encoding)
        resuming: list[asyncio.Task[None]] = []

        async def resume_when_drained() -> None:
            try:
                await flow.drain()
            finally:
                resuming.clear()
            self.upstream.resume()

        def write(block: bytes) -> None:
            if cycle.disconnected or transport.is_closing():
                self._client_error = "client ConnectionLost"
                self.upstream.pause()
                self._ended(None)
                return
            if self._first_sent and block.endswith(DONE_EVENT):
                self._held = block  # the stream ends right after it: the end's write takes it along
                return
            data = b"%x\r\n%b\r\n" % (len(block), block) if framed else block
            if not self._first_sent:
                self._first_sent = True
                transport.write(self._head + data)  # the response head and D's first events: one write
                self._head = b""
                self.on_first_byte()
            else:
                transport.write(data)
            if flow.write_paused and not resuming:
                self.upstream.pause()
                resuming.append(asyncio.ensure_future(resume_when_drained()))

        kept = self._kept if self.keep else None

        def sink(data: bytes) -> None:
            if not self._pending and data.endswith(EVENT_END) and PARAMS_MARK not in data and self.translate is None:
                # Whole events without D's params: a token's usual read, passed on as it came.
                if kept is not None:
                    kept.append(data)
                write(data)
                return
            block = self._whole_events(data)
            if block:
                write(block)

        assert self._end is not None
        first = self._whole_events(self.upstream.first)
        if first:
            write(first)
        if self._client_error is None:
            self.upstream.attach(sink, self._ended)
        try:
            return await self._end
        finally:
            for task in resuming:
                task.cancel()

    async def _relay_asgi(self, send: Send) -> BaseException | None:
        loop = asyncio.get_running_loop()
        queued = [0]

        def sink(data: bytes) -> None:
            block = self._whole_events(data)
            if block:
                self._out.append(block)
                queued[0] += len(block)
                if queued[0] > ASGI_QUEUE_HIGH:
                    self.upstream.pause()
                if self._wake is not None and not self._wake.done():
                    self._wake.set_result(None)

        def ended(error: BaseException | None) -> None:
            self._ended(error)
            if self._wake is not None and not self._wake.done():
                self._wake.set_result(None)

        assert self._end is not None
        sink(self.upstream.first)
        self.upstream.attach(sink, ended)
        while True:
            if self._out:
                block, self._out = b"".join(self._out), []
                queued[0] = 0
                self.upstream.resume()
                await send({"type": "http.response.body", "body": block, "more_body": True})
                if not self._first_sent:
                    self._first_sent = True
                    self.on_first_byte()
                continue
            if self._end.done():
                return self._end.result()
            self._wake = loop.create_future()
            await self._wake

    async def close(self, completed: bool, error: str | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self.upstream.close(completed)
        await self.on_close(RelayOutcome(completed, self._params, b"".join(self._kept), error))
