"""Pure pieces of the router: identity digests, SSE capture, selection, config loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bpdkv.render import render_topology
from bpdkv.router.config import RouterConfigError, config_from_dict, load_config
from bpdkv.router.protocol import StreamCapture, p_request, sanitize
from bpdkv.router.sessions import chat_chain, scope_digest, token_chain
from bpdkv.router.upstreams import Pool, Upstream
from bpdkv.topology.loader import load_topology
from tests.conftest import ROOT


def test_chat_chain_prefix_property() -> None:
    scope = scope_digest("t", "/v1/chat/completions", {"model": "m"})
    turn1 = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}]
    reply = {"role": "assistant", "content": "a1 "}
    turn2 = turn1 + [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    assert chat_chain(scope, turn1 + [reply])[-1] == chat_chain(scope, turn2)[2]  # whitespace-insensitive
    other_tenant = scope_digest("u", "/v1/chat/completions", {"model": "m"})
    assert chat_chain(other_tenant, turn2)[2] != chat_chain(scope, turn2)[2]
    with_tools = scope_digest("t", "/v1/chat/completions", {"model": "m", "tools": [{"type": "function"}]})
    assert with_tools != scope


def test_token_chain_blocks() -> None:
    scope = b"s"
    a = token_chain(scope, list(range(130)))
    b = token_chain(scope, list(range(200)))
    assert [n for n, _ in a] == [64, 128]
    assert a == b[:2]


def test_sanitize_strips_params_and_session_fields() -> None:
    body, sid = sanitize({"kv_transfer_params": {"remote_host": "x"}, "session_id": "s1", "conversation_id": "c", "model": "m"})
    assert body == {"model": "m"} and sid == "s1"
    req = p_request({"model": "m", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 99}, None)
    assert req["max_tokens"] == 1 and req["stream"] is False and "stream_options" not in req
    assert req["kv_transfer_params"]["do_remote_decode"] is True


def _sse(obj: dict) -> bytes:  # type: ignore[type-arg]
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@given(st.lists(st.integers(1, 40), min_size=1, max_size=30))
def test_stream_capture_any_chunking(cuts: list[int]) -> None:
    events = [_sse({"id": "1", "choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]}) for i in range(5)]
    events.append(
        _sse(
            {
                "id": "1",
                "choices": [{"index": 0, "delta": {"content": "end"}, "finish_reason": "stop"}],
                "kv_transfer_params": {"remote_block_ids": [1]},
            }
        )
    )
    events.append(b"data: [DONE]\n\n")
    raw = b"".join(events)
    capture = StreamCapture()
    out = b""
    pos = 0
    for cut in cuts:
        out += capture.feed(raw[pos : pos + cut], chat=True)
        pos += cut
    out += capture.feed(raw[pos:], chat=True) + capture.flush()
    assert capture.params == {"remote_block_ids": [1]}
    assert capture.finish_reason == "stop"
    assert "".join(capture.text) == "w0 w1 w2 w3 w4 end"
    assert b"kv_transfer_params" not in out and out.endswith(b"data: [DONE]\n\n")


def test_params_only_chunk_is_dropped() -> None:
    capture = StreamCapture()
    out = capture.feed(
        _sse({"id": "1", "object": "x", "created": 1, "model": "m", "choices": [], "kv_transfer_params": {"a": 1}}), chat=True
    )
    assert out == b"" and capture.params == {"a": 1}


def test_selection_least_outstanding_with_affinity() -> None:
    pool = Pool("prefill", [Upstream(f"p{i}", f"http://p{i}", "prefill") for i in range(4)])
    key = b"conversation-1"
    chosen = pool.pick(key)
    assert chosen is not None and all(pool.pick(key) is chosen for _ in range(5))  # sticky
    chosen.outstanding = 10
    assert pool.pick(key) is not chosen  # load wins over affinity
    chosen.outstanding = 0
    for _ in range(3):
        pool.failure(chosen, "boom")
    assert pool.pick(key) is not chosen  # ejected
    assert pool.pick(None, exclude={"p0", "p1", "p2"}) is not None


def test_rendered_router_config_loads(tmp_path: Path) -> None:
    t = load_topology(ROOT / "examples" / "p5en-qwen3-32b.yaml").topology
    art = next(a for a in render_topology(t) if a.path.endswith(".router.yaml"))
    path = tmp_path / "router.yaml"
    path.write_text(art.content)
    config = load_config(path)
    assert len(config.prefill) == 4 and config.decode[0].url == "http://10.0.1.12:8200"
    assert config.session_ttl == 470 and config.reuse is True


def test_bad_router_config_is_one_clear_error() -> None:
    with pytest.raises(RouterConfigError, match="prefill"):
        config_from_dict({"listen": "x", "port": 1, "decode": [{"url": "http://d"}]})


@given(st.lists(st.text(max_size=12), min_size=1, max_size=8), st.booleans())
def test_stream_capture_fast_path_equals_full_parse(pieces: list[str], ascii_only: bool) -> None:
    capture = StreamCapture()
    raw = b""
    for piece in pieces:
        event = {"id": "1", "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
        raw += b"data: " + json.dumps(event, ensure_ascii=ascii_only).encode() + b"\n\n"
    out = capture.feed(raw, chat=True)
    assert out == raw  # passed through untouched
    assert "".join(capture.text) == "".join(pieces)


def test_memory_store_purges_abandoned_entries() -> None:
    import asyncio

    from bpdkv.router.sessions import MemoryStore, SessionEntry

    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])

    async def scenario() -> int:
        for i in range(1000):
            now[0] = float(i)
            await store.put(f"k{i}", SessionEntry({}, expires_at=now[0] + 10, history=""), 10)
        return await store.count()

    assert asyncio.run(scenario()) <= 11


def test_stream_abandoned_before_first_byte_releases_upstream() -> None:
    import asyncio

    from bpdkv.router.app import SseStream

    released: list[str] = []

    async def body():  # type: ignore[no-untyped-def]
        try:
            yield b"data: x\n\n"
        finally:
            released.append("relay")

    async def send(message):  # type: ignore[no-untyped-def]
        raise OSError("client gone")

    async def receive():  # type: ignore[no-untyped-def]
        await asyncio.sleep(3600)

    async def scenario() -> None:
        stream = SseStream(body(), "text/event-stream", abandon=lambda: released.append("abandon"))
        try:
            await stream.send_to(send, receive)
        except OSError:
            pass

    asyncio.run(scenario())
    assert released == ["abandon"]  # exactly one release, by the abandon path
