"""What the worker processes of one router share besides sessions: admin drains, and the requests each has in flight.

A drain (POST /admin/upstreams/{name}/drain) reaches one worker, the one the kernel gave the connection; on its own
it would stop only that worker sending to the upstream, and `bpdkv apply`, polling the listing on whichever worker
answers, would restart a D the other workers still send to. So the admin state lives in Redis (the store the
workers already share), one hash slot per router run:

- `bpdkv:{a:<run>}:state` (hash): upstream name → its admin state ({"drained", "restarted_at"}), `...:v` its version
  (INCR on every change, in the same script);
- `bpdkv:{a:<run>}:workers` (hash): worker id → {"v": the version it applied, "at": when it wrote, "out": requests
  it has in flight per upstream}.

Every worker reads the version every POLL_S and applies what changed (an undrain also checks the upstream's health
at once, as the worker that took the call does); it writes its own entry when it applied a version, when its
requests in flight on a drained upstream changed, and at least every HEARTBEAT_S. The worker that took the call
answers only when every live worker (entry younger than LIVE_S) has applied it, so after the answer no worker sends a
new request to a drained upstream; `in_flight` and `draining`/`drained` are sums over the live workers. If Redis does
not answer, the call fails with 503 (a drain that reached one worker of N would be worse than none).
The run id comes from the supervisor (a new one per start: a restarted router forgets its drains, as one process does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bpdkv.router.resp import RespClient, RespConnectionError, RespError
from bpdkv.router.upstream_http import UpstreamClient
from bpdkv.router.upstreams import Pool, Upstream, UpstreamState, check_member

log = logging.getLogger("bpdkv.router")

RUN_ENV = "BPDKV_ROUTER_RUN"  # set by the supervisor: one id per router start
WORKERS_ENV = "BPDKV_ROUTER_WORKERS"  # how many workers it started
POLL_S = 0.05
HEARTBEAT_S = 1.0
LIVE_S = 3.0
ACK_BOUND_S = 2.0  # beyond the undrain's own health check

# HSET the admin state of one upstream and bump the version, atomically (both keys in one slot).
CHANGE = "redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]); return redis.call('INCR', KEYS[2])"


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (containers, systemd's
    CPUQuota=)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text(encoding="utf-8").split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def auto_workers(cores: int | None = None) -> int:
    """`workers: auto`. One process below 4 usable cores: a second worker costs every turn its Redis round trips and
    the processes preempt each other (measured on 2 cores: two workers never served more than one process, at
    1.2-1.4x its CPU per request; benchmarks/results/router/README.md). From 4 cores: one worker per core but one,
    left to the redis-server, the supervisor and the kernel's network work (about half a worker's CPU is its
    socket system calls)."""
    n = usable_cores() if cores is None else cores
    return 1 if n < 4 else n - 1


class SharedStateUnavailable(Exception):
    pass


class WorkerSync:
    def __init__(
        self,
        redis: RespClient,
        run: str,
        workers: int,
        pools: list[Pool],
        client: Callable[[], UpstreamClient],
        check_timeout: float,
        worker_id: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis, self.workers, self.pools = redis, workers, pools
        self.client, self.check_timeout, self.clock = client, check_timeout, clock
        self.id = worker_id or str(os.getpid())
        prefix = f"bpdkv:{{a:{run}}}:"
        self.state_key, self.version_key, self.workers_key = prefix + "state", prefix + "v", prefix + "workers"
        self.applied = 0
        self._names = self._member_names()
        self._written: tuple[int, dict[str, int]] | None = None
        self._written_at = 0.0
        self._task: asyncio.Task[None] | None = None

    @staticmethod
    def from_env(redis: RespClient, pools: list[Pool], client: Callable[[], UpstreamClient], check_timeout: float) -> WorkerSync | None:
        run, workers = os.environ.get(RUN_ENV), os.environ.get(WORKERS_ENV)
        if not run or not workers or int(workers) < 2:
            return None
        return WorkerSync(redis, run, int(workers), pools, client, check_timeout)

    def members(self) -> list[Upstream]:
        return [m for pool in self.pools for m in pool.members]

    def _member_names(self) -> frozenset[tuple[str, str]]:
        return frozenset((m.name, m.url) for m in self.members())

    def _pool_of(self, member: Upstream) -> Pool:
        return next(p for p in self.pools if member in p.members)

    # ---- the loop every worker runs --------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        try:
            await self.redis.execute("HDEL", self.workers_key, self.id)  # no longer counted as live
        except (RespError, RespConnectionError, OSError):
            pass
        await self.redis.close()

    async def _loop(self) -> None:
        while True:
            try:
                await self.sync()
            except (RespError, RespConnectionError, OSError) as exc:
                log.warning("router worker %s: shared admin state unavailable: %s", self.id, exc)
            await asyncio.sleep(POLL_S)

    async def sync(self) -> None:
        """Apply a newer admin state if there is one; write this worker's entry when it changed or is due."""
        version = int(await self.redis.execute("GET", self.version_key) or 0)
        names = self._member_names()
        if version > self.applied or names != self._names:
            # A reloaded config (router/reload.py) added or moved members: the shared drains apply to them too (a
            # drain another worker took for a member this one did not have yet is in a state already applied).
            fresh = {name for name, _ in names - self._names}
            raw = await self.redis.execute("HGETALL", self.state_key)
            states = {raw[i].decode(): json.loads(raw[i + 1]) for i in range(0, len(raw), 2)}
            await self._apply(states if version > self.applied else {k: v for k, v in states.items() if k in fresh})
            self.applied, self._names = max(self.applied, version), names
        await self._write()

    async def _apply(self, states: dict[str, dict[str, Any]]) -> None:
        checks = []
        for member in self.members():
            state = states.get(member.name)
            if state is None:
                continue
            drained = bool(state["drained"])
            if drained and not member.drained:
                member.drained = True
                log.info("admin (another worker): drain %s", member.name)
            elif not drained and member.drained:
                member.drained = False
                member.restarted_at = max(member.restarted_at, float(state["restarted_at"]))
                member.ejected_until = 0.0
                log.info("admin (another worker): undrain %s", member.name)
                checks.append(check_member(self._pool_of(member), member, self.client(), timeout=self.check_timeout))
        if checks:
            await asyncio.gather(*checks)

    def _outstanding(self) -> dict[str, int]:
        return {m.name: m.outstanding for m in self.members() if m.outstanding}

    async def _write(self, force: bool = False) -> None:
        now = self.clock()
        out = self._outstanding()
        drained = {m.name for m in self.members() if m.drained}
        mine = (self.applied, {k: v for k, v in out.items() if k in drained})
        if not force and mine == self._written and now - self._written_at < HEARTBEAT_S:
            return
        entry = json.dumps({"v": self.applied, "at": now, "out": out}, separators=(",", ":"))
        await self.redis.execute("HSET", self.workers_key, self.id, entry)
        self._written, self._written_at = mine, now

    async def _live_workers(self) -> dict[str, dict[str, Any]]:
        raw = await self.redis.execute("HGETALL", self.workers_key)
        now = self.clock()
        entries = {raw[i].decode(): json.loads(raw[i + 1]) for i in range(0, len(raw), 2)}
        return {k: e for k, e in entries.items() if now - float(e["at"]) < LIVE_S}

    # ---- the admin call's side -------------------------------------------------------------------------------
    async def changed(self, member: Upstream) -> None:
        """The admin call changed `member` here: share it and return when every live worker applied it."""
        state = json.dumps({"drained": member.drained, "restarted_at": member.restarted_at})
        try:
            version = int(await self.redis.script(CHANGE, [self.state_key, self.version_key], [member.name, state]))
            # Changes of other calls in between are applied by the loop as usual; this one is applied here already.
            if version == self.applied + 1:
                self.applied = version
            await self._write(force=True)
            deadline = time.monotonic() + ACK_BOUND_S + (self.check_timeout if not member.drained else 0.0)
            while True:
                live = await self._live_workers()
                behind = [k for k, e in live.items() if int(e["v"]) < version and k != self.id]
                if not behind and len(live) >= self.workers:
                    return
                if time.monotonic() >= deadline:
                    log.warning(
                        "admin: %s: workers %s did not apply it in time (%d live of %d)", member.name, behind, len(live), self.workers
                    )
                    return
                await asyncio.sleep(0.02)
        except (RespError, RespConnectionError, OSError) as exc:
            raise SharedStateUnavailable(f"the router's workers share admin state through Redis, which failed: {exc}") from None

    async def describe(self, members: list[Upstream]) -> list[dict[str, object]]:
        """The admin view of members over all live workers: requests in flight summed, draining until none is left."""
        try:
            live = await self._live_workers()
        except (RespError, RespConnectionError, OSError) as exc:
            raise SharedStateUnavailable(f"the router's workers share admin state through Redis, which failed: {exc}") from None
        now = time.monotonic()
        out = []
        for member in members:
            view = member.describe(now)
            others = sum(int(e["out"].get(member.name, 0)) for k, e in live.items() if k != self.id)
            total = member.outstanding + others
            view["in_flight"] = total
            if member.drained:
                view["state"] = (UpstreamState.DRAINING if total else UpstreamState.DRAINED).value
            out.append(view)
        return out
