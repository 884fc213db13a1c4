"""One P→D turn of vLLM's disaggregated protocol (NixlConnector, pull mode, bidirectional), in one place.

P gets the prompt with max_tokens=1, no stream, and either the "prefill for a remote decode" template or D's params
from the previous turn (where to pull the history from); P answers with where D pulls P's blocks. D gets the
client's request plus P's params and answers as the client asked, returning where its own blocks are held.

This is the router's side (`PdTurn`: pools, one retry policy, leases). The requests themselves and the client that
drives P and D directly (calibrate, the EFA probe, the demo, the GPU and e2e tests) live in bpdkv.turn_client, which
the deploy side may import too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from bpdkv import contracts
from bpdkv.router import generations, jsonbytes
from bpdkv.router.config import Timeouts
from bpdkv.router.metrics import RouterMetrics
from bpdkv.router.sessions import settle_cause
from bpdkv.router.upstream_http import Answer, BodySink, EndSink, UpstreamClient, UpstreamFailure, UpstreamStream
from bpdkv.router.upstreams import Lease, Pool, Upstream
from bpdkv.turn_client import decode_body, params_of, prefill_body

# Turns whose D keeps its blocks for the next turn: a tool-calling turn is as reusable as a plain one.
REUSABLE_FINISH = ("stop", "length", "tool_calls")
UPSTREAM_ERRORS = (UpstreamFailure,)


# ---- the protocol steps (prefill_body, decode_body, params_of: bpdkv.turn_client) ----------------------------------
def local_params(held: dict[str, Any], hold: bool = True) -> dict[str, Any]:
    """A continued turn's params for the D that holds the conversation (path decode_local): compute from your own
    cache, hold the result again (unless hold=False: no turn follows), and let the previous hold go (superseded)."""
    params: dict[str, Any] = {contracts.LOCAL_TURN: True}
    previous = held.get(contracts.REMOTE_REQUEST_ID)
    if isinstance(previous, str):
        params[contracts.RELEASE_REQUEST_IDS] = [previous]
    if not hold:
        params[contracts.HOLD] = False
    return params


def usable_d_params(params: Any) -> bool:
    """D's returned params are reusable only if they point at blocks P can pull."""
    return (
        isinstance(params, dict)
        and params.get(contracts.DO_REMOTE_DECODE) is True
        and bool(params.get(contracts.REMOTE_BLOCK_IDS))
        and params.get(contracts.REMOTE_ENGINE_ID) is not None
    )


# ---- the router's turn -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Passthrough:
    """An error the client caused (vLLM's 4xx): sent to the client as vLLM wrote it."""

    answer: Answer


@dataclass(frozen=True)
class NoUpstream:
    """Every upstream of a role failed (or none is available): the router answers 502."""

    message: str


@dataclass(frozen=True)
class Prefilled:
    params: dict[str, Any] | None
    member: Upstream
    fell_back: bool  # P failed with D's params and succeeded without them
    other_generation: bool = False  # a stored location was found but not offered: its D's generation did not serve


@dataclass(frozen=True)
class DecodedWhole:
    answer: Answer
    member: Upstream
    incarnation: int = 0  # the member's when D was sent the request (a reload may have moved it since)


class DecodeStream:
    """D's stream, held open from its first body bytes (until then a failing D can be swapped for another) until
    the relay closes it: the lease on D ends with it."""

    def __init__(self, member: Upstream, lease: Lease, stream: UpstreamStream, incarnation: int = 0) -> None:
        self.member = member
        self.incarnation = incarnation  # the member's when D was sent the request (a reload may have moved it since)
        self.lease = lease
        self.stream = stream
        self.first = stream.first
        self.content_type = stream.content_type

    def attach(self, sink: BodySink, on_end: EndSink) -> None:
        self.stream.attach(sink, on_end)

    def pause(self) -> None:
        self.stream.pause()

    def resume(self) -> None:
        self.stream.resume()

    def close(self, reusable: bool) -> None:
        self.lease.release()
        self.stream.close(reusable)  # not reusable (client gone, D failed): dropping the connection cancels D's request


class PdTurn:
    """P then D over the pools. One retry policy: each upstream of a role tried at most once per request, best
    first; an upstream failure (connection, timeout, 5xx) moves on to the next and counts towards ejection; a 4xx is
    the client's and goes back unchanged. A P failure while pulling D's KV is not held against P: the same P gets
    the turn again once, without D's params (the history is computed instead), and D's blocks are distrusted."""

    def __init__(
        self,
        prefill: Pool,
        decode: Pool,
        metrics: RouterMetrics,
        timeouts: Timeouts,
        client: Callable[[], UpstreamClient],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.metrics = metrics
        self.timeouts = timeouts
        self.client = client
        self.clock = clock

    def attempts(self, pool: Pool, affinity: bytes | None) -> Iterator[Upstream]:
        tried: set[str] = set()
        for attempt in range(len(pool.members)):
            member = pool.pick(affinity, tried)
            if member is None:
                return
            tried.add(member.name)
            if attempt:
                self.metrics.retries.labels(pool.role).inc()
            yield member

    def failed(self, pool: Pool, member: Upstream, kind: str) -> str:
        """Passive health + metrics for one failed upstream attempt; returns the text for the client's error."""
        pool.failure(member, kind)
        self.metrics.upstream_errors.labels(pool.role, member.name, kind).inc()
        return f"{pool.role} {member.name}: {kind}"

    async def call(self, url: str, payload: Any, headers: dict[str, str], read_timeout: float, method: str = "POST") -> Answer:
        data = None if payload is None else jsonbytes.dumps(payload)
        hdrs = dict(headers, **{"content-type": "application/json"}) if data is not None else headers
        return await self.client().fetch(method, url, data, hdrs, read_timeout)

    async def _prefill_once(
        self, member: Upstream, route: str, body: dict[str, Any], d_params: dict[str, Any] | None, headers: dict[str, str], salt: str | None
    ) -> Answer | str:
        t0 = time.perf_counter()
        with member.lease():
            try:
                answer = await self.call(member.url + route, prefill_body(body, d_params, salt), headers, self.timeouts.prefill)
            except UPSTREAM_ERRORS as exc:
                return type(exc).__name__
        self.metrics.child(self.metrics.upstream, "prefill").observe(time.perf_counter() - t0)
        return f"http_{answer.status}" if answer.status >= 500 else answer

    async def prefill(
        self,
        route: str,
        body: dict[str, Any],
        d_params: dict[str, Any] | None,
        d_holder: str | None,
        affinity: bytes | None,
        headers: dict[str, str],
        salt: str | None = None,
    ) -> Prefilled | Passthrough | NoUpstream:
        """P's part of the turn, in the generation the turn is settled in (generations.settle_turn); if that generation
        has lost its last P, on the newest other one that serves (rescued: computed, nothing stored offered)."""
        found = d_params is not None
        d_params, d_holder = generations.settle_turn(self.prefill_pool, self.decode_pool, d_params, d_holder, self.metrics)
        got = await self.prefill_in_generation(route, body, d_params, d_holder, affinity, headers, salt)
        if isinstance(got, NoUpstream) and generations.rescue(self.prefill_pool, self.decode_pool, self.metrics):
            d_params = None
            got = await self.prefill_in_generation(route, body, None, None, affinity, headers, salt)
        if found and d_params is None and isinstance(got, Prefilled):
            self.metrics.miss(contracts.MissCause.OTHER_GENERATION)
            got = Prefilled(got.params, got.member, got.fell_back, other_generation=True)
        return got

    async def prefill_in_generation(
        self,
        route: str,
        body: dict[str, Any],
        d_params: dict[str, Any] | None,
        d_holder: str | None,
        affinity: bytes | None,
        headers: dict[str, str],
        salt: str | None = None,
    ) -> Prefilled | Passthrough | NoUpstream:
        last = "no prefill upstream available"
        fell_back = False
        offered = d_params is not None
        for member in self.attempts(self.prefill_pool, affinity):
            while True:
                got = await self._prefill_once(member, route, body, d_params, headers, salt)
                if d_params is not None and (isinstance(got, str) or got.status != 200):
                    # The pull may be what failed (D restarted, blocks expired or freed): never the client's problem.
                    reason = got if isinstance(got, str) else f"http_{got.status}"
                    self.metrics.reuse_fallbacks.labels(reason).inc()
                    self.distrust(d_params, d_holder)
                    d_params, fell_back = None, True
                    continue
                break
            if isinstance(got, str):
                last = self.failed(self.prefill_pool, member, got)
                continue
            if got.status != 200:
                return Passthrough(got)
            self.prefill_pool.success(member)
            try:
                params = params_of(jsonbytes.loads(got.content))
            except ValueError:
                params = None
            outcome = params.get(contracts.PULL_OUTCOME) if params else None
            if isinstance(outcome, str):  # P's connector says what became of D's blocks (verified, cut, mismatch …)
                self.metrics.pull_outcomes.labels(outcome).inc()
            if offered:  # a stored location went to P: did P reuse it, and if not, why (bpdkv tune reads the causes)
                cause = settle_cause(outcome, fell_back, params.get(contracts.PULLED_TOKENS) if params else None)
                if cause is not None:
                    self.metrics.miss(cause)
            return Prefilled(params, member, fell_back)
        return NoUpstream(f"no prefill upstream succeeded ({last})")

    def distrust(self, d_params: dict[str, Any], holder: str | None) -> None:
        member = self.decode_pool.member(holder) if holder else None
        engine = d_params.get(contracts.REMOTE_ENGINE_ID)
        if member is not None and isinstance(engine, str):
            member.suspect_engine = engine

    async def decode(
        self, route: str, body: dict[str, Any], p_params: dict[str, Any] | None, headers: dict[str, str], stream: bool, hold: bool = True
    ) -> DecodedWhole | DecodeStream | Passthrough | NoUpstream:
        now = self.decode_pool.clock()
        if generations.stranded(self.decode_pool.members, now) and generations.rescuable(self.prefill_pool, self.decode_pool, now):
            # Every D of the turn's generation went (drained, ejected, unhealthy) while P computed, and another
            # generation serves: rescue there rather than try an ejected D (the pool's last resort when none serves).
            return NoUpstream(f"no decode upstream available in generation {generations.scope()}")
        payload = jsonbytes.dumps(decode_body(body, p_params, hold))
        return await self._decode_on(route, payload, headers, stream, self.attempts(self.decode_pool, None))

    async def rescue_decode(
        self,
        route: str,
        body: dict[str, Any],
        affinity: bytes | None,
        headers: dict[str, str],
        stream: bool,
        hold: bool = True,
        salt: str | None = None,
    ) -> DecodedWhole | DecodeStream | Passthrough | NoUpstream | None:
        """The D phase found no usable D in the turn's generation (nothing sent to the client yet): the turn again from
        its prompt on the newest other generation that serves, its P then its D — P's answer of the first generation is
        never given to a D of another. None: no other generation serves (the turn ends as before)."""
        if generations.rescue(self.prefill_pool, self.decode_pool, self.metrics) is None:
            return None
        again = await self.prefill_in_generation(route, body, None, None, affinity, headers, salt)
        if not isinstance(again, Prefilled):
            return again
        return await self.decode(route, body, again.params, headers, stream, hold)

    async def decode_local(
        self, route: str, body: dict[str, Any], member: Upstream, params: dict[str, Any], headers: dict[str, str], stream: bool, tokens: int
    ) -> DecodedWhole | DecodeStream | Passthrough | NoUpstream:
        """Path decode_local: the turn straight to the D holding the conversation (that one only: no other D has its
        history). While its prefill runs (until D's first byte), its new tokens count against that D's local budget."""
        payload = jsonbytes.dumps(dict(body, **{contracts.KV_TRANSFER_PARAMS: params}))
        member.local_tokens += tokens
        try:
            return await self._decode_on(route, payload, headers, stream, iter((member,)))
        finally:
            member.local_tokens -= tokens

    async def _decode_on(
        self, route: str, payload: bytes, headers: dict[str, str], stream: bool, members: Iterator[Upstream]
    ) -> DecodedWhole | DecodeStream | Passthrough | NoUpstream:
        t = self.timeouts
        last = "no decode upstream available"
        hdrs = dict(headers, **{"content-type": "application/json"})
        for member in members:
            t0 = time.perf_counter()
            incarnation = member.incarnation
            lease = member.lease()
            try:
                if stream:
                    got: Answer | UpstreamStream = await self.client().open_stream(
                        member.url + route, payload, hdrs, t.decode_first_byte, t.decode_idle
                    )
                else:
                    # A whole answer arrives at once: its read bound is the first-byte bound.
                    got = await self.client().fetch(
                        "POST", member.url + route, payload, hdrs, t.decode_first_byte, max(t.decode_first_byte, t.decode_idle)
                    )
            except UpstreamFailure as exc:
                lease.release()
                last = self.failed(self.decode_pool, member, type(exc).__name__)
                continue
            except BaseException:  # cancelled (client gone): nothing may stay open or counted
                lease.release()
                raise
            if isinstance(got, Answer):
                lease.release()
                if got.status >= 500:
                    last = self.failed(self.decode_pool, member, f"http_{got.status}")
                    continue
                self.decode_pool.success(member)
                self.metrics.child(self.metrics.upstream, "decode").observe(time.perf_counter() - t0)
                return DecodedWhole(got, member, incarnation) if got.status == 200 else Passthrough(got)
            self.decode_pool.success(member)
            self.metrics.child(self.metrics.upstream, "decode").observe(time.perf_counter() - t0)
            return DecodeStream(member, lease, got, incarnation)
        return NoUpstream(f"no decode upstream succeeded ({last})")
