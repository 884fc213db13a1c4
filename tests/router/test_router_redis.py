"""Shared sessions through a real redis-server: replicas, single use, Redis going away."""

from __future__ import annotations

import subprocess

from bpdkv.router.sessions import RedisStore
from tests.router.helpers import SYSTEM, chat, conversation


def test_two_replicas_share_sessions(fleet_factory, redis_server, reference) -> None:  # type: ignore[no-untyped-def]
    url = redis_server["url"]
    fleet = fleet_factory(n_routers=2, p_settings={"prefix_caching": False}, store_factory=lambda: RedisStore(url))
    a, b = fleet.router_urls
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "turn one"}]
    answers = []
    for turn in range(4):
        router = a if turn % 2 == 0 else b  # alternate replicas every turn
        text, _ = chat(router, messages)
        answers.append(text)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"turn {turn + 2}"}]
    ref_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "turn one"}]
    for turn in range(4):
        text, _ = chat(reference, ref_messages)
        assert text == answers[turn]
        ref_messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"turn {turn + 2}"}]
    hits = fleet.metric("bpdkv_router_reuse_total", 0, outcome="hit") + fleet.metric("bpdkv_router_reuse_total", 1, outcome="hit")
    assert hits == 3
    assert fleet.prefill[0].counters["prompt_tokens:external_kv_transfer"] > 0
    # single use across replicas: replaying the last turn on the other replica finds nothing
    messages = messages[:-2]
    chat(a, messages)
    chat(b, messages)
    assert fleet.prefill[0].counters.get("nixl_num_kv_expired_reqs", 0) == 0


def test_redis_down_serves_without_reuse(fleet_factory, redis_server) -> None:  # type: ignore[no-untyped-def]
    url = redis_server["url"]
    fleet = fleet_factory(store_factory=lambda: RedisStore(url, timeout=0.2))
    assert all(conversation(fleet.url, turns=2))
    proc: subprocess.Popen = redis_server["proc"]  # type: ignore[type-arg]
    proc.terminate()
    proc.wait(5)
    answers = conversation(fleet.url, turns=3, stream=True)
    assert all(answers)
    assert fleet.metric("bpdkv_router_store_errors_total") >= 3
    assert fleet.metric("bpdkv_router_requests_total", status="200") == 5
    assert fleet.metric("bpdkv_router_reuse_total", outcome="unavailable") >= 2


def test_session_id_takeover_refused_with_redis(fleet_factory, redis_server) -> None:  # type: ignore[no-untyped-def]
    """The compare-and-delete take and the SET NX store keep another history's entry intact in Redis too."""
    url = redis_server["url"]
    fleet = fleet_factory(n_routers=2, p_settings={"prefix_caching": False}, store_factory=lambda: RedisStore(url))
    a, b = fleet.router_urls
    sid = {"X-Session-Id": "conversation-A"}
    mine = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "my question"}]
    text, _ = chat(a, mine, headers=sid)
    mine += [{"role": "assistant", "content": text}, {"role": "user", "content": "my follow-up"}]
    chat(
        b, [{"role": "user", "content": "unrelated"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}], headers=sid
    )
    assert fleet.metric("bpdkv_router_reuse_total", 1, outcome="mismatch") == 1
    assert fleet.metric("bpdkv_router_sessions_not_stored_total", 1) == 1
    chat(b, mine, headers=sid)
    assert fleet.metric("bpdkv_router_reuse_total", 1, outcome="hit") == 1


def test_released_holds_are_shared_through_redis(redis_server) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    async def scenario() -> tuple[bool, bool]:
        a, b = RedisStore(redis_server["url"]), RedisStore(redis_server["url"])
        try:
            await a.mark_released(["decode-0:rid-1"], 30)
            return await b.is_released("decode-0:rid-1"), await b.is_released("decode-0:rid-2")
        finally:
            await a.close()
            await b.close()

    assert asyncio.run(scenario()) == (True, False)
