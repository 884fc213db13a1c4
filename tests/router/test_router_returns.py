"""The return forecast reaches D with the turn (emulated P/D): on the P→D path and on decode_local, learnt from the
gaps after tool calls and after final answers; none when D holds nothing (reuse off for the request, the last turn)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from bpdkv import contracts
from bpdkv.router.config import PathSettings
from bpdkv.testing.vllm_emulator import hermes_block, literal_regex
from tests.router.helpers import SYSTEM

CHAT = "/v1/chat/completions"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def ask(url: str, messages: list[dict[str, Any]], call: bool, headers: dict[str, str] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "emulated", "messages": messages, "max_tokens": 200, "tools": TOOLS}
    if call:
        body["structured_outputs"] = {"regex": literal_regex(hermes_block("get_weather", "{}"))}
    resp = httpx.post(url + CHAT, json=body, headers=headers or {}, timeout=30)
    assert resp.status_code == 200, resp.text
    message: dict[str, Any] = resp.json()["choices"][0]["message"]
    return message


def forecasts(d: Any) -> list[dict[str, Any] | None]:
    return [(r.get(contracts.KV_TRANSFER_PARAMS) or {}).get(contracts.RETURN_FORECAST) for r in d.requests]


def loop(url: str, clock: Clock, rounds: int, headers: dict[str, str] | None = None) -> None:
    """An agent: tool calls answered 2 s later, then a final answer the user follows up 90 s later."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "weather?"}]
    for i in range(rounds):
        call = i % 3 != 2
        message = ask(url, messages, call, headers)
        messages.append({k: v for k, v in message.items() if k in ("role", "content", "tool_calls")})
        if call:
            assert message.get("tool_calls"), message
            messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": f"sunny {i}"})
            clock.now += 2
        else:
            messages.append({"role": "user", "content": f"and tomorrow {i}?"})
            clock.now += 90


def test_d_gets_the_forecast_per_ending(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    clock = Clock()
    fleet = fleet_factory(clock=clock)
    loop(fleet.url, clock, 30)
    got = [f for f in forecasts(fleet.decode[0]) if f is not None]
    assert len(got) == 30  # every turn D holds carries one
    last = got[-1]
    tool, final = last[contracts.TurnEnding.TOOL_CALLS.value], last[contracts.TurnEnding.FINAL.value]
    assert 1 < tool[contracts.RETURN_P50] <= 2 and 60 < final[contracts.RETURN_P50] <= 90
    # after a final answer this agent always calls a tool next: turn 27 (turn 26 was an answer) is forecast so
    assert got[27][contracts.RETURN_LIKELY] == contracts.TurnEnding.TOOL_CALLS.value and got[27][contracts.RETURN_P_TOOL] > 0.8
    assert (
        fleet.metric("bpdkv_router_return_forecasts_total", likely="tool_calls")
        + fleet.metric("bpdkv_router_return_forecasts_total", likely="final")
        == 30
    )
    # turns 0..28 came back: their 20 tool-call endings and 9 answers (turn 29's answer is not followed up)
    assert fleet.metric("bpdkv_router_return_gap_seconds_count", ending="tool_calls") == 20
    assert fleet.metric("bpdkv_router_return_gap_seconds_count", ending="final") == 9


def test_no_forecast_when_d_holds_nothing(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    clock = Clock()
    fleet = fleet_factory(clock=clock)
    loop(fleet.url, clock, 3, headers={contracts.REUSE_HEADER: contracts.SWITCH_OFF})
    loop(fleet.url, clock, 1, headers={contracts.LAST_TURN_HEADER: "true"})
    assert forecasts(fleet.decode[0]) == [None] * 4


def test_a_continued_turn_on_d_carries_it_too(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    clock = Clock()
    fleet = fleet_factory(clock=clock, router_changes={"paths": PathSettings(load_interval=0)})
    loop(fleet.url, clock, 3)
    local = [r for r in fleet.decode[0].requests if (r.get(contracts.KV_TRANSFER_PARAMS) or {}).get(contracts.LOCAL_TURN)]
    assert local, "the continued turns ran on D (decode_local)"
    assert all(contracts.RETURN_FORECAST in r[contracts.KV_TRANSFER_PARAMS] for r in local)
    assert json.dumps(local[-1][contracts.KV_TRANSFER_PARAMS][contracts.RETURN_FORECAST])  # plain JSON on the wire
