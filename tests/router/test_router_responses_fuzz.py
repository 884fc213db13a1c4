"""Fuzz of /v1/responses (hypothesis): bodies shaped like Responses requests with every part liable to be wrong — item
types, roles, call ids that match or not, previous_response_id (unknown, or one the router stored), fields of the
wrong type, stray JSON anywhere, streams — never get a 5xx from the router in front of emulated P and D; a refusal
is OpenAI's error shape, an answer a response (or its event stream)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.router.conftest import Fleet, make_fleet, stop_fleet
from tests.router.test_router_messages_fuzz import ANY_JSON, TEXT, maybe

ROUTE = "/v1/responses"
CALL_IDS = st.sampled_from(["c1", "c2", "", "call_x"])
PART = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "text"]), "text": maybe(TEXT)}),
    st.fixed_dictionaries({"type": st.sampled_from(["input_image", "input_audio", "input_file", ""]), "image_url": maybe(TEXT)}),
    ANY_JSON,
)
ITEM = st.one_of(
    st.fixed_dictionaries(
        {
            "role": maybe(st.sampled_from(["user", "assistant", "system", "developer", "tool"])),
            "content": maybe(st.one_of(TEXT, st.lists(PART, max_size=3))),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": maybe(CALL_IDS),
            "name": maybe(st.sampled_from(["get_weather", ""])),
            "arguments": maybe(st.just('{"city": "Paris"}')),
        }
    ),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": maybe(CALL_IDS), "output": maybe(TEXT)}),
    st.fixed_dictionaries(
        {"type": st.just("reasoning"), "summary": maybe(st.just([])), "content": maybe(st.just([{"type": "reasoning_text", "text": "t"}]))}
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["item_reference", "web_search_call", "message", ""]), "id": TEXT}),
    ANY_JSON,
)
TOOL = st.fixed_dictionaries(
    {"type": maybe(st.sampled_from(["function", "web_search", "file_search"])), "name": maybe(st.sampled_from(["get_weather", ""]))},
    optional={"parameters": maybe(st.just({"type": "object"})), "description": maybe(TEXT)},
)
BODY = st.fixed_dictionaries(
    {"model": maybe(st.just("emulated")), "input": maybe(st.one_of(TEXT, st.lists(ITEM, max_size=5)))},
    optional={
        "instructions": maybe(TEXT),
        "stream": maybe(st.booleans()),
        "store": maybe(st.booleans()),
        "max_output_tokens": maybe(st.integers(-2, 12)),
        "tools": maybe(st.lists(TOOL, max_size=2)),
        "tool_choice": maybe(
            st.one_of(
                st.sampled_from(["auto", "none", "required", "x"]), st.fixed_dictionaries({"type": st.just("function"), "name": TEXT})
            )
        ),
        "previous_response_id": maybe(st.sampled_from(["resp_unknown", "STORED", ""])),
        "temperature": maybe(st.floats(0, 2)),
        "background": maybe(st.booleans()),
        "text": ANY_JSON,
        "metadata": ANY_JSON,
        "kv_transfer_params": ANY_JSON,
    },
)


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Fleet, str]]:
    made = make_fleet()
    stored = httpx.post(made.url + ROUTE, json={"model": "emulated", "input": "remember me", "max_output_tokens": 4}, timeout=30)
    assert stored.status_code == 200
    yield made, stored.json()["id"]
    stop_fleet(made)


def check_answer(resp: httpx.Response, raw: bytes) -> None:
    assert resp.status_code < 500, (raw[:300], resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        return
    if resp.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in resp.text.split("\n\n") if e]
        names = [e.split("\n")[0].removeprefix("event: ") for e in events]
        assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed", names
        assert "kv_transfer_params" not in resp.text
        return
    data = resp.json()
    assert data["object"] == "response" and data["status"] in ("completed", "incomplete") and "kv_transfer_params" not in data


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(body=BODY)
def test_fuzzed_responses_bodies_never_get_a_5xx(fleet: tuple[Fleet, str], body: dict[str, Any]) -> None:
    f, stored = fleet
    if body.get("previous_response_id") == "STORED":
        body["previous_response_id"] = stored
    raw = json.dumps(body).encode()
    check_answer(httpx.post(f.url + ROUTE, content=raw, headers={"content-type": "application/json"}, timeout=30), raw)


def test_after_the_fuzz_no_5xx_was_counted(fleet: tuple[Fleet, str]) -> None:
    f, _ = fleet
    for status in ("500", "502", "503"):
        assert f.metric("bpdkv_router_requests_total", route=ROUTE, status=status) == 0
