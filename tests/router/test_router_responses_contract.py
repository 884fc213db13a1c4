"""The emulator's /v1/responses held to real vLLM: every `responses_*` fixture in tests/data/vllm_contract/agent_apis
is replayed against the emulator, which must answer with the same status, the keys a client reads, the same output
item types (two function calls where vLLM made two, with the same names and arguments), the same status, and the same
grammar of stream events. `lax_*`: a function_call_output naming no call, which vLLM answers and the router refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.router.test_router_messages_contract import emulator, fixtures, keys_read, load, replay

__all__ = ["emulator"]  # the module fixture, shared


def grammar(events: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    for event in events:
        if not out or out[-1] != event["type"]:
            out.append(event["type"])
    return out


def calls(output: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(i["name"], json.loads(i["arguments"])) for i in output if i["type"] == "function_call"]


def status_kind(status: str) -> str:
    return "generated" if status in ("completed", "incomplete") else status


@pytest.mark.parametrize("name", fixtures("responses_"))
def test_emulator_answers_responses_as_vllm(emulator: str, name: str) -> None:
    fixture = load(name)
    status, body, events = replay(emulator, fixture)
    if name.startswith("responses_lax_"):
        assert fixture["status"] == 200 and status == 400, (fixture["status"], status)
        return
    assert status == fixture["status"], (status, body)
    if status != 200:
        assert set(body) == set(fixture["body"]) == {"error"} and body["error"]["message"]
        return
    if fixture["events"] is None:
        assert body is not None
        assert keys_read(fixture["body"]) <= keys_read(body), keys_read(fixture["body"]) - keys_read(body)
        assert [i["type"] for i in body["output"]] == [i["type"] for i in fixture["body"]["output"]]
        assert calls(body["output"]) == calls(fixture["body"]["output"])
        assert status_kind(body["status"]) == status_kind(fixture["body"]["status"])
        return
    assert events is not None
    recorded = fixture["events"]
    assert grammar(events) == grammar(recorded)
    for got, want in zip(events, recorded, strict=False):
        if got["type"] == want["type"] and got["type"] != "response.completed":
            assert keys_read(want) <= keys_read(got), (got["type"], keys_read(want) - keys_read(got))
    assert calls(events[-1]["response"]["output"]) == calls(recorded[-1]["response"]["output"])
