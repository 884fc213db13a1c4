"""HTTP versions (issue 42): an HTTP/1.0 stream is close-delimited (no chunked coding in 1.0), a non-streamed 1.0
answer keeps its Content-Length; RFC 9112's refusals — an HTTP/1.1 request without Host, a version other than 1.0/1.1,
HTTP/0.9's simple request line — each get a 4xx/505 with one log line and a closed connection. Raw sockets against a
real `bpdkv router` process (its own protocol), and the router's app under uvicorn's plain httptools and h11
protocols (the test fleet's servers, and h11's own framing)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml

from bpdkv.contracts import local_redis_conf
from bpdkv.lab.ports import free_port
from bpdkv.router.intake import head_problem, request_line_problem
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator

CHAT = "/v1/chat/completions"
REFUSED = "refused ("  # the router's one log line for a refused head


@dataclass
class RouterProcess:
    port: int
    pid: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def refusals(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if REFUSED in line]


def start_router(tmp: Path, prefill_url: str, decode_url: str, workers: int = 1) -> tuple[subprocess.Popen[bytes], RouterProcess]:
    """A `bpdkv router` process (the product's own server: httptools protocol with the head rules) on loopback; with
    workers > 1, a supervisor, its workers and its own redis-server."""
    port = free_port()
    config: dict[str, Any] = {
        "listen": "127.0.0.1",
        "port": port,
        "prefill": [{"name": "prefill-0", "url": prefill_url}],
        "decode": [{"name": "decode-0", "url": decode_url}],
    }
    if workers > 1:
        redis_port = free_port()
        (tmp / "redis.conf").write_text(local_redis_conf("http-versions", redis_port, str(tmp)))
        config |= {"workers": workers, "state": f"redis://127.0.0.1:{redis_port}/0", "local_redis_conf": str(tmp / "redis.conf")}
    path = tmp / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp / "router.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bpdkv.cli", "router", "--config", str(path), "--log-level", "warning"],
            stderr=out,
            start_new_session=True,
        )
    router = RouterProcess(port, proc.pid, log)
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(router.url + "/health", timeout=1).status_code == 200:
                return proc, router
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            stop_process(proc)
            raise AssertionError(log.read_text())
        time.sleep(0.1)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


@pytest.fixture(scope="module")
def router_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    group = ServerGroup([VllmEmulator(EmulatorSettings(role="prefill")).app, VllmEmulator(EmulatorSettings(role="decode")).app])
    urls = group.start()
    try:
        proc, router = start_router(tmp_path_factory.mktemp("http-versions"), urls[0], urls[1])
        try:
            yield router
            assert proc.poll() is None, "the router kept serving"
            assert "Traceback" not in router.log.read_text()
        finally:
            stop_process(proc)
    finally:
        group.stop()


# ---- raw HTTP ---------------------------------------------------------------------------------------------------
def exchange(port: int, raw: bytes, timeout: float = 20.0) -> bytes:
    """Send raw bytes, read until the server closes (a socket timeout fails the test: the connection stayed open)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(raw)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
        return got


@dataclass
class Answer:
    status_line: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes

    @property
    def status(self) -> int:
        return int(self.status_line.split(b" ")[1])

    def header(self, name: bytes) -> bytes | None:
        values = [v for n, v in self.headers if n.lower() == name]
        assert len(values) <= 1, (name, values)
        return values[0] if values else None


def parse(raw: bytes) -> Answer:
    head, sep, body = raw.partition(b"\r\n\r\n")
    assert sep, raw[:300]
    status_line, *lines = head.split(b"\r\n")
    headers = [(n.strip(), v.strip()) for n, _, v in (line.partition(b":") for line in lines)]
    return Answer(status_line, headers, body)


def dechunk(body: bytes) -> bytes:
    out, rest = b"", body
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert rest == b"\r\n", rest[:100]
            return out
        out, rest = out + rest[:size], rest[size:]
        assert rest.startswith(b"\r\n")
        rest = rest[2:]


def request(version: bytes, body: dict[str, Any] | None = None, target: bytes = CHAT.encode(), extra: bytes = b"") -> bytes:
    host = b"host: router\r\n"
    if body is None:
        return b"GET " + target + b" HTTP/" + version + b"\r\n" + host + extra + b"\r\n"
    raw = json.dumps(body).encode()
    head = b"POST %s HTTP/%s\r\n%scontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n" % (target, version, host, len(raw), extra)
    return head + raw


def chat_body(stream: bool, max_tokens: int = 60, content: str = "tell me about the versions of HTTP") -> dict[str, Any]:
    return {
        "model": "emulated",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
    }


_IDS = re.compile(rb'"id":"[^"]*"|"created":\d+')


def events(stream: bytes) -> list[bytes]:
    """The SSE events of a stream, each checked whole (a `data:` line of JSON or [DONE]), with the per-request id and
    timestamp blanked so that two requests' events compare equal."""
    assert stream.endswith(b"\n\n"), stream[-200:]
    out = []
    for event in stream[:-2].split(b"\n\n"):
        assert event.startswith(b"data: ") and b"\n" not in event, event[:200]
        if event != b"data: [DONE]":
            json.loads(event[6:])
        out.append(_IDS.sub(b"_", event))
    assert out[-1] == b"data: [DONE]"
    return out


# ---- the rules, as functions ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("line", "status"),
    [
        (b"GET /", 400),
        (b"GET /health\r", 400),
        (b"GET / HTTP/2.0", 505),
        (b"GET / HTTP/3.0\r", 505),
        (b"GET / HTTP/0.9", 505),
        (b"GET / HTTP/1.2", 400),
        (b"GET / HTTP/1.9", 400),
        (b"GET / HTTP/1.1", None),
        (b"POST /v1/completions HTTP/1.0\r", None),
        (b"DESCRIBE / RTSP/1.0", 400),  # httptools' parser would read it as HTTP/1.0
        (b"SOURCE / ICE/1.0\r", 400),
        (b"GET / http/1.1", 400),
        (b"GET / HTTP/1.1/2", None),  # malformed otherwise: httptools' parser says 400
        (b"GET", None),
    ],
)
def test_request_line_versions(line: bytes, status: int | None) -> None:
    problem = request_line_problem(line)
    assert (None if problem is None else int(problem[0][:3])) == status, problem


def test_host_rules() -> None:
    assert head_problem("1.1", [(b"host", b"x")]) is None
    assert head_problem("1.0", []) is None  # HTTP/1.0 has no Host requirement
    assert head_problem("1.1", [(b"content-type", b"x")]) == ("400 Bad Request", "an HTTP/1.1 request needs a Host header (RFC 9112 §3.2)")
    assert head_problem("1.0", [(b"host", b"a"), (b"host", b"b")]) is not None
    assert head_problem("2.0", [(b"host", b"x")])[0].startswith("505")  # type: ignore[index]
    assert head_problem("0.9", [])[0].startswith("400")  # type: ignore[index]


# ---- HTTP/1.0 against the router process ------------------------------------------------------------------------
def test_http10_stream_is_close_delimited_and_every_event_intact(router_process: RouterProcess) -> None:
    answer = parse(exchange(router_process.port, request(b"1.0", chat_body(stream=True))))
    assert answer.status == 200, answer
    assert answer.header(b"transfer-encoding") is None and answer.header(b"content-length") is None
    assert answer.header(b"connection") == b"close"
    assert answer.header(b"content-type").startswith(b"text/event-stream")  # type: ignore[union-attr]
    got = events(answer.body)  # no chunk-size line anywhere: every line is an event's or the blank between
    assert len(got) > 60
    # The same request over HTTP/1.1: chunked, and the same events once the chunks are taken off.
    chunked = parse(exchange(router_process.port, request(b"1.1", chat_body(stream=True), extra=b"connection: close\r\n")))
    assert chunked.header(b"transfer-encoding") == b"chunked"
    assert events(dechunk(chunked.body)) == got


def test_http10_stream_asking_for_keep_alive_is_still_closed(router_process: RouterProcess) -> None:
    # Without a length, the close is the only end a 1.0 client can see.
    answer = parse(
        exchange(router_process.port, request(b"1.0", chat_body(stream=True, max_tokens=5), extra=b"connection: keep-alive\r\n"))
    )
    assert answer.status == 200 and answer.header(b"transfer-encoding") is None and answer.header(b"connection") == b"close"
    assert len(events(answer.body)) == 7


def test_http10_not_streamed_keeps_its_content_length(router_process: RouterProcess) -> None:
    answer = parse(exchange(router_process.port, request(b"1.0", chat_body(stream=False))))
    assert answer.status == 200 and answer.header(b"transfer-encoding") is None
    assert answer.header(b"content-length") == str(len(answer.body)).encode()
    assert json.loads(answer.body)["choices"][0]["message"]["content"]
    health = parse(exchange(router_process.port, b"GET /health HTTP/1.0\r\n\r\n"))  # 1.0 needs no Host
    assert health.status == 200 and json.loads(health.body) == {"status": "ok"}


def test_http11_keeps_the_connection_across_a_stream(router_process: RouterProcess) -> None:
    """Two streams and a request on one HTTP/1.1 connection: chunked, each read to its end, the connection kept."""
    with socket.create_connection(("127.0.0.1", router_process.port), timeout=20) as sock:
        stream = sock.makefile("rb")
        for body in (chat_body(stream=True, max_tokens=8), chat_body(stream=True, max_tokens=3)):
            sock.sendall(request(b"1.1", body))
            assert stream.readline() == b"HTTP/1.1 200 OK\r\n"
            head = b""
            while (line := stream.readline()) != b"\r\n":
                head += line
            assert b"transfer-encoding: chunked" in head and b"connection" not in head
            data = b""
            while True:
                size = int(stream.readline(), 16)
                data += stream.read(size + 2)[:size]
                if size == 0:
                    break
            assert len(events(data)) == body["max_tokens"] + 2
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert stream.read().endswith(b'{"status":"ok"}')


def test_http10_stream_cut_by_d_ends_with_the_error_event_and_the_close(fleet_factory: Any) -> None:
    """D dies mid-stream: the error event goes out unframed like the others, and the close ends the stream."""
    fleet = fleet_factory(d_settings={"token_interval": 0.05})
    port = int(fleet.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(request(b"1.0", chat_body(stream=True, max_tokens=400)))
        got = b""
        while got.count(b"data: ") < 3:  # the stream is under way
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        fleet.group.crash()  # P and D end as killed processes would; the router stays
        while chunk := sock.recv(65536):
            got += chunk
    answer = parse(got)
    assert answer.status == 200 and answer.header(b"transfer-encoding") is None and answer.header(b"connection") == b"close"
    body = answer.body
    assert body.endswith(b"\n\n") and b"[DONE]" not in body
    *tokens, last = body[:-2].split(b"\n\n")
    assert all(event.startswith(b"data: {") and json.loads(event[6:])["choices"] for event in tokens)
    assert json.loads(last[6:])["error"]["message"].startswith("decode failed mid-stream")


# ---- what RFC 9112 refuses ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "status", "words"),
    [
        (b"GET /health HTTP/1.1\r\n\r\n", 400, b"needs a Host header"),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
            400,
            b"needs a Host header",
        ),
        # bytes after the refused head that the parser then fails on: still the one answer and the one line
        (b"GET /health HTTP/1.1\r\n\r\n{not announced}", 400, b"needs a Host header"),
        (b"GET /health HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n", 400, b"one Host header, not 2"),
        (b"GET /health HTTP/2.0\r\nhost: x\r\n\r\n", 505, b"HTTP/2.0 is not supported"),
        (b"GET /health HTTP/3.0\r\nhost: x\r\n\r\n", 505, b"HTTP/3.0 is not supported"),
        (b"GET /health HTTP/0.9\r\n\r\n", 505, b"HTTP/0.9 is not supported"),
        (b"GET /health HTTP/1.2\r\nhost: x\r\n\r\n", 400, b"HTTP/1.2 is not an HTTP version"),
        (b"GET /health RTSP/1.0\r\nhost: x\r\n\r\n", 400, b"RTSP is not HTTP"),
        (request(b"2.0", chat_body(stream=True)), 505, b"HTTP/2.0 is not supported"),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505, b"HTTP/2.0 is not supported"),  # HTTP/2's connection preface
        # HTTP/0.9's simple request: one line, then the client waits (answered at once, not after a header timeout)
        (b"GET /health\r\n", 400, b"HTTP/0.9 requests are not served"),
        (b"\r\nGET /\r\n", 400, b"HTTP/0.9 requests are not served"),
    ],
)
def test_refused_heads_get_one_answer_one_log_line_and_a_close(
    router_process: RouterProcess, raw: bytes, status: int, words: bytes
) -> None:
    before, log_before = len(router_process.refusals()), len(router_process.log.read_text())
    answer = parse(exchange(router_process.port, raw, timeout=5))  # the close ends the read: no header timeout waited
    assert answer.status == status and answer.header(b"connection") == b"close", answer
    assert words in answer.body and answer.header(b"content-length") == str(len(answer.body)).encode()
    assert json.loads(answer.body)["error"]["code"] == status
    lines = router_process.refusals()[before:]
    assert len(lines) == 1 and f"refused ({status})" in lines[0], lines
    time.sleep(0.2)  # whatever the router would log after the answer (the rest of the read parsed)
    assert router_process.log.read_text()[log_before:].count("\n") == 1, router_process.log.read_text()[log_before:]


def test_after_the_refusals_the_router_serves(router_process: RouterProcess) -> None:
    answer = parse(exchange(router_process.port, request(b"1.1", chat_body(stream=False, max_tokens=4), extra=b"connection: close\r\n")))
    assert answer.status == 200 and json.loads(answer.body)["choices"][0]["message"]["content"]


def test_workers_speak_the_same(tmp_path: Path) -> None:
    """A supervisor with two workers (each its own uvicorn on the shared port): a 1.0 stream close-delimited and a
    missing Host refused, on whichever worker the kernel hands each connection."""
    group = ServerGroup([VllmEmulator(EmulatorSettings(role="prefill")).app, VllmEmulator(EmulatorSettings(role="decode")).app])
    urls = group.start()
    try:
        proc, router = start_router(tmp_path, urls[0], urls[1], workers=2)
        try:
            for _ in range(4):  # new connections: spread over both workers
                answer = parse(exchange(router.port, request(b"1.0", chat_body(stream=True, max_tokens=10))))
                assert answer.status == 200 and answer.header(b"transfer-encoding") is None
                assert answer.header(b"connection") == b"close" and len(events(answer.body)) == 12
                refused = parse(exchange(router.port, b"GET /health HTTP/1.1\r\n\r\n"))
                assert refused.status == 400 and b"needs a Host header" in refused.body
            assert len(router.refusals()) == 4 and "Traceback" not in router.log.read_text()
        finally:
            stop_process(proc)
    finally:
        group.stop()


# ---- the router's app under uvicorn's own protocols ---------------------------------------------------------------
class OneServer:
    """The router's ASGI app under plain uvicorn with the named HTTP protocol, in a thread (bounded lifetime)."""

    def __init__(self, app: Any, http: str) -> None:
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, http=http, log_level="error", lifespan="on", timeout_graceful_shutdown=2)
        )
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    def __enter__(self) -> int:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    def __exit__(self, *_: Any) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive()


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_http10_stream_is_close_delimited_under_uvicorns_protocols(fleet_factory: Any, http: str) -> None:
    """httptools: the relay writes D's bytes itself and decides the framing before the head; h11: the relay's ASGI
    path, and h11 frames a 1.0 response by the close."""
    fleet = fleet_factory()
    with OneServer(fleet.routers[0].app, http) as port:
        answer = parse(exchange(port, request(b"1.0", chat_body(stream=True, max_tokens=20))))
        assert answer.status == 200 and answer.header(b"transfer-encoding") is None
        assert answer.header(b"connection") == b"close"
        got = events(answer.body)
        chunked = parse(exchange(port, request(b"1.1", chat_body(stream=True, max_tokens=20), extra=b"connection: close\r\n")))
        assert chunked.header(b"transfer-encoding") == b"chunked"
        assert events(dechunk(chunked.body)) == got and len(got) == 22
        plain = parse(exchange(port, request(b"1.0", chat_body(stream=False, max_tokens=5))))
        assert plain.status == 200 and plain.header(b"content-length") == str(len(plain.body)).encode()
