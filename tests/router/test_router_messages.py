"""Anthropic Messages (`/v1/messages`) through the router, with the real `anthropic` SDK as the client, against
emulated P and D (test doubles) and a single emulated server answering the same API as the reference: multi-turn tool
use (two parallel calls, results as blocks), streamed and not, reuse from turn 2, identities apart from chat's,
Anthropic's error shape for every refusal."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from bpdkv.router.messages import to_chat
from bpdkv.router.surface import SurfaceError
from bpdkv.testing.record_vllm import hermes_call_text, literal_regex
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator
from tests.router.conftest import Fleet, make_fleet, stop_fleet

SYSTEM = "You answer questions about the model cache, and you may call tools. " * 3
TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    {
        "name": "get_time",
        "description": "Current time in a time zone",
        "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
]
TWO_CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Fleet, str]]:
    f = make_fleet()
    reference = VllmEmulator(EmulatorSettings(role="both"))
    group = ServerGroup([reference.app])
    [ref_url] = group.start()
    try:
        yield f, ref_url
    finally:
        group.stop()
        stop_fleet(f)


def client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="test-key", max_retries=0, timeout=30)


def forced(calls: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The emulated model writes exactly these Hermes tool calls (vLLM's structured outputs, forwarded to chat)."""
    return {"structured_outputs": {"regex": literal_regex(hermes_call_text(calls))}}


def ask(c: anthropic.Anthropic, messages: list[dict[str, Any]], stream: bool, **extra: Any) -> dict[str, Any]:
    """One turn; the answer as a dict (a stream's final message, assembled by the SDK from its events)."""
    kwargs: dict[str, Any] = {"model": "emulated", "max_tokens": 60, "system": SYSTEM, "messages": messages, "tools": TOOLS}
    extra_body = extra.pop("extra_body", None)
    kwargs.update(extra)
    if stream:
        with c.messages.stream(**kwargs, extra_body=extra_body) as s:
            kinds = [event.type for event in s]
            message = s.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        assert kinds[-2] == "message_delta" and kinds.count("message_delta") == 1, kinds
        return message.model_dump()
    return c.messages.create(**kwargs, extra_body=extra_body).model_dump()


def comparable(message: dict[str, Any]) -> list[Any]:
    """What the model answered (ids and usage aside)."""
    out: list[Any] = [message["stop_reason"]]
    for block in message["content"]:
        if block["type"] == "tool_use":
            out.append(("tool_use", block["name"], block["input"]))
        elif block["type"] == "text":
            out.append(("text", block["text"]))
    return out


def conversation(url: str, stream: bool, tag: str = "") -> list[dict[str, Any]]:
    """Four turns: a question, two parallel tool calls, their results as blocks (text and an array of text blocks),
    a follow-up."""
    c = client(url)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"What is the weather in Paris and the time in CET?{tag}"}]
    answers = []
    first = ask(c, messages, stream)
    answers.append(first)
    messages.append({"role": "assistant", "content": [b for b in first["content"] if b["type"] != "thinking"]})
    messages.append({"role": "user", "content": [{"type": "text", "text": "Please call the tools now."}]})
    calls = ask(c, messages, stream, max_tokens=200, extra_body=forced(TWO_CALLS))
    answers.append(calls)
    uses = [b for b in calls["content"] if b["type"] == "tool_use"]
    assert [u["name"] for u in uses] == ["get_weather", "get_time"]
    assert calls["stop_reason"] == "tool_use"
    messages.append({"role": "assistant", "content": calls["content"]})
    messages.append(
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": uses[0]["id"], "content": "sunny, 21 degrees"},
                {"type": "tool_result", "tool_use_id": uses[1]["id"], "content": [{"type": "text", "text": "14:05"}]},
            ],
        }
    )
    after = ask(c, messages, stream)
    answers.append(after)
    messages.append({"role": "assistant", "content": after["content"]})
    messages.append({"role": "user", "content": "Thanks. And tomorrow?"})
    answers.append(ask(c, messages, stream))
    return answers


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_conversation_equals_single_server_and_reuses(fleet: tuple[Fleet, str], stream: bool) -> None:
    f, ref_url = fleet
    turns_before = f.metric("bpdkv_router_api_turns_total", api="messages", path="prefill_pull", reuse="hit")
    pulled_before = sum(d.counters.get("prompt_tokens:external_kv_transfer", 0) for d in f.prefill)
    through = conversation(f.url, stream, f" ({stream})")
    reference = conversation(ref_url, stream, f" ({stream})")
    assert [comparable(m) for m in through] == [comparable(m) for m in reference]
    # Turns 2-4 pulled the history from D: P read D's blocks instead of computing them.
    assert f.metric("bpdkv_router_api_turns_total", api="messages", path="prefill_pull", reuse="hit") - turns_before == 3
    assert sum(d.counters.get("prompt_tokens:external_kv_transfer", 0) for d in f.prefill) > pulled_before
    # P and D were sent Chat Completions, never the client's kv_transfer_params.
    assert all("messages" in r and r.get("model") == "emulated" for r in f.prefill[0].requests[-4:])


def test_stream_and_whole_answers_agree(fleet: tuple[Fleet, str]) -> None:
    f, _ = fleet
    c = client(f.url)
    messages = [{"role": "user", "content": "Tell me about blocks."}]
    whole = ask(c, messages, False)
    streamed = ask(c, messages, True)
    assert comparable(whole) == comparable(streamed)
    assert whole["type"] == "message" and whole["role"] == "assistant" and whole["id"].startswith("msg_")
    assert whole["usage"]["input_tokens"] > 0 and whole["usage"]["output_tokens"] > 0
    assert streamed["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_stream_event_sequence_is_anthropics(fleet: tuple[Fleet, str]) -> None:
    f, _ = fleet
    body = {
        "model": "emulated",
        "max_tokens": 200,
        "stream": True,
        "tools": TOOLS,
        "messages": [{"role": "user", "content": "weather?"}],
        **forced(TWO_CALLS),
    }
    with httpx.stream("POST", f.url + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}, timeout=30) as resp:
        assert resp.status_code == 200
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    datas = [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in events]
    assert all(d["type"] == n for n, d in zip(names, datas, strict=True))
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [d for d in datas if d["type"] == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["tool_use", "tool_use"]
    assert [s["index"] for s in starts] == [0, 1]
    for start in starts:  # each block: start, input_json_delta deltas, stop — in order, with its own index
        i = start["index"]
        own = [d for d in datas if d.get("index") == i]
        assert own[0]["type"] == "content_block_start" and own[-1]["type"] == "content_block_stop"
        args = "".join(d["delta"]["partial_json"] for d in own[1:-1])
        assert json.loads(args) == dict(TWO_CALLS)[start["content_block"]["name"]]
    assert datas[-2]["delta"]["stop_reason"] == "tool_use"
    assert "kv_transfer_params" not in raw


def test_identity_never_shared_with_chat(fleet: tuple[Fleet, str]) -> None:
    """The same conversation over chat and over /v1/messages: two identities (each API's turn stored apart)."""
    f, _ = fleet
    c = client(f.url)
    question = "Unique question about identities 7731."
    first = ask(c, [{"role": "user", "content": question}], False)
    text = "".join(b["text"] for b in first["content"] if b["type"] == "text")
    # A chat client continuing with that text: no entry of its own (its turn 1 was never a chat turn): a miss.
    misses = f.metric("bpdkv_router_api_turns_total", api="chat_completions", path="prefill_full", reuse="miss")
    chat = {
        "model": "emulated",
        "max_tokens": 10,
        "tools": [
            {"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
            for t in TOOLS
        ],
        "tool_choice": "auto",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
            {"role": "assistant", "content": text},
            {"role": "user", "content": "next"},
        ],
    }
    assert httpx.post(f.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
    assert f.metric("bpdkv_router_api_turns_total", api="chat_completions", path="prefill_full", reuse="miss") == misses + 1


def test_max_tokens_stop_reason(fleet: tuple[Fleet, str]) -> None:
    f, _ = fleet
    message = client(f.url).messages.create(model="emulated", max_tokens=3, messages=[{"role": "user", "content": "go on at length"}])
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 3


# ---- refusals: Anthropic's error shape, a 4xx, never a 5xx ------------------------------------------------------------
HOSTILE: list[tuple[str, dict[str, Any]]] = [
    ("no max_tokens", {"model": "emulated", "messages": [{"role": "user", "content": "x"}]}),
    ("no messages", {"model": "emulated", "max_tokens": 5}),
    ("empty messages", {"model": "emulated", "max_tokens": 5, "messages": []}),
    ("role tool", {"model": "emulated", "max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}),
    ("wrong block type", {"model": "emulated", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "x": 1}]}]}),
    (
        "tool_use in user",
        {
            "model": "emulated",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}],
        },
    ),
    ("block without type", {"model": "emulated", "max_tokens": 5, "messages": [{"role": "user", "content": [{"text": "x"}]}]}),
    (
        "tool_result without tool_use",
        {
            "model": "emulated",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "r"}]}],
        },
    ),
    (
        "tool_use without id",
        {
            "model": "emulated",
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]},
            ],
        },
    ),
    (
        "tool_use unanswered",
        {
            "model": "emulated",
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                {"role": "user", "content": "no result"},
            ],
        },
    ),
    (
        "tool_use id twice",
        {
            "model": "emulated",
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
                    ],
                },
            ],
        },
    ),
    (
        "input not an object",
        {
            "model": "emulated",
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": [1]}]},
            ],
        },
    ),
    ("stream a string", {"model": "emulated", "max_tokens": 5, "stream": "yes", "messages": [{"role": "user", "content": "x"}]}),
    ("max_tokens zero", {"model": "emulated", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}),
    ("max_tokens huge", {"model": "emulated", "max_tokens": 1 << 70, "messages": [{"role": "user", "content": "x"}]}),
    (
        "server tool",
        {
            "model": "emulated",
            "max_tokens": 5,
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            "messages": [{"role": "user", "content": "x"}],
        },
    ),
    (
        "tool without schema",
        {"model": "emulated", "max_tokens": 5, "tools": [{"name": "f"}], "messages": [{"role": "user", "content": "x"}]},
    ),
    (
        "tool_choice unknown tool",
        {
            "model": "emulated",
            "max_tokens": 5,
            "tools": TOOLS,
            "tool_choice": {"type": "tool", "name": "nope"},
            "messages": [{"role": "user", "content": "x"}],
        },
    ),
    ("system a number", {"model": "emulated", "max_tokens": 5, "system": 5, "messages": [{"role": "user", "content": "x"}]}),
    (
        "stop_sequences a string",
        {"model": "emulated", "max_tokens": 5, "stop_sequences": "end", "messages": [{"role": "user", "content": "x"}]},
    ),
    ("temperature a string", {"model": "emulated", "max_tokens": 5, "temperature": "hot", "messages": [{"role": "user", "content": "x"}]}),
    (
        "nested deep",
        {
            "model": "emulated",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": json.loads("[" * 80 + "]" * 80)}]}],
        },
    ),
    ("unknown model", {"model": "no-such-model", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
]


@pytest.mark.parametrize("name,body", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_bad_bodies_get_anthropic_4xx(fleet: tuple[Fleet, str], name: str, body: dict[str, Any]) -> None:
    f, _ = fleet
    resp = httpx.post(f.url + "/v1/messages", json=body, timeout=30)
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    data = resp.json()
    assert data["type"] == "error" and set(data) == {"type", "error"}
    assert data["error"]["type"] in ("invalid_request_error", "not_found_error") and data["error"]["message"]


def test_sdk_raises_its_own_errors(fleet: tuple[Fleet, str]) -> None:
    f, _ = fleet
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(f.url).messages.create(
            model="emulated",
            max_tokens=5,
            messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "r"}]}],
        )
    assert "tool_use" in caught.value.body["error"]["message"]  # type: ignore[index]


def test_not_json_and_too_large(fleet: tuple[Fleet, str]) -> None:
    f, _ = fleet
    resp = httpx.post(f.url + "/v1/messages", content=b"{not json", timeout=30)
    assert resp.status_code == 400 and resp.json()["type"] == "error"
    resp = httpx.post(f.url + "/v1/messages", content=b"[1, 2]", timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"


def test_conversion_is_vllms() -> None:
    """The chat request vLLM 0.32's /v1/messages makes (vllm/entrypoints/anthropic/serving.py), for a conversation
    with every block kind: system blocks concatenated, tool results before the user's text, arguments json.dumps."""
    chat = to_chat(
        {
            "model": "m",
            "max_tokens": 9,
            "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "stop_sequences": ["END"],
            "tools": TOOLS[:1],
            "tool_choice": {"type": "any"},
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "q"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "redacted_thinking", "data": "zz"},
                        {"type": "text", "text": "calling"},
                        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}],
                        },
                        {"type": "text", "text": "and?"},
                    ],
                },
            ],
        }
    )
    assert chat["messages"] == [
        {"role": "system", "content": "ab"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "reasoning": "hmm",
            "content": "calling",
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "x\ny"},
        {"role": "user", "content": "and?"},
    ]
    assert chat["stop"] == ["END"] and chat["tool_choice"] == "required" and chat["max_tokens"] == 9
    assert chat["tools"][0]["function"]["parameters"] == TOOLS[0]["input_schema"]
    with pytest.raises(SurfaceError):
        to_chat({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "ftp"}}]}]})


def test_count_tokens_through_the_router(fleet: tuple[Fleet, str]) -> None:
    f, ref_url = fleet
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    counted = client(f.url).messages.count_tokens(model="emulated", system=SYSTEM, messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    reference = client(ref_url).messages.count_tokens(model="emulated", system=SYSTEM, messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    assert counted.input_tokens == reference.input_tokens > 0
    bad = httpx.post(f.url + "/v1/messages/count_tokens", json={"model": "emulated", "messages": [{"role": "tool"}]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["type"] == "error"


def test_output_config_as_vllm_maps_it() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    chat = to_chat(
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "x"}],
            "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
        }
    )
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}
    assert chat["reasoning_effort"] == "low"
    with pytest.raises(SurfaceError):
        to_chat(
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "output_config": {"format": {"type": "json_schema"}},
            }
        )


def test_huge_and_deep_bodies_are_4xx_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """Over the body limit (413) and nested past the depth limit (400), on both surfaces: each API's error shape, one
    log line per refusal, no upstream asked."""
    f = make_fleet(router_changes={"max_body_bytes": 4096, "max_json_depth": 16})
    try:
        cases = [
            ("/v1/messages", {"model": "emulated", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 5000}]}, 413),
            (
                "/v1/messages",
                {"model": "emulated", "max_tokens": 5, "messages": [{"role": "user", "content": json.loads("[" * 20 + "]" * 20)}]},
                400,
            ),
            ("/v1/responses", {"model": "emulated", "input": "x" * 5000}, 413),
            ("/v1/responses", {"model": "emulated", "input": json.loads("[" * 20 + "]" * 20)}, 400),
        ]
        for route, body, status in cases:
            caplog.clear()
            with caplog.at_level("INFO", logger="bpdkv.router"):
                resp = httpx.post(f.url + route, json=body, timeout=30)
            assert resp.status_code == status, resp.text
            data = resp.json()
            assert data["error"]["message"] and (data.get("type") == "error") == (route == "/v1/messages")
            lines = [r for r in caplog.records if r.name == "bpdkv.router" and "refused" in r.getMessage()]
            assert len(lines) == 1 and route in lines[0].getMessage(), [r.getMessage() for r in caplog.records]
        assert not f.prefill[0].requests and not f.decode[0].requests
    finally:
        stop_fleet(f)


def test_render_of_thoughts_stop_strings_and_their_stream() -> None:
    """A chat answer with a thought, text and a matched stop string: a thinking block, a text block, stop_sequence —
    whole, and streamed (thinking_delta then a signature_delta before the block stops)."""
    import asyncio

    from bpdkv.router.messages import MessageStream, render_message

    answer = {
        "model": "m",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "stop_reason": "END",
                "message": {"role": "assistant", "content": "ok", "reasoning": "hmm"},
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3},
    }
    whole = render_message(answer, "m")
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"] and whole["content"][0]["thinking"] == "hmm"
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("stop_sequence", "END")
    assert whole["usage"] == {"input_tokens": 7, "output_tokens": 3}
    stream = MessageStream("m")
    chunks = [
        {"model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"reasoning": "hm"}}]},
        {"choices": [{"index": 0, "delta": {"reasoning": "m"}}]},
        {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop", "stop_reason": "END"}]},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}},
    ]
    raw = stream.feed(chunks) + asyncio.run(stream.finish())
    events = [json.loads(e.split(b"\n")[1][6:]) for e in raw.split(b"\n\n") if e]
    kinds = [e["type"] + (":" + e["delta"]["type"] if e["type"] == "content_block_delta" else "") for e in events]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta:thinking_delta",
        "content_block_delta:thinking_delta",
        "content_block_delta:signature_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta:text_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert events[-2]["usage"] == {"input_tokens": 7, "output_tokens": 3}
