"""Hostile input, round three (issue 35): strings and keys at any depth, exact integers and their ranges, a fuzz over
JSON trees with hostile keys and numbers (no body gets a 5xx from the router in front of the emulator), mid-stream
client disconnects counted, and the request head's own size limit (a real `bpdkv router` process and raw sockets)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bpdkv.lab.ports import free_port
from bpdkv.router.admin import error
from bpdkv.router.intake import BadRequest, shape_problem, strict_loads
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator
from tests.router.helpers import chat

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def fleet() -> Iterator[Any]:
    from tests.router.conftest import make_fleet, stop_fleet

    made = make_fleet()
    yield made
    stop_fleet(made)


def post(url: str, route: str, raw: bytes) -> httpx.Response:
    return httpx.post(url + route, content=raw, headers=JSON, timeout=30)


def served_afterwards(url: str) -> None:
    """Health and a normal request are correct after whatever came before."""
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    text, data = chat(url, [{"role": "user", "content": "a normal question after hostile ones"}])
    assert text and data["choices"][0]["message"]["role"] == "assistant"


# ---- the corpus, one by one ------------------------------------------------------------------------------
def test_error_answer_never_fails_to_encode() -> None:
    answer = error(400, "messages[0].meta.k\ud83d: invalid")
    assert json.loads(answer.body) == {"error": {"message": "messages[0].meta.k\\ud83d: invalid", "type": "router_error", "code": 400}}


@pytest.mark.parametrize(
    ("raw", "reason", "words"),
    [
        (b'{"messages":[{"role":"user","content":"x","meta":{"k\\ud83d":1}}]}', "invalid_unicode", "messages[0].meta.k\\ud83d (a key)"),
        (b'{"a":{"b":[{"c":{"\\udfff":"v"}}]}}', "invalid_unicode", "a.b[0].c.\\udfff (a key)"),
        (b'{"\\ud800":1}', "invalid_unicode", "\\ud800 (a key)"),
        (b'{"a":[[["ok","\\udc00"]]]}', "invalid_unicode", "a[0][0][1]"),
        (b'{"a":{"b":' + b"9" * 41 + b"}}", "out_of_range", "a.b: an integer of 41 digits"),
        (b'{"a":[-' + b"1" * 5000 + b"]}", "out_of_range", "a[0]: an integer of 5000 digits"),
        (b'{"' + b"k" * 5000 + b'\\ud83d":1}', "invalid_unicode", "(5001 characters) (a key)"),
    ],
)
def test_bad_strings_keys_and_integers_anywhere_are_named_by_path(raw: bytes, reason: str, words: str) -> None:
    with pytest.raises(BadRequest) as caught:
        strict_loads(raw, 64)
    bad = caught.value
    assert (bad.status, bad.reason) == (400, reason) and words in bad.message, bad.message
    assert bad.message.isascii() and len(bad.message) < 300


def test_integers_are_read_exactly() -> None:
    # orjson alone reads these as floats (-9.223372036854776e+18): the body is read again with every digit kept.
    assert strict_loads(b'{"seed": -9223372036854775809}', 64) == {"seed": -9223372036854775809}
    assert strict_loads(b'{"a": [18446744073709551616, 1.5, -0]}', 64) == {"a": [18446744073709551616, 1.5, 0]}
    assert strict_loads(b'{"a": "12345678901234567890 in a string"}', 64) == {"a": "12345678901234567890 in a string"}
    assert strict_loads(b'{"seed": 9223372036854775807}', 64) == {"seed": 9223372036854775807}


@pytest.mark.parametrize(
    ("route", "body", "words"),
    [
        (CHAT, {"seed": -9223372036854775809}, "'seed' is out of range"),
        (CHAT, {"max_completion_tokens": 1 << 63}, "'max_completion_tokens' is out of range"),
        (CHAT, {"top_k": -(1 << 64)}, "'top_k' is out of range"),
        (CHAT, {"top_logprobs": 1e19}, "'top_logprobs' is out of range"),
        (CHAT, {"priority": -1e300}, "'priority' is out of range"),
        (CHAT, {"min_tokens": 10**30}, "'min_tokens' is out of range"),
        (CHAT, {"truncate_prompt_tokens": 1 << 63}, "'truncate_prompt_tokens' is out of range"),
        (CHAT, {"stop_token_ids": [1, 1 << 63]}, "'stop_token_ids' token ids"),
        (CHAT, {"allowed_token_ids": [-1]}, "'allowed_token_ids' token ids"),
        (COMPLETIONS, {"prompt": [1, 18446744073709551616]}, "'prompt' token ids"),
        (COMPLETIONS, {"prompt": "x", "logprobs": 1 << 70}, "'logprobs' is out of range"),
    ],
)
def test_integer_fields_vllm_reads_are_range_checked(route: str, body: dict[str, Any], words: str) -> None:
    if route == CHAT:
        body = {"messages": [{"role": "user", "content": "x"}], **body}
    assert words in str(shape_problem(route, body))


def test_integers_at_the_edges_of_their_range_pass() -> None:
    edges = {"seed": -(1 << 63), "priority": (1 << 63) - 1, "top_logprobs": 5.0, "stop_token_ids": [0, (1 << 63) - 1]}
    assert shape_problem(CHAT, {"messages": [{"role": "user", "content": "x"}], **edges}) is None


def test_corpus_over_http_gets_400_with_the_path_and_reaches_no_upstream(fleet: Any) -> None:
    before_p, before_d = len(fleet.prefill[0].requests), len(fleet.decode[0].requests)
    cases = [
        (CHAT, b'{"messages":[{"role":"user","content":"x","meta":{"k\\ud83d":1}}]}', "messages[0].meta.k\\ud83d"),
        (CHAT, b'{"messages":[{"role":"user","content":"x"}],"seed":-9223372036854775809}', "'seed' is out of range"),
        (CHAT, b'{"messages":[{"role":"user","content":"x"}],"top_k":99999999999999999999}', "'top_k' is out of range"),
        (CHAT, b'{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":1e19}', "'top_logprobs'"),
        (CHAT, b'{"messages":[{"role":"user","content":"x"}],"stop_token_ids":[2,-9223372036854775809]}', "'stop_token_ids'"),
        (COMPLETIONS, b'{"prompt":[1,2,-9223372036854775809]}', "'prompt' token ids"),
        (COMPLETIONS, b'{"prompt":"x","extra":{"deep":[' + b"7" * 60 + b"]}}", "extra.deep[0]: an integer of 60 digits"),
    ]
    for route, raw, words in cases:
        resp = post(fleet.url, route, raw)
        assert resp.status_code == 400, (raw, resp.status_code, resp.text)
        assert words in resp.json()["error"]["message"], (raw, resp.text)
    assert len(fleet.prefill[0].requests) == before_p and len(fleet.decode[0].requests) == before_d
    served_afterwards(fleet.url)


def test_in_range_integers_reach_vllm_exactly_as_sent(fleet: Any) -> None:
    raw = (
        b'{"messages":[{"role":"user","content":"exact","meta":{"big":123456789012345678901234567}}],'
        b'"seed":-9223372036854775808,"priority":9223372036854775807,"max_tokens":4}'
    )
    resp = post(fleet.url, CHAT, raw)
    assert resp.status_code == 200, resp.text
    sent = fleet.decode[0].requests[-1]
    assert sent["seed"] == -9223372036854775808 and type(sent["seed"]) is int
    assert sent["priority"] == 9223372036854775807
    assert sent["messages"][0]["meta"]["big"] == 123456789012345678901234567


# ---- fuzz: JSON trees with hostile keys and numbers, deep nesting ----------------------------------------------------
HOSTILE_KEYS = st.sampled_from(
    [
        "k",
        "",
        "k\\ud83d",
        "\\udfff",
        "\\ud800\\ud800",
        "\\ud83d\\ude00",
        "\\u0000",
        "a\\u0000b",
        "\\n\\t",
        "\u00e9\u4e2d",
        "x" * 70_000,
        "\\ud83d" + "y" * 5000,
        "seed",
        "n",
        "max_tokens",
        "top_k",
        "stream",
        "session_id",
        "kv_transfer_params",
    ]
)
NUMBERS = st.one_of(
    st.sampled_from(
        [
            "0",
            "-0",
            "-0.0",
            "0.5",
            "1e400",
            "-1e400",
            "1e-400",
            "1e309",
            "4.9e-324",
            "NaN",
            "-NaN",
            "Infinity",
            "-Infinity",
            "nan",
            "inf",
            "+1",
            "01",
            ".5",
            "1.",
            "0x10",
            "1_000",
            "9223372036854775807",
            "9223372036854775808",
            "-9223372036854775808",
            "-9223372036854775809",
            "18446744073709551615",
            "18446744073709551616",
            "9" * 41,
            "-" + "9" * 5000,
            "1" + "0" * 400,
            "123456789012345678901234567890.5",
        ]
    ),
    st.integers(-(1 << 70), 1 << 70).map(str),
)
STRINGS = st.one_of(
    st.sampled_from(['"ok"', '"\\ud800"', '"a\\udfffb"', '"\\ud83d\\ude00"', '"\\u0000"', '""', '"' + "s" * 100_000 + '"']),
    st.text(max_size=12).map(json.dumps),
)
LEAVES = st.one_of(NUMBERS, STRINGS, st.sampled_from(["true", "false", "null"]))
KEYS = st.one_of(HOSTILE_KEYS.map(lambda k: f'"{k}"'), st.text(max_size=8).map(json.dumps))


def _array(items: list[str]) -> str:
    return "[" + ",".join(items) + "]"


def _object(pairs: list[tuple[str, str]]) -> str:
    return "{" + ",".join(f"{k}:{v}" for k, v in pairs) + "}"


TREES = st.recursive(
    LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=4).map(_array), st.lists(st.tuples(KEYS, inner), max_size=4).map(_object)),
    max_leaves=12,
)
DEEP = st.sampled_from([30, 62, 63, 64, 65, 200, 1000, 1100, 100_000]).map(lambda d: "[" * d + "]" * d)
INT_FIELD = st.sampled_from(
    ["seed", "n", "max_tokens", "max_completion_tokens", "top_k", "logprobs", "top_logprobs", "priority", "min_tokens"]
)


@st.composite
def hostile_body(draw: Any) -> tuple[str, bytes]:
    tree = draw(st.one_of(TREES, DEEP))
    if draw(st.booleans()):
        content = draw(st.one_of(st.just('"hi"'), STRINGS))
        message = (
            f'{{"role":"user","content":{content},"meta":{tree}}}' if draw(st.booleans()) else f'{{"role":"user","content":{content}}}'
        )
        fields = [f'"messages":[{message}]']
        route = CHAT
    else:
        tokens = draw(
            st.one_of(st.just('"hi"'), st.lists(st.one_of(st.integers(0, 255).map(str), NUMBERS), min_size=1, max_size=4).map(_array))
        )
        fields = [f'"prompt":{tokens}']
        route = COMPLETIONS
    fields.append('"max_tokens":4')
    for key in draw(st.lists(INT_FIELD, max_size=3, unique=True)):
        fields.append(f'"{key}":{draw(NUMBERS)}')
    for key, value in draw(st.lists(st.tuples(KEYS, st.one_of(TREES, DEEP)), max_size=2)):
        fields.append(f"{key}:{value}")
    if draw(st.booleans()):
        fields.append(f'"stream":{draw(st.sampled_from(["true", "false"]))}')
    return route, ("{" + ",".join(fields) + "}").encode()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=hostile_body())
def test_fuzzed_json_trees_never_get_a_5xx(fleet: Any, case: tuple[str, bytes]) -> None:
    route, raw = case
    resp = post(fleet.url, route, raw)
    assert resp.status_code < 500, (raw[:300], resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        message = resp.json()["error"]["message"]
        assert message and len(message) < 1000, message[:300]


def test_after_the_fuzz_health_and_a_normal_request_are_correct(fleet: Any) -> None:
    served_afterwards(fleet.url)
    for route in (CHAT, COMPLETIONS):
        for status in ("500", "502", "503"):
            assert fleet.metric("bpdkv_router_requests_total", route=route, status=status) == 0


# ---- mid-stream disconnects are counted ------------------------------------------------------------------------------
def _hang_up_mid_stream(url: str, n: int) -> None:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"messages": [{"role": "user", "content": "long"}], "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
    request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
    socks = []
    for _ in range(n):
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(request)
        got = b""
        while b"data: " not in got:  # the head and D's first events: the stream is under way
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
        socks.append(sock)
    for sock in socks:
        sock.close()


def test_mid_stream_disconnects_are_counted(fleet_factory: Any) -> None:
    fleet = fleet_factory(d_settings={"token_interval": 0.05})
    _hang_up_mid_stream(fleet.url, 5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and fleet.metric("bpdkv_router_requests_total", route=CHAT, status="499") < 5:
        time.sleep(0.05)
    assert fleet.metric("bpdkv_router_requests_total", route=CHAT, status="499") == 5
    assert fleet.metric("bpdkv_router_client_disconnects_total") == 5
    assert fleet.metric("bpdkv_router_in_flight") == 0
    # a stream read to its end is no disconnect, nor is the connection's close after it
    text, _ = chat(fleet.url, [{"role": "user", "content": "to the end"}], stream=True)
    assert text
    assert fleet.metric("bpdkv_router_client_disconnects_total") == 5


def test_disconnect_before_the_first_byte_is_counted_once(fleet_factory: Any) -> None:
    fleet = fleet_factory(d_settings={"first_token_delay": 2.0})
    body = {"messages": [{"role": "user", "content": "slow start"}], "max_tokens": 5, "stream": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fleet.url + CHAT, json=body, timeout=0.5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and fleet.metric("bpdkv_router_requests_total", route=CHAT, status="499") < 1:
        time.sleep(0.05)
    assert fleet.metric("bpdkv_router_client_disconnects_total") == 1


# ---- the request head's size limit: a real router process ------------------------------------------------------------
HEAD_LIMIT = 64 * 1024  # the default (contracts.ROUTER_DEFAULTS["max_header_bytes"])


@pytest.fixture(scope="module")
def router_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    p = VllmEmulator(EmulatorSettings(role="prefill"))
    d = VllmEmulator(EmulatorSettings(role="decode"))
    group = ServerGroup([p.app, d.app])
    urls = group.start()
    tmp = tmp_path_factory.mktemp("heads")
    port = free_port()
    config = {
        "listen": "127.0.0.1",
        "port": port,
        "prefill": [{"name": "prefill-0", "url": urls[0]}],
        "decode": [{"name": "decode-0", "url": urls[1]}],
    }
    path = tmp / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp / "router.log"
    with log.open("wb") as out:
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
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.1)
        yield url, proc.pid
        assert "Traceback" not in log.read_text()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        group.stop()


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _send_head(url: str, head: bytes, piece: int = 1 << 20) -> bytes:
    """Send a request head (in pieces), then read until the router closes; what came back."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        try:
            for i in range(0, len(head), piece):
                sock.sendall(head[i : i + piece])
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the client finished sending: what came back says why
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
        return got


def _head(header_bytes: int, path: bytes = b"/health") -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-big: " + b"a" * header_bytes + b"\r\n\r\n"


def test_a_head_under_the_limit_is_served(router_process: tuple[str, int]) -> None:
    got = _send_head(router_process[0], _head(HEAD_LIMIT - 1024))
    assert got.startswith(b"HTTP/1.1 200"), got[:200]


@pytest.mark.parametrize("size", [HEAD_LIMIT + 1024, 300 * 1024, 16 * 1024 * 1024])
def test_a_head_over_the_limit_gets_431_and_the_connection_closes(router_process: tuple[str, int], size: int) -> None:
    url, pid = router_process
    peak = _peak_rss_kib(pid)
    got = _send_head(url, _head(size))
    assert got.startswith(b"HTTP/1.1 431 Request Header Fields Too Large"), got[:200]
    assert b"connection: close" in got and b"over the router's limit of 65536 bytes" in got
    # Not buffered: the router's peak memory did not grow by the header (+15 MB for 16 MB before the limit).
    assert _peak_rss_kib(pid) - peak < 4 * 1024, (peak, _peak_rss_kib(pid))
    served_afterwards(url)


def test_many_headers_over_the_limit_and_a_trickled_head_get_431(router_process: tuple[str, int]) -> None:
    url, _ = router_process
    many = b"GET /health HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 100) for i in range(1000)) + b"\r\n"
    assert _send_head(url, many).startswith(b"HTTP/1.1 431"), "1000 headers of 100 bytes"
    assert _send_head(url, _head(200 * 1024), piece=4096).startswith(b"HTTP/1.1 431"), "trickled in 4 KiB pieces"
    served_afterwards(url)
