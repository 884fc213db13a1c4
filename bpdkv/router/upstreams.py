"""P and D pools: selection (least outstanding, P with session affinity), active health checks, ejection, drain.

Every request an upstream serves is held through one `Lease` (acquired when the request is sent, released exactly once
whichever way it ends), so `outstanding` — what least-loaded picks and what drain waits for — cannot leak.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum

from bpdkv.router import generations
from bpdkv.router.config import GenerationSpec, UpstreamSpec
from bpdkv.router.steps import Buckets, StepWindow
from bpdkv.router.upstream_http import UpstreamClient, UpstreamFailure, UpstreamTimeout

log = logging.getLogger("bpdkv.router")


class UpstreamState(str, Enum):
    SERVING = "serving"
    DRAINING = "draining"  # admin drain, requests still in flight
    DRAINED = "drained"  # admin drain, nothing in flight
    UNHEALTHY = "unhealthy"  # failed its health check or ejected after failures
    MISMATCHED = "mismatched"  # the engine is not what its generation says (vLLM release or model): never used


@dataclass(frozen=True)
class EngineLoad:
    """What the upstream's engine last said of its load (engines.py reads its /metrics)."""

    running: float
    waiting: float
    kv_usage: float | None  # fraction of the KV cache in use, 0..1
    at: float  # monotonic clock of the read
    own: int | None = None  # this router's requests in flight on that engine while it was read (None: not known)
    itl_buckets: Buckets = ()  # its inter-token gap histogram (cumulative), for D's step time (steps.py)
    itl_seconds: float = 0.0  # that histogram's sum
    prefill_rate: float | None = None  # P: its own measured prefill rate, tokens/s (the node plugin's gauge)


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
    slow_checks: int = 0  # health checks in a row that got no answer in time (the upstream accepted, did not answer)
    went_down: bool = False  # marked unhealthy by a refusal, reset or error answer (it may restart), not only slowness
    last_error: str = ""
    drained: bool = False  # admin: no new requests
    # Stored sessions from before this wall-clock time point at blocks this D no longer holds (it restarted).
    restarted_at: float = 0.0
    engine_id: str | None = None  # the NIXL engine id D last returned; a new one means D restarted
    engine_seen_at: float = 0.0  # wall clock of that observation
    suspect_engine: str | None = None  # a pull from this engine failed; cleared when D answers with it again
    engine_load: EngineLoad | None = None  # the engine's own signals (None: never read)
    load_fresh_for: float = 3.0  # seconds an engine_load stays usable (STALE_AFTER load intervals)
    local_tokens: int = 0  # D: new tokens of continued turns sent here whose first byte has not come back yet
    steps: StepWindow = field(default_factory=StepWindow)  # D: its engine's recent inter-token gaps (step time)
    # Its generation (router/generations.py): P and D pair only within one; rank orders them (higher: newer).
    generation: str = ""
    generation_rank: int = 0
    expect: GenerationSpec | None = None  # what the engine must report (GET /version, /v1/models); None: not checked
    identity_verified: bool = False  # the engine answered as its generation says since it last went down
    identity_problem: str | None = None  # what it reported instead
    checks_since_identity: int = 0
    incarnation: int = 0  # +1 each time a reloaded config moves it (another url or generation): another engine since

    def fresh_load(self, now: float) -> EngineLoad | None:
        """The engine's last signal while it is fresh. A signal whose every request was this router's own (running +
        waiting <= own) is superseded once none of them is in flight any more: those requests are over, so the
        engine's queue is not what it said (a turn's own D request, counted waiting while it fetched P's KV, would
        otherwise hold the next short turn off D for the signal's lifetime). Other routers' load keeps it."""
        load = self.engine_load
        if load is None or now - load.at > self.load_fresh_for:
            return None
        if load.own is not None and self.outstanding == 0 and load.running + load.waiting <= load.own:
            return replace(load, running=0.0, waiting=0.0)
        return load

    def load(self, now: float) -> float:
        """Requests on this upstream: the router's own count, or the engine's (other routers' requests too) if higher."""
        engine = self.fresh_load(now)
        if engine is None:
            return self.outstanding
        return max(self.outstanding, engine.running + engine.waiting)

    def kv_full(self, now: float, limit: float = 0.95) -> bool:
        engine = self.fresh_load(now)
        return engine is not None and engine.kv_usage is not None and engine.kv_usage >= limit

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.ejected_until and not self.drained and self.identity_ok

    @property
    def identity_ok(self) -> bool:
        """Never used before its engine confirmed its generation, nor after it reported another one."""
        return self.identity_problem is None and (self.expect is None or self.identity_verified)

    def state(self, now: float) -> UpstreamState:
        if self.identity_problem is not None:
            return UpstreamState.MISMATCHED
        if self.drained:
            return UpstreamState.DRAINING if self.outstanding else UpstreamState.DRAINED
        if not (self.healthy and now >= self.ejected_until):
            return UpstreamState.UNHEALTHY
        return UpstreamState.SERVING

    def describe(self, now: float) -> dict[str, object]:
        """The admin API's view of this upstream."""
        view: dict[str, object] = {"name": self.name, "role": self.role, "url": self.url, "state": self.state(now).value}
        view["in_flight"] = self.outstanding
        if self.generation:  # a config that lists generations (every member has one then)
            view["generation"] = self.generation
        if self.identity_problem:
            view["problem"] = self.identity_problem
        return view

    def lease(self) -> Lease:
        return Lease(self)

    def moved(self, url: str, generation: str, rank: int, expect: GenerationSpec | None, at: float) -> None:
        """A reloaded config gives this member another url or generation: it is another engine from now on, as after a
        restart. Blocks stored before `at` are never offered (nor any of another generation: reuse.py), its engine is
        learnt again, and it is used only once a check found it healthy and of its generation. Its drain (an operator's)
        and its requests in flight (leases on this object) stay."""
        self.url, self.generation, self.generation_rank, self.expect = url, generation, rank, expect
        self.incarnation += 1
        self.restarted_at = max(self.restarted_at, at)
        self.engine_id, self.engine_seen_at, self.suspect_engine, self.engine_load = None, 0.0, None, None
        self.steps = StepWindow()
        self.identity_verified, self.identity_problem, self.checks_since_identity = False, None, 0
        self.healthy, self.went_down, self.slow_checks, self.last_error = False, False, 0, ""
        self.failures, self.ejected_until, self.ejections = 0, 0.0, 0

    def observe_engine(self, engine: str, at: float, fresh: bool) -> None:
        """D told us (fresh: in its own answer; else: through an entry another router worker stored) which engine
        holds its blocks. A new engine means D restarted: blocks stored before `at` are gone."""
        if fresh and engine == self.suspect_engine:
            self.suspect_engine = None  # it answers with that engine: the failed pull was not a restart
        if at < self.engine_seen_at:
            return
        if self.engine_id is not None and engine != self.engine_id:
            self.restarted_at = max(self.restarted_at, at)
            log.info("%s %s has a new engine (restarted): its older sessions are forgotten", self.role, self.name)
        self.engine_id, self.engine_seen_at = engine, at

    def holds(self, engine: str | None, stored_at: float) -> bool:
        """Whether blocks this D stored at `stored_at` under `engine` can still be there."""
        if not self.healthy or time.monotonic() < self.ejected_until or not self.identity_ok:
            return False
        if engine is None or engine == self.suspect_engine or stored_at < self.restarted_at:
            return False
        if self.engine_id is not None and engine != self.engine_id:
            if stored_at > self.engine_seen_at:  # newer news (another worker saw D's new engine first)
                self.observe_engine(engine, stored_at, fresh=False)
                return True
            return False
        return True


class Lease:
    """One request in flight on one upstream; release() is idempotent, so every exit path may call it."""

    __slots__ = ("member", "_held")

    def __init__(self, member: Upstream) -> None:
        self.member = member
        member.outstanding += 1
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.member.outstanding -= 1

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


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

    def member(self, name: str) -> Upstream | None:
        return self._by_name.get(name)

    def candidates(self, exclude: set[str]) -> list[Upstream]:
        now = self.clock()
        scope = generations.scope()  # this turn's generation: P and D of no other may serve it
        members = [m for m in self.members if m.name not in exclude and (scope is None or m.generation == scope)]
        live = [m for m in members if m.available(now)]
        if live:
            return live
        # Everything ejected: try the ones not excluded anyway rather than failing without trying. Drained ones
        # never: an operator took them out (a restart may be under way); nor an engine not (yet) of its generation.
        return [m for m in members if not m.drained and m.identity_ok]

    def pick(self, affinity: bytes | None = None, exclude: set[str] | None = None) -> Upstream | None:
        pool = self.candidates(exclude or set())
        if not pool:
            return None
        if len(pool) == 1:
            return pool[0]
        # Load beyond the router's own outstanding counts: the engines' running + waiting (other routers' requests,
        # requests queued inside vLLM), and an engine whose KV cache is full (it would preempt) only if all are.
        now = time.monotonic()
        least = min(pool, key=lambda m: (m.kv_full(now), m.load(now)))
        if affinity is None:
            return least
        # Rendezvous hashing: a conversation keeps landing on the same P while the set of live P is stable.
        preferred = max(pool, key=lambda m: hashlib.blake2b(affinity + m.name.encode(), digest_size=8).digest())
        if preferred.kv_full(now) <= least.kv_full(now) and preferred.load(now) <= least.load(now) + self.affinity_slack:
            return preferred
        return least

    def reconcile(self, specs: tuple[UpstreamSpec, ...], known: tuple[GenerationSpec, ...], at: float) -> list[Upstream]:
        """This pool's members as a reloaded config lists them (router/reload.py); returns those to check before use.

        A member whose name, url and generation are unchanged keeps all its state (health, drain, requests in flight,
        engine). One whose url or generation changed is updated in place as restarted (`Upstream.moved`). A new one
        starts unchecked, as restarted at `at` (entries stored under its name before, by an earlier member of that
        name, are never offered). A removed one gets no new requests; those in flight on it finish (their leases hold
        the object)."""
        listed = build_members(specs, self.role, known)
        members: list[Upstream] = []
        check: list[Upstream] = []
        for new in listed:
            old = self._by_name.get(new.name)
            if old is None:
                new.healthy, new.restarted_at = False, at
                log.info("%s %s added (%s, generation %r): used once checked", self.role, new.name, new.url, new.generation)
                members.append(new)
                check.append(new)
                continue
            if (old.url, old.generation) != (new.url, new.generation):
                log.info(
                    "%s %s moved to %s, generation %r (was %s, %r): a restarted member, used once checked",
                    self.role, old.name, new.url, new.generation, old.url, old.generation,
                )  # fmt: skip
                old.moved(new.url, new.generation, new.generation_rank, new.expect, at)
                check.append(old)
            else:
                old.generation_rank = new.generation_rank
                if old.expect != new.expect:  # its generation now says another release or model: read the engine again
                    old.expect, old.identity_verified, old.identity_problem = new.expect, False, None
                    check.append(old)
            members.append(old)
        for gone in self.members:
            if gone.name not in {m.name for m in listed}:
                log.info("%s %s removed from the config: no new requests (%d in flight finish)", self.role, gone.name, gone.outstanding)
        self.members[:] = members
        self._by_name = {m.name: m for m in members}
        return check

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


def build_members(specs: tuple[UpstreamSpec, ...], role: str, known: tuple[GenerationSpec, ...] = ()) -> list[Upstream]:
    """A pool's members from the config: each with its generation, its rank (newer: higher) and what its engine
    must report at runtime (where the generation says: vLLM release, --model)."""
    by_id = {g.id: (rank, g) for rank, g in enumerate(known)}
    out = []
    for spec in specs:
        rank, gen = by_id.get(spec.generation, (0, None))
        expect = gen if gen is not None and (gen.vllm or gen.model_root) else None
        out.append(Upstream(spec.name, spec.url, role, generation=spec.generation, generation_rank=rank, expect=expect))
    return out


IDENTITY_EVERY = 30  # healthy checks between re-reads of an engine's identity (and after it went down or restarted)


def _release(version: str) -> str:
    return version.split("+", 1)[0].strip()


async def check_identity(member: Upstream, client: UpstreamClient, timeout: float) -> None:
    """Read what the engine says it is (vLLM's GET /version and GET /v1/models' `root`, the --model it runs) and compare
    with its generation: a mis-rendered config must never pair engines that cannot read each other's KV. An engine
    that cannot tell (no such endpoint, no root) is taken at its config's word for that part."""
    want = member.expect
    if want is None:
        return
    problem = None
    if want.vllm:
        version = await _read_json(client, member.url + "/version", timeout)
        said = version.get("version") if isinstance(version, dict) else None
        if isinstance(said, str) and _release(said) != _release(want.vllm):
            problem = f"runs vLLM {said}; its generation {want.id} is vLLM {want.vllm}"
    if problem is None and want.model_root:
        models = await _read_json(client, member.url + "/v1/models", timeout)
        data = models.get("data") if isinstance(models, dict) else None
        roots = [d.get("root") for d in data if isinstance(d, dict) and d.get("root")] if isinstance(data, list) else []
        if roots and want.model_root not in roots:
            problem = f"serves {', '.join(map(str, roots))}; its generation {want.id} is {want.model_root}"
    if problem != member.identity_problem:
        if problem:
            log.error("%s %s is not of its generation, not used: %s", member.role, member.name, problem)
        elif member.identity_problem:
            log.info("%s %s is of its generation %s again", member.role, member.name, want.id)
    member.identity_problem = problem
    member.identity_verified = problem is None
    member.checks_since_identity = 0


async def _read_json(client: UpstreamClient, url: str, timeout: float) -> object:
    answer = await client.fetch("GET", url, None, {}, timeout)
    if answer.status != 200:
        return None
    try:
        return json.loads(answer.content)
    except ValueError:
        return None


async def health_loop(
    pools: list[Pool],
    client: UpstreamClient,
    interval: float,
    timeout: float,
    stop: asyncio.Event,
    after: Callable[[], None] | None = None,
) -> None:
    """Active checks: GET /health on every member each interval, bounded by the stop event; `after` runs after each
    pass (what is derived from health, such as the serving gauge, stays current without traffic)."""
    while not stop.is_set():
        await check_all(pools, client, timeout)
        if after is not None:
            after()
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


async def check_member(pool: Pool, member: Upstream, client: UpstreamClient, timeout: float) -> bool:
    """GET /health on one member; its health follows the answer (True: healthy).

    Why slowness is judged apart: a refused or reset connection or an error answer means the server is down or
    restarting — unhealthy at once, and when it answers again its held blocks may be gone, so the sessions stored
    before are forgotten. A check that only timed out (a busy or briefly stalled server) is a failure like a failed
    request: unhealthy after `failures_to_eject` in a row, and it restarted only if it went down too. Forgetting every
    session of a D on one slow answer cost all its conversations their reuse; a D that did restart unseen is caught by
    its new engine id on its first answer, and P's read fence refuses blocks it no longer holds."""
    slow = False
    try:
        answer = await client.fetch("GET", member.url + "/health", None, {}, timeout)
        ok = answer.status == 200
        err = f"HTTP {answer.status}"
    except UpstreamTimeout as exc:
        ok, slow, err = False, True, type(exc).__name__
    except UpstreamFailure as exc:
        ok, err = False, type(exc).__name__
    if ok and member.expect is not None and (not member.identity_verified or member.checks_since_identity >= IDENTITY_EVERY):
        try:
            await check_identity(member, client, timeout)
        except UpstreamFailure as exc:
            ok, err = False, f"identity: {type(exc).__name__}"  # its /version or /v1/models did not answer
    member.checks_since_identity += 1
    if ok:
        if not member.healthy:
            log.info("%s %s healthy again", pool.role, member.name)
            if member.went_down:
                member.restarted_at = time.time()  # it may have restarted: its old blocks are gone
        member.healthy, member.went_down, member.slow_checks = True, False, 0
        member.ejected_until = min(member.ejected_until, pool.clock())
        member.ejections = 0
        return True
    member.last_error = err
    if slow:
        member.slow_checks += 1
        if member.healthy and member.slow_checks < pool.failures_to_eject:
            log.warning("%s %s did not answer its health check in %.1fs (%d in a row)", pool.role, member.name, timeout, member.slow_checks)
            return False
    else:
        member.went_down = True
        member.identity_verified = False  # it may come back as another engine: read what it is first
    if member.healthy:
        log.warning("%s %s failed health check: %s", pool.role, member.name, err)
    member.healthy = False
    return False


async def check_all(pools: list[Pool], client: UpstreamClient, timeout: float) -> None:
    await asyncio.gather(*(check_member(p, m, client, timeout) for p in pools for m in p.members))
