"""Request intake against hostile input: strict JSON (no NaN / Infinity / 1e400), invalid Unicode named by its path,
integers beyond what the router packs, and slow clients (a real `bpdkv router` process: its sockets are the point)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bpdkv.lab.ports import free_port
from bpdkv.router.intake import BadRequest, invalid_unicode_path, shape_problem, strict_loads
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator
from tests.router.helpers import chat

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _refusal(raw: bytes) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        strict_loads(raw, 64)
    return caught.value


@pytest.mark.parametrize(
    ("raw", "reason", "words"),
    [
        (b'{"max_tokens": NaN}', "nonstandard_number", "NaN"),
        (b'{"max_tokens": Infinity}', "nonstandard_number", "Infinity"),
        (b'{"max_tokens": -Infinity}', "nonstandard_number", "-Infinity"),
        (b'{"max_tokens": 1e400}', "nonstandard_number", "1e400"),
        (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "invalid_unicode", "messages[0].content"),
        (b'{"session_id": "\\udfff"}', "invalid_unicode", "session_id"),
        (b'{"tools": [{"\\ud83d": 1}]}', "invalid_unicode", "tools[0]"),
        (b'{"a": "\xff"}', "invalid_json", "not valid JSON"),
        (b"[" * 5000 + b"]" * 5000, "too_deep", "deeper than 64"),
    ],
)
def test_strict_json_refuses_with_what_is_wrong(raw: bytes, reason: str, words: str) -> None:
    bad = _refusal(raw)
    assert bad.status == 400 and bad.reason == reason and words in bad.message, bad.message


def test_strict_json_takes_standard_json() -> None:
    assert strict_loads(b'{"a": [1, 2.5, "\\ud83d\\ude00", null]}', 64) == {"a": [1, 2.5, "\U0001f600", None]}
    assert invalid_unicode_path({"a": ["ok", {"b": "x\ud800"}]}) == "a[1].b"
    assert invalid_unicode_path({"a": ["ok"]}) is None


@pytest.mark.parametrize(
    ("route", "body", "words"),
    [
        (COMPLETIONS, {"prompt": [1, 2, 1 << 63]}, "token ids"),
        (COMPLETIONS, {"prompt": [1, -1]}, "token ids"),
        (COMPLETIONS, {"prompt": [[5, 1 << 64]]}, "token ids"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1 << 63}, "'max_tokens' is out of range"),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "seed": -(1 << 63) - 1}, "'seed' is out of range"),
    ],
)
def test_integers_out_of_range_are_refused(route: str, body: dict[str, Any], words: str) -> None:
    assert words in str(shape_problem(route, body))


def test_integers_in_range_pass() -> None:
    assert shape_problem(COMPLETIONS, {"prompt": [0, (1 << 63) - 1], "seed": -(1 << 63)}) is None


def test_hostile_bodies_get_400_with_the_field_and_reach_no_upstream(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory()
    cases = [
        (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": Infinity}', "Infinity"),
        (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": NaN}', "NaN"),
        (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}', "1e400"),
        (CHAT, b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages[0].content"),
        (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "session_id": "\\ud800"}', "session_id"),
        (COMPLETIONS, b'{"prompt": [1, 2, 9223372036854775808]}', "token ids"),
        (COMPLETIONS, b'{"prompt": [1, 2, 99999999999999999999999]}', "token ids"),  # beyond 64 bits: not an integer any more
        (COMPLETIONS, b'{"prompt": [1, 2, -3]}', "token ids"),
        (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9223372036854775808}', "max_tokens"),
    ]
    for route, raw, words in cases:
        resp = httpx.post(fleet.url + route, content=raw, headers={"content-type": "application/json"}, timeout=10)
        assert resp.status_code == 400, (raw, resp.status_code, resp.text)
        assert words in resp.json()["error"]["message"], (raw, resp.text)
    assert fleet.prefill[0].requests == [] and fleet.decode[0].requests == []
    assert fleet.metric("bpdkv_router_rejected_total", reason="nonstandard_number") == 3
    assert fleet.metric("bpdkv_router_rejected_total", reason="invalid_unicode") == 2
    text, _ = chat(fleet.url, [{"role": "user", "content": "still serving?"}])
    assert text


# ---- fuzzed: the classes above mixed into otherwise plausible bodies ---------------------------------------------
NUMBER = st.sampled_from(["1e400", "-1e400", "NaN", "Infinity", "-Infinity", "9223372036854775808", "-9223372036854775809", "1", "0.5"])
STRING = st.sampled_from(['"ok"', '"\\ud800"', '"a\\udfffb"', '"\\ud83d\\ude00"', '"\\u0000"', '""'])
TOKEN = st.one_of(st.integers(0, 300).map(str), NUMBER)


@st.composite
def hostile_body(draw: Any) -> tuple[str, bytes]:
    if draw(st.booleans()):
        content = draw(STRING)
        fields = [f'"messages": [{{"role": "user", "content": {content}}}]']
        route = CHAT
    else:
        tokens = ", ".join(draw(st.lists(TOKEN, min_size=1, max_size=4)))
        fields = [f'"prompt": [{tokens}]']
        route = COMPLETIONS
    for key in draw(st.lists(st.sampled_from(["max_tokens", "temperature", "n", "seed"]), max_size=2, unique=True)):
        fields.append(f'"{key}": {draw(NUMBER)}')
    if draw(st.booleans()):
        fields.append(f'"session_id": {draw(STRING)}')
    return route, ("{" + ", ".join(fields) + "}").encode()


@pytest.fixture(scope="module")
def hostile_fleet() -> Any:
    from tests.router.conftest import make_fleet, stop_fleet

    fleet = make_fleet()
    yield fleet
    stop_fleet(fleet)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=hostile_body())
def test_fuzzed_hostile_bodies_never_get_a_router_5xx(hostile_fleet: Any, case: tuple[str, bytes]) -> None:
    route, raw = case
    resp = httpx.post(hostile_fleet.url + route, content=raw, headers={"content-type": "application/json"}, timeout=10)
    assert resp.status_code < 500, (raw, resp.status_code, resp.text[:300])
    text, _ = chat(hostile_fleet.url, [{"role": "user", "content": "served right after?"}])
    assert text


def test_router_serves_after_hostile_fuzzing(hostile_fleet: Any) -> None:
    assert hostile_fleet.metric("bpdkv_router_requests_total", route=CHAT, status="500") == 0
    assert hostile_fleet.metric("bpdkv_router_requests_total", route=COMPLETIONS, status="500") == 0


# ---- slow clients: a real router process ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slow_client_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    p = VllmEmulator(EmulatorSettings(role="prefill"))
    d = VllmEmulator(EmulatorSettings(role="decode"))
    group = ServerGroup([p.app, d.app])
    urls = group.start()
    tmp = tmp_path_factory.mktemp("slow")
    port = free_port()
    config = {
        "listen": "127.0.0.1",
        "port": port,
        "prefill": [{"name": "prefill-0", "url": urls[0]}],
        "decode": [{"name": "decode-0", "url": urls[1]}],
        "client_timeouts": {"header": 1.0, "body": 1.0},
    }
    path = tmp / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    with (tmp / "router.log").open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bpdkv.cli", "router", "--config", str(path), "--log-level", "warning"],
            stderr=out,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, (tmp / "router.log").read_text()
            time.sleep(0.1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        group.stop()


def _exchange(url: str, parts: list[bytes], pause: float = 0.0, limit: float = 10.0) -> tuple[bytes, float]:
    """Send parts (pause after each), then read until the router closes; (what came back, seconds to the close)."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=limit) as sock:
        for part in parts:
            sock.sendall(part)
            time.sleep(pause)
        got = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return got, time.monotonic() - start
            got += chunk


BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()


@pytest.mark.parametrize(
    "name",
    ["nothing sent", "half a header", "header trickled", "short content-length", "chunked without the last chunk", "after a response"],
)
def test_slow_clients_get_408_and_are_closed(slow_client_router: str, name: str) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    parts = {
        "nothing sent": [],
        "half a header": [head],
        "header trickled": [head[:10], head[10:20], head[20:30], head[30:40], head[40:50]],  # 0.3 s apart: 1.5 s in all
        "short content-length": [head + b"content-length: %d\r\n\r\n" % (len(BODY) + 10) + BODY],
        "chunked without the last chunk": [head + b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(BODY), BODY)],
        "after a response": [b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n" + head[:20]],
    }[name]
    got, seconds = _exchange(slow_client_router, parts, pause=0.3 if name == "header trickled" else 0.0)
    assert b"408 Request Timeout" in got, (name, got[:300])
    assert b"connection: close" in got.lower()
    assert 0.9 < seconds < 5, (name, seconds)
    text, _ = chat(slow_client_router, [{"role": "user", "content": "a prompt client is served"}])
    assert text


def test_a_prompt_client_on_the_same_router_is_not_timed_out(slow_client_router: str) -> None:
    got, _ = _exchange(
        slow_client_router,
        [
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY)
        ],
    )
    assert got.startswith(b"HTTP/1.1 200"), got[:300]
