"""The session store through a Redis failover, with real processes: a redis-server master and replica, Redis Sentinels
(redis-server --sentinel), the router in front of the emulated fleet. Behaviour only: no client error, reuse resumes,
the master moved; never how many seconds it took (benchmarks/redis_failover.py measures that)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.redis_failover import failover_under_load
from bpdkv.lab.ports import free_port
from bpdkv.router.config import RouterConfigError, config_from_dict
from bpdkv.router.resp import RespClient, RespConnectionError, RespError, parse_sentinel_url
from bpdkv.router.sessions import RedisStore, SessionEntry, StoreUnavailable, Verdict
from bpdkv.testing.sentinel import SentinelGroup, ask

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelGroup]:
    group = SentinelGroup(tmp_path / "redis", sentinels=3, down_after_ms=1000)
    try:
        yield group.start()
    finally:
        group.stop()


def _entry(history: str) -> SessionEntry:
    return SessionEntry(
        params={"remote_engine_id": "d"}, expires_at=time.time() + 60, history=history, decode="decode-0", stored_at=time.time()
    )


def test_router_keeps_serving_through_a_sentinel_failover_and_reuse_resumes(fleet_factory: Any, sentinels: SentinelGroup) -> None:
    fleet = fleet_factory(store_factory=lambda: RedisStore(sentinels.url, timeout=0.25))

    def metric(name: str, **labels: str) -> float:
        return float(fleet.metric(name, **labels))

    result = failover_under_load(fleet.url, sentinels, metric, conversations=4, before_s=1.5, limit_s=40)
    assert result["hits_before_kill"] > 0  # sessions were in Redis (through the Sentinels) before the kill
    assert result["client_errors"] == 0
    assert result["requests"] > 20
    assert result["outage_seen"]  # the router did lose its store for a while ...
    assert result["master_port_after"] not in (None, result["master_port_before"])  # ... the Sentinels moved the master ...
    assert result["reuse_resumed_s"] is not None  # ... and turns hit D's stored location again, by themselves
    assert fleet.metric("bpdkv_router_requests_total", status="200") == result["requests"]


def test_forced_failover_with_the_old_master_alive_is_followed(sentinels: SentinelGroup) -> None:
    """SENTINEL FAILOVER demotes a live master: the client follows (+switch-master, or READONLY from the demoted one),
    and what it writes afterwards lands on the new master."""
    old = sentinels.master_port()

    async def scenario() -> tuple[int, list[Any]]:
        client = RespClient(sentinels.url, 0.5)
        try:
            assert await client.execute("SET", "k-before", "1") == b"OK"
            assert client.port == old
            for _ in range(100):  # NOGOODSLAVE/INPROG until the Sentinel has judged the replica fit: bounded retries
                if ask(sentinels.ports["sentinel0"], "SENTINEL", "FAILOVER", sentinels.name) == b"OK":
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("SENTINEL FAILOVER was refused for 10 s")
            deadline = time.monotonic() + 30
            answers: list[Any] = []
            while time.monotonic() < deadline:
                try:
                    answers.append(await client.execute("SET", "k-after", "2"))
                except (RespError, RespConnectionError) as exc:
                    answers.append(exc)
                if client.port != old and answers[-1] == b"OK":
                    break
                await asyncio.sleep(0.1)
            return client.port, answers
        finally:
            await client.close()

    port, answers = asyncio.run(scenario())
    assert port != old and port == sentinels.master_port()
    assert answers[-1] == b"OK"
    assert ask(port, "GET", "k-after") == b"2"
    assert ask(port, "ROLE")[0] == b"master"


def test_discovery_skips_a_dead_sentinel_and_names_an_unknown_master(sentinels: SentinelGroup) -> None:
    dead = free_port()  # nothing listens there
    live = sentinels.ports["sentinel1"]
    good = f"redis+sentinel://127.0.0.1:{dead},127.0.0.1:{live}/{sentinels.name}"
    unknown = f"redis+sentinel://127.0.0.1:{dead},127.0.0.1:{live}/nosuchmaster"

    async def scenario() -> tuple[bool, list[tuple[str, int]], str]:
        store = RedisStore(good, timeout=0.5)
        other = RedisStore(unknown, timeout=0.5)
        try:
            await store.put("c:{1}h1", _entry("h1"), 30)
            entry, _ = await store.take(["c:{1}h1"], lambda e: Verdict.TAKE)
            with pytest.raises(StoreUnavailable) as failed:
                await other.put("c:{1}h1", _entry("h1"), 30)
            return entry is not None, list(store._redis.sentinels), str(failed.value)
        finally:
            await store.close()
            await other.close()

    took, order, problem = asyncio.run(scenario())
    assert took
    assert order[0] == ("127.0.0.1", live)  # the Sentinel that answered is asked first next time
    assert "nosuchmaster" in problem and "\n" not in problem


def test_a_readonly_reply_ends_the_connection_so_the_next_command_reconnects(sentinels: SentinelGroup) -> None:
    """A managed Redis's failover endpoint (a DNS name that moves) reached the old primary, now a replica: READONLY.
    The connection ends there; the next command connects again (asyncio resolves the name again at each connect)."""
    replica = next(p for k, p in sentinels.ports.items() if k in ("master", "replica") and p != sentinels.master_port())

    async def scenario() -> tuple[Any, Any, Any]:
        client = RespClient(f"redis://localhost:{replica}/0", 0.5)
        try:
            first = await client.execute("CLIENT", "ID")
            with pytest.raises(RespError, match="^READONLY"):
                await client.execute("SET", "k", "1")
            second = await client.execute("CLIENT", "ID")
            return first, second, await client.execute("GET", "k")
        finally:
            await client.close()

    first, second, value = asyncio.run(scenario())
    assert first != second  # a new connection after the READONLY
    assert value is None


def test_sentinel_urls_parse_and_bad_ones_are_one_line() -> None:
    assert parse_sentinel_url("redis+sentinel://:pw@a:1,b,[::1]:3/mymaster/2") == (
        [("a", 1), ("b", 26379), ("::1", 3)],
        "mymaster",
        2,
        None,
        "pw",
    )
    base = {"prefill": [{"url": "http://127.0.0.1:1"}], "decode": [{"url": "http://127.0.0.1:2"}], "listen": "127.0.0.1", "port": 0}
    config = config_from_dict({**base, "state": "rediss+sentinel://s1:26379,s2:26379/main"})
    assert config.state.startswith("rediss+sentinel://")
    for bad, says in (
        ("redis+sentinel://s1:26379", "the path is /master-name"),
        ("redis+sentinel://s1:x/main", "port is not a number"),
        ("redis+sentinel://:secret@/main", "no Sentinel address"),
        ("redis+sentinel://s1/main/zero", "db after the master name"),
    ):
        with pytest.raises(RouterConfigError) as failed:
            config_from_dict({**base, "state": bad})
        assert says in str(failed.value) and "\n" not in str(failed.value) and "secret" not in str(failed.value)
