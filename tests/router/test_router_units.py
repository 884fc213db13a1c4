"""Pure pieces of the router: identity digests, SSE relay, selection, stores, input checks, config loading."""

from __future__ import annotations

import asyncio
import gc
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bpdkv.render import render_topology
from bpdkv.router.app import DisconnectWatch
from bpdkv.router.config import RouterConfigError, config_from_dict, load_config
from bpdkv.router.intake import json_depth_exceeds, sanitize, shape_problem
from bpdkv.router.relay import RelayOutcome, Reply, SseRelay, strip_params
from bpdkv.router.sessions import MemoryStore, SessionEntry, Verdict, chat_chain, scope_digest, token_chain
from bpdkv.router.turn import prefill_body
from bpdkv.router.upstreams import Pool, Upstream
from bpdkv.topology.validate import load_topology
from tests.conftest import ROOT


def test_chat_chain_prefix_property() -> None:
    scope = scope_digest("t", "/v1/chat/completions", {"model": "m"})
    turn1 = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}]
    reply = {"role": "assistant", "content": "a1"}
    turn2 = turn1 + [{"role": "assistant", "content": "a1", "reasoning_content": "hmm"}, {"role": "user", "content": "u2"}]
    assert chat_chain(scope, turn1 + [reply])[-1] == chat_chain(scope, turn2)[2]  # reasoning is not identity
    # Exact on what the model sees: a whitespace-only change is another prompt.
    spaced = [{"role": "system", "content": "s "}, {"role": "user", "content": "u1"}]
    assert chat_chain(scope, spaced)[-1] != chat_chain(scope, turn1)[-1]
    parts = [{"role": "system", "content": [{"type": "text", "text": "s"}]}, {"role": "user", "content": "u1"}]
    assert chat_chain(scope, parts)[-1] != chat_chain(scope, turn1)[-1]
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
    req = prefill_body({"model": "m", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 99}, None)
    assert req["max_tokens"] == 1 and req["stream"] is False and "stream_options" not in req
    assert req["kv_transfer_params"]["do_remote_decode"] is True


def _sse(obj: dict) -> bytes:  # type: ignore[type-arg]
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class FakeUpstream:
    """D's open stream as the relay drives it: the first bytes, then the rest fed one piece per loop turn."""

    def __init__(self, pieces: list[bytes], closed: list[bool]) -> None:
        self.first = pieces[0]
        self.rest = pieces[1:]
        self.content_type = "text/event-stream"
        self.closed = closed

    def attach(self, sink, on_end) -> None:  # type: ignore[no-untyped-def]
        import asyncio

        loop = asyncio.get_running_loop()

        def feed() -> None:
            if self.rest:
                sink(self.rest.pop(0))
                loop.call_soon(feed)
            else:
                on_end(None)

        loop.call_soon(feed)

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def close(self, reusable: bool) -> None:
        self.closed.append(reusable)


def _relay(raw: bytes, cuts: list[int], send_fails: bool = False) -> tuple[bytes, list[RelayOutcome], list[bool]]:
    """The relay under a plain ASGI server (the path every server but uvicorn's httptools one takes)."""
    import asyncio

    pieces, pos = [], 0
    for cut in cuts:
        pieces.append(raw[pos : pos + cut])
        pos += cut
    pieces.append(raw[pos:])
    pieces = [p for p in pieces if p] or [b""]
    sent: list[bytes] = []
    outcomes: list[RelayOutcome] = []
    closed: list[bool] = []

    async def send(message):  # type: ignore[no-untyped-def]
        if send_fails:
            raise OSError("client gone")
        sent.append(message.get("body", b""))

    async def on_close(outcome: RelayOutcome) -> None:
        outcomes.append(outcome)

    async def scenario() -> None:
        relay = SseRelay(FakeUpstream(pieces, closed), on_close, lambda: None, True)
        try:
            await relay.send_to(send)
        finally:
            await relay.close(False)

    asyncio.run(scenario())
    return b"".join(sent), outcomes, closed


@settings(deadline=None)  # an event loop per example: timing follows the machine's load
@given(st.lists(st.integers(1, 40), min_size=1, max_size=30))
def test_relay_any_chunking(cuts: list[int]) -> None:
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
    out, outcomes, closed = _relay(b"".join(events), cuts)
    assert len(outcomes) == 1 and closed == [True]  # closed once, connection kept
    outcome = outcomes[0]
    assert outcome.completed and outcome.params == {"remote_block_ids": [1]}
    reply = Reply.of(outcome.kept)
    assert reply.finish_reason == "stop" and reply.text == "w0 w1 w2 w3 w4 end"
    assert b"kv_transfer_params" not in out and out.endswith(b"data: [DONE]\n\n")


def test_params_only_chunk_is_dropped() -> None:
    out, params = strip_params(_sse({"id": "1", "object": "x", "created": 1, "model": "m", "choices": [], "kv_transfer_params": {"a": 1}}))
    assert out == b"" and params == {"a": 1}


def test_streamed_parallel_tool_calls_rebuild_the_message() -> None:
    def delta(d: dict, finish: str | None = None) -> bytes:  # type: ignore[type-arg]
        return _sse({"id": "1", "choices": [{"index": 0, "delta": d, "finish_reason": finish}]})

    raw = b"".join(
        [
            delta({"role": "assistant", "content": None}),
            delta({"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}),
            delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
            delta({"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}),
            delta({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, "tool_calls"),
        ]
    )
    reply = Reply.of(raw)
    assert reply.finish_reason == "tool_calls"
    assert reply.message() == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    }


def test_stream_abandoned_before_first_byte_releases_upstream_once() -> None:
    out, outcomes, closed = _relay(_sse({"choices": []}) + b"data: [DONE]\n\n", [3], send_fails=True)
    assert out == b"" and closed == [False]  # D's connection dropped, exactly once
    assert len(outcomes) == 1 and not outcomes[0].completed


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


def test_memory_store_leaves_entries_of_other_histories() -> None:
    import asyncio

    store = MemoryStore(clock=lambda: 0.0)
    entry = SessionEntry({"p": 1}, expires_at=100, history="mine")

    async def scenario() -> None:
        assert await store.put("x:1", entry, 100, only_if_absent=True)
        got, verdicts = await store.take(["x:1"], lambda e: Verdict.LEAVE)
        assert got is None and verdicts == [Verdict.LEAVE]
        assert not await store.put("x:1", SessionEntry({}, expires_at=100, history="theirs"), 100, only_if_absent=True)
        got, _ = await store.take(["x:1"], lambda e: Verdict.TAKE)
        assert got is entry
        got, _ = await store.take(["x:1"], lambda e: Verdict.TAKE)
        assert got is None  # single use

    asyncio.run(scenario())


def test_input_shape_and_depth_checks() -> None:
    chat = "/v1/chat/completions"
    assert shape_problem(chat, {"messages": [{"role": "user", "content": "hi"}]}) is None
    assert "messages" in str(shape_problem(chat, {"messages": []}))
    assert "role" in str(shape_problem(chat, {"messages": [{"content": "hi"}]}))
    assert "stream" in str(shape_problem(chat, {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}))
    assert shape_problem("/v1/completions", {"prompt": [1, 2, 3]}) is None
    assert "prompt" in str(shape_problem("/v1/completions", {"prompt": [1, "a"]}))
    deep: object = 1
    for _ in range(200):
        deep = [deep]
    assert json_depth_exceeds({"a": deep}, 64) and not json_depth_exceeds({"a": [[1]]}, 64)


@given(st.lists(st.text(max_size=12), min_size=1, max_size=8), st.booleans(), st.booleans())
def test_reply_fast_path_equals_full_parse(pieces: list[str], ascii_only: bool, chat: bool) -> None:
    raw = b""
    for i, piece in enumerate(pieces):
        finish = ("length" if ascii_only else "stop") if i == len(pieces) - 1 else None
        choice = (
            {"index": 0, "delta": {"content": piece}, "finish_reason": finish}
            if chat
            else {"index": 0, "text": piece, "finish_reason": finish}
        )
        raw += b"data: " + json.dumps({"id": "1", "choices": [choice]}, ensure_ascii=ascii_only).encode() + b"\n\n"
    raw += b"data: [DONE]\n\n"
    fast = Reply.of(raw)
    full = Reply.of(raw.decode().split("\n"))
    assert fast.text == full.text == "".join(pieces)
    assert fast.finish_reason == full.finish_reason == ("length" if ascii_only else "stop")


def test_disconnect_watch_leaves_no_reference_cycle() -> None:
    """A stopped watcher is freed by reference counting alone: a cycle per request (the cancelled task's traceback
    holding the watch, the watch holding the task) left each request's frames and uvicorn cycle to the cyclic GC,
    whose pauses made the TTFT tail."""

    async def scenario() -> None:
        never = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await never.wait()
            return {"type": "http.disconnect"}

        for _ in range(5):
            watch = DisconnectWatch(receive, SimpleNamespace(done=False))  # type: ignore[arg-type]
            watch.start()
            await asyncio.sleep(0)
            watch.stop()
            await asyncio.sleep(0)
        del watch
        await asyncio.sleep(0)

    gc.collect()
    gc.disable()
    try:
        asyncio.run(scenario())
        left = sum(1 for o in gc.get_objects() if type(o) is DisconnectWatch)
    finally:
        gc.enable()
    assert left == 0
