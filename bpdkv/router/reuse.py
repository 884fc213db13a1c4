"""The reuse policy, beside the sessions it keeps: which stored D location a request may offer P (lookup), what is
stored after D's answer (remember), and what D announces (released holds, its engine). Its inputs: the router config
(reuse, TTLs), the session store, the decode pool's view of each D (health, restarts, engines), the clock."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from bpdkv import contracts
from bpdkv.contracts import MissCause
from bpdkv.router import paths, sessions
from bpdkv.router.config import RouterConfig
from bpdkv.router.metrics import RouterMetrics
from bpdkv.router.relay import Reply
from bpdkv.router.sessions import Reuse, Verdict
from bpdkv.router.turn import REUSABLE_FINISH, usable_d_params
from bpdkv.router.upstreams import Pool, Upstream

log = logging.getLogger("bpdkv.router")
# Keys of D's (or P's) answer that are news for the router, not part of where the blocks are.
ANNOUNCEMENT_KEYS = frozenset(
    {contracts.RELEASED_REQUEST_IDS, contracts.PULL_OUTCOME, contracts.PULLED_TOKENS, contracts.LOCAL_CACHED_TOKENS}
)


def release_key(decode: str, request_id: Any) -> str:
    return f"{decode}:{request_id}"


class ReusePolicy:
    def __init__(
        self,
        config: RouterConfig,
        store: sessions.SessionStore,
        decode: Pool,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        prefill: Pool | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.decode = decode
        self.prefill = prefill  # P's measured prefill rate prices a continued turn on a busy D (paths.py)
        self.metrics = metrics
        self.clock = clock
        self._warned_missing = False

    def observe_decode(self, member: Upstream, params: dict[str, Any] | None) -> None:
        """D's answer names the engine holding its blocks: a new one means it restarted (its older sessions are gone)."""
        engine = params.get(contracts.REMOTE_ENGINE_ID) if params else None
        if isinstance(engine, str):
            member.observe_engine(engine, self.clock(), fresh=True)

    async def lookup(self, ident: sessions.Identity | None) -> tuple[sessions.SessionEntry | None, Reuse]:
        if not self.config.reuse or ident is None:
            return None, Reuse.SKIPPED
        if not ident.lookup_keys:
            return None, Reuse.MISS  # first turn: nothing could have been stored yet
        now = self.clock()
        seen: list[Reuse] = []
        ended: list[float] = []  # when the turns of this history's entries ended (the turn gap metric)

        def judge(entry: sessions.SessionEntry) -> Verdict:
            if entry.expires_at <= now:
                seen.append(Reuse.EXPIRED)
                ended.append(entry.stored_at)
                return Verdict.DROP
            if not ident.covers(entry):
                seen.append(Reuse.MISMATCH)
                return Verdict.LEAVE  # another conversation's: neither consumed nor touched
            ended.append(entry.stored_at)
            holder = self.decode.member(entry.decode)
            if holder is None or not holder.holds(entry.params.get(contracts.REMOTE_ENGINE_ID), entry.stored_at):
                seen.append(Reuse.REFUSED)
                return Verdict.DROP
            if holder.generation != entry.generation:
                # A reloaded config moved that D to another generation (router/reload.py): its blocks are another
                # generation's; a worker that reloaded later may have stored this after this worker's reload.
                seen.append(Reuse.REFUSED)
                return Verdict.DROP
            return Verdict.TAKE

        try:
            entry, _ = await self.store.take(list(ident.lookup_keys), judge, ident.accepted_histories())
            if entry is None and not seen:  # gone from the store: its end, kept longer, says why (and the gap)
                end = await self.store.turn_end(list(ident.lookup_keys))
                if end is not None:
                    ended.append(end[0])
                    seen.append(Reuse.EXPIRED if end[1] <= now else Reuse.MISS)
        except sessions.StoreUnavailable:
            self.metrics.store_errors.inc()
            self.metrics.miss(MissCause.STORE_UNAVAILABLE)
            return None, Reuse.UNAVAILABLE
        if ended:
            self.metrics.gap(now - max(ended))
        if entry is not None:
            try:
                if await self.store.is_released(release_key(entry.decode, entry.params.get(contracts.REMOTE_REQUEST_ID))):
                    self.metrics.miss(MissCause.RELEASED)
                    return None, Reuse.REFUSED  # D gave those blocks up (hold budget): they may hold others' KV now
            except sessions.StoreUnavailable:
                self.metrics.store_errors.inc()
                self.metrics.miss(MissCause.STORE_UNAVAILABLE)
                return None, Reuse.UNAVAILABLE  # cannot tell: never risk another conversation's KV
            return entry, ident.outcome_of(entry)
        for outcome, cause in (
            (Reuse.REFUSED, MissCause.RESTARTED),
            (Reuse.EXPIRED, MissCause.EXPIRED),
            (Reuse.MISMATCH, MissCause.OTHER_HISTORY),
        ):
            if outcome in seen:
                self.metrics.miss(cause)
                return None, outcome
        self.metrics.miss(MissCause.CONSUMED if ended else MissCause.NOTHING_STORED)
        return None, Reuse.MISS

    async def remember(self, ident: sessions.Identity, body: dict[str, Any], reply: Reply, decode: str, generation: str = "") -> None:
        params = {k: v for k, v in (reply.params or {}).items() if k not in ANNOUNCEMENT_KEYS}
        ttl = self.config.session_ttl
        # A patched D (bpdkv node plugin) says how long its blocks live in relative seconds, which needs no clock sync.
        expires_in = params.get(contracts.REMOTE_BLOCKS_EXPIRES_IN)
        if isinstance(expires_in, (int, float)):
            ttl = min(ttl, float(expires_in) - self.config.expiry_margin)
        if ttl <= 0:
            return
        now = self.clock()
        target = sessions.to_store(ident, body, reply.message(), params, decode, now)
        if target is None:
            return
        key, entry, only_if_absent = target
        entry.expires_at = now + ttl
        entry.generation = generation
        try:
            if await self.store.put(key, entry, ttl, only_if_absent):
                self.metrics.stored.inc()
            else:
                self.metrics.store_refused.inc()
        except sessions.StoreUnavailable:
            self.metrics.store_errors.inc()

    async def after_decode(self, ident: sessions.Identity | None, body: dict[str, Any], reply: Reply, member: Upstream) -> None:
        self.observe_decode(member, reply.params)
        await self.note_released(member, reply.params)
        if not self.config.reuse or ident is None:
            return
        if reply.params is None:
            if reply.finish_reason in REUSABLE_FINISH:
                self._d_params_missing(member)
            return
        if reply.finish_reason in REUSABLE_FINISH and usable_d_params(reply.params):
            await self.remember(ident, body, reply, member.name, member.generation)

    async def note_released(self, member: Upstream, params: dict[str, Any] | None) -> None:
        """D (bpdkv plugin, hold budget) names held blocks it let go since its previous answer; whichever router
        worker hears it, every worker must refuse entries pointing at them (the store shares the marks)."""
        ids = params.get(contracts.RELEASED_REQUEST_IDS) if params else None
        if not isinstance(ids, list) or not ids:
            return
        keys = [release_key(member.name, rid) for rid in ids if isinstance(rid, str)]
        self.metrics.released.inc(len(keys))
        try:
            await self.store.mark_released(keys, self.config.session_ttl + self.config.expiry_margin)
        except sessions.StoreUnavailable:
            self.metrics.store_errors.inc()

    def _d_params_missing(self, member: Upstream) -> None:
        self.metrics.d_params_missing.inc()
        if not self._warned_missing:
            self._warned_missing = True
            log.warning(
                "decode %s returned no kv_transfer_params; reuse needs the bpdkv node plugin (vLLM streams carry none)", member.name
            )

    def choose_path(
        self,
        ident: sessions.Identity | None,
        entry: sessions.SessionEntry | None,
        body: dict[str, Any],
        outcome: Reuse,
        local_allowed: bool,
    ) -> paths.PathDecision:
        """This turn's path (paths.py) from what the lookup found and the holding D's state and load."""
        settings = self.config.paths
        if ident is None or entry is None:
            return paths.decide(paths.inputs_for(False, None, local_allowed, None, 0.0), settings)
        new_tokens = paths.estimate_new_tokens(ident, entry, body, outcome, settings.chars_per_token)
        holder = self.decode.member(entry.decode)
        now = time.monotonic()
        rate = paths.prefill_rate(self.prefill.members, now) if self.prefill is not None else None
        decision = paths.decide(paths.inputs_for(True, new_tokens, local_allowed, holder, now, rate), settings)
        if new_tokens is not None:
            self.metrics.child(self.metrics.new_tokens, decision.path.value).observe(new_tokens)
        return decision
