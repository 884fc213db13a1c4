"""The admin API (drain / undrain / list, its auth) and hostile or malformed input (limits, shapes, fuzz)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bpdkv.lab.ports import free_port
from tests.router.helpers import chat

CHAT = "/v1/chat/completions"


def upstreams(url: str, **kw: Any) -> dict[str, dict[str, Any]]:
    resp = httpx.get(url + "/admin/upstreams", timeout=10, **kw)
    assert resp.status_code == 200, resp.text
    return {u["name"]: u for u in resp.json()["upstreams"]}


def test_drain_stops_new_requests_and_waits_for_in_flight(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(n_decode=2, d_settings={"token_interval": 0.02})
    listed = upstreams(fleet.url)
    assert set(listed) == {"prefill-0", "decode-0", "decode-1"}
    assert listed["decode-0"] == {"name": "decode-0", "role": "decode", "url": fleet.emulator_urls[1], "state": "serving", "in_flight": 0}
    # One slow stream on decode-0 (the least loaded is the first).
    done = threading.Event()

    def slow() -> None:
        chat(fleet.url, [{"role": "user", "content": "slow one"}], stream=True, max_tokens=60, ignore_eos=True)
        done.set()

    threading.Thread(target=slow, daemon=True).start()
    deadline = time.monotonic() + 10
    while upstreams(fleet.url)["decode-0"]["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    # The lease is taken before the request reaches D: wait until D has it, or it would count as "new" below.
    while not fleet.decode[0].requests and time.monotonic() < deadline:
        time.sleep(0.01)
    drained = httpx.post(fleet.url + "/admin/upstreams/decode-0/drain", timeout=10).json()
    assert drained["state"] == "draining" and drained["in_flight"] == 1
    before = len(fleet.decode[0].requests)
    assert before == 1
    for i in range(4):
        chat(fleet.url, [{"role": "user", "content": f"new {i}"}])
    assert len(fleet.decode[0].requests) == before  # no new requests on a draining D
    assert done.wait(15)
    assert upstreams(fleet.url)["decode-0"]["state"] == "drained"
    assert httpx.post(fleet.url + "/admin/upstreams/decode-0/undrain", timeout=10).json()["state"] == "serving"
    assert httpx.post(fleet.url + "/admin/upstreams/nope/drain", timeout=10).status_code == 404


def test_undrain_checks_health_at_once(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    """A health check that ran while a drained D restarted marked it unhealthy: undrain checks it again at once, so it
    serves right away (not up to one health interval later), and the answer says its real state."""
    fleet = fleet_factory(n_decode=2)
    member = next(m for m in fleet.routers[0].decode.members if m.name == "decode-0")
    assert httpx.post(fleet.url + "/admin/upstreams/decode-0/drain", timeout=10).json()["state"] == "drained"
    member.healthy = False  # what the periodic check saw while it was down
    assert upstreams(fleet.url)["decode-0"]["state"] == "drained"
    assert httpx.post(fleet.url + "/admin/upstreams/decode-0/undrain", timeout=10).json()["state"] == "serving"
    assert member.healthy
    # Still down when undrained: the answer says so.
    url, member.url = member.url, f"http://127.0.0.1:{free_port()}"  # nothing listens there
    try:
        httpx.post(fleet.url + "/admin/upstreams/decode-0/drain", timeout=10)
        assert httpx.post(fleet.url + "/admin/upstreams/decode-0/undrain", timeout=10).json()["state"] == "unhealthy"
    finally:
        member.url = url


def test_admin_auth(fleet_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    admin = tmp_path / "admin.key"
    admin.write_text("adm-SECRET\n")
    keys = tmp_path / "keys"
    keys.write_text("sk-client\n")
    fleet = fleet_factory(router_changes={"admin_key_file": str(admin), "api_keys_file": str(keys)})
    url = fleet.url + "/admin/upstreams"
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 403
    assert httpx.get(url, headers={"Authorization": "Bearer sk-client"}, timeout=10).status_code == 403  # client keys never
    assert httpx.get(url, headers={"Authorization": "Bearer adm-SECRET"}, timeout=10).status_code == 200
    # The admin key is no client key either.
    assert (
        httpx.post(
            fleet.url + CHAT,
            json={"messages": [{"role": "user", "content": "x"}]},
            headers={"Authorization": "Bearer adm-SECRET"},
            timeout=10,
        ).status_code
        == 401
    )


def test_admin_without_key_answers_loopback_only(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory()
    router = fleet.routers[0]

    async def ask(client: tuple[str, int]) -> int:
        transport = httpx.ASGITransport(app=router.app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            return (await c.get("/admin/upstreams")).status_code

    assert asyncio.run(ask(("10.1.2.3", 4000))) == 403
    assert asyncio.run(ask(("127.0.0.1", 4000))) == 200


def test_body_limit_depth_and_shape(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(router_changes={"max_body_bytes": 4096})
    big = {"messages": [{"role": "user", "content": "x" * 5000}]}
    resp = httpx.post(fleet.url + CHAT, json=big, timeout=10)
    assert resp.status_code == 413 and "limit of 4096 bytes" in resp.json()["error"]["message"]

    def chunked() -> Any:
        yield json.dumps(big).encode()

    assert httpx.post(fleet.url + CHAT, content=chunked(), timeout=10).status_code == 413  # no content-length
    deep: Any = "x"
    for _ in range(100):
        deep = [deep]
    resp = httpx.post(fleet.url + CHAT, content=json.dumps({"messages": deep}), timeout=10)
    assert resp.status_code == 400 and "nests deeper" in resp.text
    very_deep = "[" * 100_000 + "]" * 100_000
    assert httpx.post(fleet.url + CHAT, content='{"messages": ' + very_deep[:3000] + "}", timeout=10).status_code == 400
    for bad, word in (
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": 5}]}, "content"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ):
        resp = httpx.post(fleet.url + CHAT, json=bad, timeout=10)
        assert resp.status_code == 400 and word in resp.json()["error"]["message"], (bad, resp.text)
    assert httpx.post(fleet.url + "/v1/completions", json={"prompt": [1, "x"]}, timeout=10).status_code == 400
    assert fleet.prefill[0].requests == []  # none of it reached an upstream
    assert fleet.metric("bpdkv_router_rejected_total", reason="too_large") == 2


def test_vllm_client_errors_pass_through_unchanged(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory()
    body = {"model": "emulated", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}
    direct = httpx.post(reference + CHAT, json=body, timeout=10)
    routed = httpx.post(fleet.url + CHAT, json=body, timeout=10)
    assert direct.status_code == routed.status_code and 400 <= routed.status_code < 500
    assert routed.json() == direct.json()


JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=5))
JSON = st.recursive(
    JSON_LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=12
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "robot", 3])},
    optional={"content": JSON, "tool_calls": JSON, "tool_call_id": JSON, "name": JSON},
)
BODY = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.one_of(st.lists(MESSAGE, max_size=3), JSON),
        "prompt": st.one_of(JSON, st.lists(st.integers(0, 300), max_size=5)),
        "stream": st.one_of(st.booleans(), JSON),
        "n": JSON,
        "max_tokens": st.one_of(st.integers(-3, 8), JSON),
        "session_id": JSON,
        "kv_transfer_params": JSON,
        "tools": JSON,
    },
)


@pytest.fixture(scope="module")
def fuzz_fleet() -> Any:
    from tests.router.conftest import make_fleet, stop_fleet

    fleet = make_fleet()
    yield fleet
    stop_fleet(fleet)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=BODY, route=st.sampled_from([CHAT, "/v1/completions"]))
def test_fuzzed_bodies_never_get_a_router_5xx(fuzz_fleet: Any, body: dict[str, Any], route: str) -> None:
    resp = httpx.post(fuzz_fleet.url + route, json=body, timeout=10)
    assert resp.status_code < 500, (body, resp.status_code, resp.text[:300])


def test_router_serves_after_fuzzing(fuzz_fleet: Any) -> None:
    text, _ = chat(fuzz_fleet.url, [{"role": "user", "content": "still there?"}])
    assert text
    assert fuzz_fleet.metric("bpdkv_router_requests_total", route=CHAT, status="500") == 0


def test_sessions_on_a_drained_decode_are_still_pulled(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(n_decode=2, p_settings={"prefix_caching": False})
    messages = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "first"}]
    text, _ = chat(fleet.url, messages)
    holder = next(i for i, d in enumerate(fleet.decode) if d.held)
    assert httpx.post(fleet.url + f"/admin/upstreams/decode-{holder}/drain", timeout=10).json()["state"] == "drained"
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "second"}]
    before = len(fleet.decode[holder].requests)
    text2, _ = chat(fleet.url, messages)
    assert text2 == chat(reference, messages)[0]
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 1  # P pulled from the drained D
    assert len(fleet.decode[holder].requests) == before  # but D's new work went elsewhere
    # Undrain (after a restart, as apply does): what it held before is no longer offered.
    other = 1 - holder
    messages += [{"role": "assistant", "content": text2}, {"role": "user", "content": "third"}]
    httpx.post(fleet.url + f"/admin/upstreams/decode-{other}/drain", timeout=10)
    httpx.post(fleet.url + f"/admin/upstreams/decode-{other}/undrain", timeout=10)
    chat(fleet.url, messages)
    assert fleet.metric("bpdkv_router_reuse_total", outcome="refused") == 1
