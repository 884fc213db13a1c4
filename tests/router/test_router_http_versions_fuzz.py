"""The hypothesis fuzz of issue 35 (tests/router/test_router_hostile3.py: JSON bodies) extended to the request head
(issue 42): method, target, version, header names and values, line endings, with or without a body, sent raw to a
real `bpdkv router` process. Whatever the head, the router answers with a status line of its own (never a 5xx but
the 505 of a version it does not speak) or waits for the rest of an incomplete request; it logs no traceback and
keeps serving."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from bpdkv.bench.runner import metric_value
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator
from tests.router.test_router_http_versions import CHAT, RouterProcess, chat_body, start_router, stop_process

READ_S = 3.0  # how long a fuzzed request's answer is waited for (an incomplete request gets none: that is allowed)
OTHER_MAJOR = re.compile(rb"HTTP/[02-9]\.[0-9]")


def mostly(usual: st.SearchStrategy[bytes], *hostile: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """The usual value seven times in ten, else a hostile one: most heads get past the parser to the router."""
    return st.integers(0, 9).flatmap(lambda i: usual if i < 7 else st.one_of(*hostile))


METHODS = mostly(
    st.sampled_from([b"GET", b"POST"]),
    st.sampled_from([b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"TRACE", b"CONNECT", b"PRI", b"get", b"DESCRIBE", b"SOURCE"]),
    st.sampled_from([b"", b"POST ", b"G\x00T", b"\xff\xfe", b"M-SEARCH", b"A" * 300]),
    st.binary(max_size=8),
)
TARGETS = mostly(
    st.sampled_from([CHAT.encode(), b"/v1/completions", b"/health", b"/metrics", b"/v1/models"]),
    st.sampled_from([b"*", b"http://router/health", b"//health", b"/health?x=\xff", b"/%00", b"/%zz", b"", b"/a#b", b"/" + b"a" * 8000]),
    st.sampled_from([b"/health\x00", b"/ health", b"\t/", b"/\r", b"router:80", b"/admin/upstreams", b"/v1/chat/completions?stream=1"]),
    st.binary(max_size=16),
)
VERSIONS = mostly(
    st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"]),
    st.sampled_from([b"HTTP/2.0", b"HTTP/0.9", b"HTTP/1.2", b"HTTP/3.0", b"HTTP/9.9", b"RTSP/1.0", b"ICE/1.0"]),
    st.sampled_from([b"http/1.1", b"HTTP/1", b"HTTP/1.", b"HTTP/11.1", b"HTTP/1.1 ", b"", b"HTTP/\xff.1", b"HTTP/1.1\x00"]),
    st.sampled_from([b"HTTP/1.01", b"HTTP/-1.1", b"HTTP /1.1"]),
    st.binary(max_size=10),
)
HEADER_NAMES = mostly(
    st.sampled_from([b"host", b"Host", b"content-length", b"transfer-encoding", b"connection", b"expect", b"upgrade", b"content-type"]),
    st.sampled_from([b"te", b"trailer", b"x-session-id", b"authorization", b"x-forwarded-for", b"http2-settings", b"HOST"]),
    st.sampled_from([b"", b"bad name", b"na:me", b"\x00", b"\xff", b"a" * 300, b" host", b"host ", b"x\ty"]),
    st.binary(max_size=10),
)
HEADER_VALUES = mostly(
    st.sampled_from(
        [b"x", b"router", b"close", b"keep-alive", b"chunked", b"100-continue", b"websocket", b"h2c", b"0", b"application/json"]
    ),
    st.sampled_from([b"", b"gzip, chunked", b"-1", b"99999999999999999999", b"Upgrade, HTTP2-Settings", b"a" * 2000, b"router:99999"]),
    st.sampled_from([b"a b", b" lead", b"trail ", b"\x00", b"\x7f", b"\xff\xfe", b"x\ry", b"x\n y", b"x\r\n y"]),
    st.binary(max_size=20),
)


@st.composite
def hostile_head(draw: Any) -> tuple[bytes, bytes, bytes]:
    """(request bytes, method, version token) — one request, complete unless its own headers say otherwise."""
    method, target, version = draw(METHODS), draw(TARGETS), draw(VERSIONS)
    eol = draw(st.sampled_from([b"\r\n"] * 4 + [b"\n"]))
    line = method + b" " + target + (b" " + version if draw(st.integers(0, 9)) else b"")
    headers = []
    if draw(st.integers(0, 9)):  # mostly with a Host
        headers.append((b"host", b"router"))
    headers += draw(st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=4))
    body = b""
    if method == b"POST" or draw(st.integers(0, 4)) == 0:
        body = json.dumps(chat_body(stream=draw(st.booleans()), max_tokens=2, content="fuzzed head")).encode()
        if draw(st.integers(0, 4)):  # mostly a body the headers announce; sometimes one they do not
            headers.append((b"content-length", str(len(body)).encode()))
    head = line + eol + b"".join(n + b": " + v + eol for n, v in headers) + eol
    return head + body, method, version


def _answer(port: int, raw: bytes, method: bytes) -> bytes:
    """The router's answer: read until the connection closes or the answer is complete (a keep-alive connection is
    not waited out), or until READ_S passes with nothing (an incomplete request the router is still reading)."""
    with socket.create_connection(("127.0.0.1", port), timeout=READ_S) as sock:
        try:
            sock.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the whole request went: what came back says why
        got = b""
        deadline = time.monotonic() + READ_S
        while time.monotonic() < deadline and not _complete(got, method):
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            got += chunk
        return got


def _complete(got: bytes, method: bytes) -> bool:
    head, sep, body = got.partition(b"\r\n\r\n")
    if not sep:
        return False
    lowered = head.lower()
    if method == b"HEAD" or lowered.startswith((b"http/1.1 204", b"http/1.1 304")):
        return True
    length = re.search(rb"\r\ncontent-length: *(\d+)", lowered)
    if length:
        return len(body) >= int(length.group(1))
    if b"\r\ntransfer-encoding: chunked" in lowered:
        return body == b"0\r\n\r\n" or body.endswith(b"\r\n0\r\n\r\n")
    return False  # close-delimited: the close ends it


@pytest.fixture(scope="module")
def router_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    group = ServerGroup([VllmEmulator(EmulatorSettings(role="prefill")).app, VllmEmulator(EmulatorSettings(role="decode")).app])
    urls = group.start()
    try:
        proc, router = start_router(tmp_path_factory.mktemp("head-fuzz"), urls[0], urls[1])
        try:
            yield router
            assert proc.poll() is None, "the router kept serving"
        finally:
            stop_process(proc)
    finally:
        group.stop()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=hostile_head())
def test_fuzzed_heads_never_get_a_5xx_of_the_router(router_process: RouterProcess, case: tuple[bytes, bytes, bytes]) -> None:
    raw, method, version = case
    got = _answer(router_process.port, raw, method)
    if not got:
        event("no answer")
        return  # no answer yet: the router is still reading a request its head left incomplete
    status_line = got.split(b"\r\n", 1)[0]
    event(status_line[:12].decode("latin-1"))
    assert re.fullmatch(rb"HTTP/1\.1 [1-5][0-9][0-9] [ -~]*", status_line), (raw[:300], got[:300])
    status = int(status_line[9:12])
    if status == 505:  # the one 5xx the router sends of its own: a major version it does not speak
        assert OTHER_MAJOR.fullmatch(version), (raw[:300], got[:300])
    else:
        assert status < 500, (raw[:300], got[:300])


def test_after_the_head_fuzz_the_router_serves_and_logged_no_traceback(router_process: RouterProcess) -> None:
    log = router_process.log.read_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    assert httpx.get(router_process.url + "/health", timeout=10).json() == {"status": "ok"}
    for stream in (False, True):
        resp = httpx.post(router_process.url + CHAT, json=chat_body(stream=stream, max_tokens=4), timeout=30)
        assert resp.status_code == 200 and (b"data: [DONE]" in resp.content if stream else resp.json()["choices"])
    metrics = httpx.get(router_process.url + "/metrics", timeout=10).text
    for route in (CHAT, "/v1/completions"):
        for status in ("500", "502", "503", "504"):
            assert metric_value(metrics, "bpdkv_router_requests_total", {"route": route, "status": status}) == 0
