"""P and D pools: selection (least outstanding, P with session affinity), active health checks, ejection."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

log = logging.getLogger("bpdkv.router")


@dataclass
class Upstream:
    name: str
    url: str
    role: str
    outstanding: int = 0
    failures: int = 0
    ejected_until: float = 0.0
    ejections: int = 0
    healthy: bool = True  # last active check
    last_error: str = ""

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.ejected_until


@dataclass
class Pool:
    role: str
    members: list[Upstream]
    failures_to_eject: int = 3
    backoff_max: float = 60.0
    clock: Callable[[], float] = time.monotonic
    # A warm prefix cache is worth a few queued requests; beyond this, load wins over affinity.
    affinity_slack: int = 2
    _by_name: dict[str, Upstream] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_name = {m.name: m for m in self.members}

    def candidates(self, exclude: set[str]) -> list[Upstream]:
        now = self.clock()
        live = [m for m in self.members if m.name not in exclude and m.available(now)]
        if live:
            return live
        # Everything ejected: try the ones not excluded anyway rather than failing without trying.
        return [m for m in self.members if m.name not in exclude]

    def pick(self, affinity: bytes | None = None, exclude: set[str] | None = None) -> Upstream | None:
        pool = self.candidates(exclude or set())
        if not pool:
            return None
        least = min(pool, key=lambda m: m.outstanding)
        if affinity is None or len(pool) == 1:
            return least
        # Rendezvous hashing: a conversation keeps landing on the same P while the set of live P is stable.
        preferred = max(pool, key=lambda m: hashlib.blake2b(affinity + m.name.encode(), digest_size=8).digest())
        if preferred.outstanding <= least.outstanding + self.affinity_slack:
            return preferred
        return least

    def success(self, member: Upstream) -> None:
        member.failures = 0

    def failure(self, member: Upstream, error: str) -> None:
        member.failures += 1
        member.last_error = error
        if member.failures >= self.failures_to_eject:
            member.ejections += 1
            backoff = min(self.backoff_max, 1.0 * 2 ** (member.ejections - 1))
            member.ejected_until = self.clock() + backoff
            member.failures = 0
            log.warning("%s %s ejected for %.0fs: %s", self.role, member.name, backoff, error)


async def health_loop(pools: list[Pool], client: aiohttp.ClientSession, interval: float, stop: asyncio.Event) -> None:
    """Active checks: GET /health on every member each interval, bounded by the stop event."""
    while not stop.is_set():
        await check_all(pools, client, timeout=min(interval, 5.0))
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


async def check_all(pools: list[Pool], client: aiohttp.ClientSession, timeout: float) -> None:
    async def check(pool: Pool, member: Upstream) -> None:
        try:
            async with client.get(member.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                await resp.read()
                ok = resp.status == 200
                err = f"HTTP {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            ok, err = False, type(exc).__name__
        if ok and not member.healthy:
            log.info("%s %s healthy again", pool.role, member.name)
        if not ok and member.healthy:
            log.warning("%s %s failed health check: %s", pool.role, member.name, err)
        member.healthy = ok
        if ok:
            member.ejected_until = min(member.ejected_until, pool.clock())
            member.ejections = 0
        else:
            member.last_error = err

    await asyncio.gather(*(check(p, m) for p in pools for m in p.members))
