"""Fuzz of /v1/messages (hypothesis): bodies shaped like Anthropic requests with every part liable to be wrong — roles,
block types, tool_use ids that match or not, fields of the wrong type, stray JSON anywhere, streams — never get a 5xx
from the router in front of emulated P and D; a refusal is Anthropic's error shape, an answer a message (or its
event stream), and the router serves normally afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.router.conftest import Fleet, make_fleet, stop_fleet

ROUTE = "/v1/messages"
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
IDS = st.sampled_from(["t1", "t2", "", "toolu_x"])
TEXT = st.text(max_size=20)


def maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the plausible value, sometimes any JSON at all."""
    return st.one_of(value, value, value, ANY_JSON)


BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": maybe(TEXT)}),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": maybe(IDS),
            "name": maybe(st.sampled_from(["get_weather", ""])),
            "input": maybe(st.just({"city": "Paris"})),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": maybe(IDS),
            "content": maybe(st.one_of(TEXT, st.just([{"type": "text", "text": "r"}]))),
        }
    ),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": maybe(TEXT), "signature": TEXT}),
    st.fixed_dictionaries({"type": st.just("redacted_thinking"), "data": maybe(TEXT)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "server_tool_use", "", "TEXT"]), "source": ANY_JSON}),
    ANY_JSON,
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": maybe(st.sampled_from(["user", "assistant", "system", "tool", "developer"])),
        "content": maybe(st.one_of(TEXT, st.lists(BLOCK, max_size=4))),
    }
)
TOOL = st.fixed_dictionaries(
    {"name": maybe(st.sampled_from(["get_weather", "get_time", ""])), "input_schema": maybe(st.just({"type": "object"}))},
    optional={"type": st.sampled_from(["custom", "web_search_20250305", "bash"]), "description": maybe(TEXT)},
)
BODY = st.fixed_dictionaries(
    {"model": maybe(st.just("emulated")), "max_tokens": maybe(st.integers(-2, 12)), "messages": maybe(st.lists(MESSAGE, max_size=5))},
    optional={
        "system": maybe(st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2))),
        "stream": maybe(st.booleans()),
        "tools": maybe(st.lists(TOOL, max_size=2)),
        "tool_choice": maybe(
            st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])}, optional={"name": IDS})
        ),
        "stop_sequences": maybe(st.lists(TEXT, max_size=2)),
        "temperature": maybe(st.floats(0, 2)),
        "top_k": maybe(st.integers(-5, 50)),
        "thinking": maybe(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["enabled", "disabled", "x"])}, optional={"budget_tokens": st.integers(-1, 2048)}
            )
        ),
        "metadata": ANY_JSON,
        "kv_transfer_params": ANY_JSON,
    },
)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    made = make_fleet()
    yield made
    stop_fleet(made)


def check_answer(resp: httpx.Response, raw: bytes) -> None:
    assert resp.status_code < 500, (raw[:300], resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        data = resp.json()
        assert data["type"] == "error" and data["error"]["message"] and data["error"]["type"], data
        return
    if resp.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in resp.text.split("\n\n") if e]
        names = [e.split("\n")[0].removeprefix("event: ") for e in events]
        assert names[0] == "message_start" and names[-1] == "message_stop", names
        assert "kv_transfer_params" not in resp.text
        return
    data = resp.json()
    assert data["type"] == "message" and data["content"] and data["stop_reason"] in ("end_turn", "max_tokens", "tool_use", "stop_sequence")
    assert "kv_transfer_params" not in data


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(body=BODY)
def test_fuzzed_messages_bodies_never_get_a_5xx(fleet: Fleet, body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    check_answer(httpx.post(fleet.url + ROUTE, content=raw, headers={"content-type": "application/json"}, timeout=30), raw)


def test_after_the_fuzz_no_5xx_was_counted(fleet: Fleet) -> None:
    for status in ("500", "502", "503"):
        assert fleet.metric("bpdkv_router_requests_total", route=ROUTE, status=status) == 0
    ok = httpx.post(
        fleet.url + ROUTE, json={"model": "emulated", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, timeout=30
    )
    assert ok.status_code == 200 and ok.json()["type"] == "message"
