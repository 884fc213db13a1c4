"""`bpdkv tune`: the fleet's reuse settings and P:D sizing, recommended from its own traffic.

Three steps, each its own function:
- read: the series over a window, from the live fleet's /metrics sampled for a while (`watch`) or from a Prometheus
  server (`prometheus`), into one `Signals` value;
- recommend: pure functions from `Signals` and the current settings (`Current`, from the topology) to one
  `Recommendation` per setting: the value, the evidence, the predicted effect — or "too little data", never a guess;
- show: a table, JSON, and a topology override fragment.

The series (docs/operations.md, Tuning): the router's turn gap histogram and its reuse misses by cause
(bpdkv/router/metrics.py, names in bpdkv.contracts), its reuse outcomes and stored locations, its mirror of each
engine's queue and KV use (vLLM's own num_requests_waiting and kv_cache_usage_perc, read by the router), and D's held
blocks and hold budget (the node plugin's gauges on D's /metrics).
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from bpdkv import contracts
from bpdkv.contracts import MissCause
from bpdkv.errors import BpdkvError
from bpdkv.topology.capacity import HOST_TIER_MAX_SHARE, instance_capacity

# Below these, a setting gets "too little data" instead of a recommendation.
MIN_GAPS = 30  # turn gaps in the window (the TTL)
MIN_CONTINUED = 30  # continued turns (the hold budget, local_max_tokens)
MIN_SAMPLES = 3  # scrapes of the engines' queues (the P:D ratio)
MIN_REQUESTS = 10  # requests finished in the window (the P:D ratio, where nothing queued or was in flight)
TTL_QUANTILE = 0.9  # the TTL covers this share of the turn gaps
TTL_STEP = 10  # seconds: recommended TTLs are rounded up to this
QUEUED = 1.0  # mean requests waiting per instance above which a role queues
HOLD_BUDGET_STEP = 0.1
HOLD_BUDGET_MAX = 0.8
D_KV_BUSY = 0.85  # D's mean KV use above which held blocks crowd its live decodes
MARGIN_EXPIRING_SHARE = 0.02  # continued turns P found expiring on D above which the router's margin doubles

# Recommendation.capped_by: D's hold budget holds less than the TTL the gaps ask for.
CAPPED_BY_HOLD_BUDGET = "kv_hold_budget"

Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), +Inf last
# vLLM's own series of an engine's queue and KV use (bpdkv/router/engines.py reads the same).
ENGINE_WAITING = "vllm:num_requests_waiting"
ENGINE_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


class TuneError(BpdkvError):
    """The series could not be read (a URL down, a Prometheus error): one line."""


@dataclass(frozen=True)
class Signals:
    """What the fleet showed over a window (counters: increase over the window; gauges: mean over it)."""

    window_s: float
    samples: int = 0  # scrapes (watch) or 0 (a Prometheus range)
    gaps: Buckets = ()
    misses: Mapping[str, float] = field(default_factory=dict)  # cause -> count
    outcomes: Mapping[str, float] = field(default_factory=dict)  # reuse outcome -> count
    stored: float = 0.0  # D locations stored for a next turn
    waiting: Mapping[str, float] = field(default_factory=dict)  # role -> mean requests waiting per instance
    kv_usage: Mapping[str, float] = field(default_factory=dict)  # role -> mean KV cache use, 0..1
    held_share: float | None = None  # D: mean held blocks / KV blocks
    budget_share: float | None = None  # D: hold budget blocks / KV blocks
    local_turns: float = 0.0  # continued turns that ran on the holding D (path decode_local)
    new_tokens: Buckets = ()  # new tokens of continued turns that went through P (path prefill_pull)
    requests: float = 0.0  # client requests the routers finished
    in_flight: float = 0.0  # mean client requests in flight at the routers


@dataclass(frozen=True)
class Current:
    """The settings now (the topology)."""

    ttl_s: int
    ttl_margin_s: int
    hold_budget: float
    local_max_tokens: int
    prefill: int
    decode: int
    # The host-memory tier (kv_host_memory_gib): one D engine's HBM KV cache in GiB (capacity model; None: sizes unknown),
    # its host tier now, and its node's RAM (None: not in the topology).
    d_kv_gib: float | None = None
    host_tier_gib: float = 0.0
    host_ram_gib: float | None = None


@dataclass(frozen=True)
class Recommendation:
    setting: str
    current: Any
    recommended: Any  # None: too little data, or nothing to change (see `evidence`)
    evidence: str
    effect: str = ""
    predicted: Mapping[str, float] = field(default_factory=dict)  # numbers behind `effect`, for automation
    capped_by: str = ""  # the limit that kept `recommended` below what the traffic asks (CAPPED_BY_*), "" when none

    @property
    def changes(self) -> bool:
        return self.recommended is not None and self.recommended != self.current


# ---- estimators (pure) ------------------------------------------------------------------------------------------------
def total(buckets: Buckets) -> float:
    return buckets[-1][1] if buckets else 0.0


def cdf(buckets: Buckets, x: float) -> float:
    """Share of observations ≤ x, interpolated linearly inside its bucket (as Prometheus' histogram_quantile does)."""
    n = total(buckets)
    if n <= 0:
        return 0.0
    lower, below = 0.0, 0.0
    for bound, cum in buckets:
        if x < bound:
            if math.isinf(bound):
                return below / n
            return (below + (cum - below) * max(x - lower, 0.0) / (bound - lower)) / n
        lower, below = bound, cum
    return 1.0


def quantile(buckets: Buckets, q: float) -> float | None:
    """The q-quantile, interpolated inside its bucket; None when empty or when it falls in the +Inf bucket."""
    n = total(buckets)
    if n <= 0:
        return None
    rank = q * n
    lower, below = 0.0, 0.0
    for bound, cum in buckets:
        if cum >= rank and cum > below:
            if math.isinf(bound):
                return None
            return lower + (bound - lower) * (rank - below) / (cum - below)
        lower, below = bound, cum
    return None


def mean_hold(buckets: Buckets, never_back: float, ttl: float) -> float:
    """Mean seconds a stored location is held at this TTL: min(gap, ttl) for turns that came back, the whole TTL for
    conversations that never did (their last turn's hold runs out)."""
    n = total(buckets) + never_back
    if n <= 0:
        return 0.0
    held, lower, below = 0.0, 0.0, 0.0
    for bound, cum in buckets:
        count = cum - below
        top = ttl if math.isinf(bound) else min(bound, ttl)
        if lower >= ttl or math.isinf(bound):
            held += count * ttl
        else:
            # uniform inside the bucket: the mean of min(g, ttl) for g in [lower, bound]
            width = bound - lower
            inside = (top - lower) * (top + lower) / 2 / width + (bound - top) * ttl / width if width > 0 else min(bound, ttl)
            held += count * inside
        lower, below = bound, cum
    return (held + never_back * ttl) / n


def _pct(x: float) -> str:
    return f"{x * 100:.0f} %"


def _n(x: float) -> str:
    return f"{x:,.0f}"


def continued_turns(s: Signals) -> float:
    hits = s.outcomes.get("hit", 0.0) + s.outcomes.get("partial", 0.0)
    return hits + sum(s.misses.values())


@dataclass(frozen=True)
class TtlPrediction:
    """What one TTL would give, from the window's gaps and D's hold gauges (pure; see `predict_ttl`)."""

    ttl: int
    hit_rate: float  # of returning turns
    at_most: bool  # no turn came within the TTL in the window: the histogram's bound, not a prediction
    held_ratio: float | None  # mean hold at this TTL / at the current one (None: nothing held now)
    held_share: float | None  # D's held KV / its cache at this TTL (None: no hold gauges from D)


def predict_ttl(s: Signals, c: Current, ttl: int) -> TtlPrediction:
    """The hit rate of returning turns and D's held share at this TTL, no hold released early: the turns whose gap
    fits the TTL (less the router's margin) hit as often as the turns within today's TTL did; D holds in proportion
    to the mean time a stored location is held (gaps of turns that came back, the whole TTL for those that did not)."""
    n = total(s.gaps)
    expired = s.misses.get(MissCause.EXPIRED.value, 0.0)
    hits = s.outcomes.get("hit", 0.0) + s.outcomes.get("partial", 0.0)
    within = n - expired  # turns with a known gap that came within the TTL
    share = cdf(s.gaps, ttl - c.ttl_margin_s)
    rate = share * min(hits / within, 1.0) if within > 0 else share
    never_back = max(s.stored - n, 0.0)
    hold_now = mean_hold(s.gaps, never_back, c.ttl_s - c.ttl_margin_s)
    ratio = mean_hold(s.gaps, never_back, ttl - c.ttl_margin_s) / hold_now if hold_now > 0 else None
    held = s.held_share * ratio if s.held_share is not None and ratio is not None else None
    return TtlPrediction(ttl, rate, within <= 0, ratio, held)


def hold_budget_share(s: Signals, c: Current) -> float | None:
    """D's hold budget as a share of its cache: D's own gauge, else the topology's (where D reports what it holds)."""
    if s.held_share is None:
        return None
    return s.budget_share if s.budget_share is not None else c.hold_budget


def ttl_within_budget(s: Signals, c: Current, most: int, budget: float) -> TtlPrediction | None:
    """The longest TTL up to `most` (a multiple of TTL_STEP, or the current TTL) whose holds fit the budget; None when
    not even the shortest does. D's held share grows with the TTL (mean_hold), so the fitting TTLs are the short ones."""
    candidates = sorted({*range(TTL_STEP, most + 1, TTL_STEP), *([c.ttl_s] if c.ttl_s <= most else [])}, reverse=True)
    for ttl in candidates:
        if ttl <= c.ttl_margin_s:
            break
        got = predict_ttl(s, c, ttl)
        if got.held_share is not None and got.held_share <= budget + 1e-9:
            return got
    return None


def budget_for(held_share: float) -> float:
    """The hold budget (a HOLD_BUDGET_STEP multiple) that holds this share of D's cache."""
    return round(math.ceil(held_share / HOLD_BUDGET_STEP - 1e-9) * HOLD_BUDGET_STEP, 2)


def _hit_text(before: float, p: TtlPrediction) -> str:
    return f"{_pct(before)} → {'at most ' if p.at_most else ''}{_pct(p.hit_rate)}"


def recommend_ttl(s: Signals, c: Current) -> Recommendation:
    """The TTL that covers the p90 of the turn gaps (plus the router's margin) — capped at what D's hold budget can
    hold: past it D releases the oldest holds early, so a longer TTL buys no hits (they are lost as `released` misses
    instead of `expired` ones) and the hit rate it predicts would not come. The cap, what it costs and the budget
    that would lift it are in the evidence, the effect and `predicted`."""
    n = total(s.gaps)
    name = "decoder_kv_blocks_ttl"
    if n < MIN_GAPS:
        return Recommendation(name, c.ttl_s, None, f"too little data: {_n(n)} turn gaps (need {MIN_GAPS})")
    p = quantile(s.gaps, TTL_QUANTILE)
    misses = sum(s.misses.values())
    expired = s.misses.get(MissCause.EXPIRED.value, 0.0)
    share = f"; {_pct(expired / misses)} of {_n(misses)} misses expired" if misses else ""
    if p is None:
        return Recommendation(
            name, c.ttl_s, None, f"p{TTL_QUANTILE * 100:.0f} of {_n(n)} turn gaps is beyond the histogram's last bucket{share}"
        )
    wanted = int(math.ceil((p + c.ttl_margin_s) / TTL_STEP) * TTL_STEP)
    evidence = f"p{TTL_QUANTILE * 100:.0f} of {_n(n)} turn gaps = {p:.0f} s{share}"
    hits = s.outcomes.get("hit", 0.0) + s.outcomes.get("partial", 0.0)
    before = hits / n
    predicted: dict[str, float] = {"think_p90_s": round(p, 1), "hit_rate_before": round(before, 3), "gaps": n}
    want = predict_ttl(s, c, wanted)
    budget = hold_budget_share(s, c)
    if want.held_share is None or budget is None or want.held_share <= budget + 1e-9:
        return Recommendation(name, c.ttl_s, wanted, evidence, _ttl_effect(s, before, want, budget), {**predicted, **_ttl_numbers(want)})

    # Over D's hold budget: cap the TTL at what the budget holds, and say what lifting the budget would give.
    needed = budget_for(want.held_share)
    held_uncapped = round(want.held_share, 3)  # the evidence, the JSON and the override's comment say one number
    over = (
        f"{wanted} s would hold {_pct(held_uncapped)} of D's cache, over its hold budget {_pct(budget)} "
        f"(D would release holds early: misses `released`)"
    )
    predicted.update(
        ttl_uncapped=wanted,
        hit_rate_uncapped=round(want.hit_rate, 3),
        held_share_uncapped=held_uncapped,
        hold_budget_share=round(budget, 3),
        hold_budget_needed=needed,
    )
    lift = f"kv_hold_budget {needed:g} would allow {wanted} s: hit rate {_pct(want.hit_rate)}"
    if needed > HOLD_BUDGET_MAX:
        widest = ttl_within_budget(s, c, wanted, HOLD_BUDGET_MAX)
        room = "more than D's cache" if needed > 1.0 else f"more than a hold budget should take ({HOLD_BUDGET_MAX:g})"
        lift = f"{wanted} s needs kv_hold_budget {needed:g}, {room}: add D"
        if widest is not None and widest.ttl > c.ttl_s:
            predicted.update(ttl_at_max_budget=widest.ttl, hit_rate_at_max_budget=round(widest.hit_rate, 3))
            lift += f"; kv_hold_budget {HOLD_BUDGET_MAX:g} would allow {widest.ttl} s: hit rate {_pct(widest.hit_rate)}"
    capped = ttl_within_budget(s, c, wanted, budget)
    if capped is None:
        evidence += f"; no TTL fits D's hold budget {_pct(budget)} (D holds {_pct(s.held_share or 0.0)} of its cache already)"
        return Recommendation(name, c.ttl_s, None, evidence, f"{over}; {lift}", predicted, capped_by=CAPPED_BY_HOLD_BUDGET)
    evidence += f"; capped at {capped.ttl} s by D's hold budget: {over}"
    effect = f"at {capped.ttl} s (capped by the hold budget): {_ttl_effect(s, before, capped, budget)}; {lift}"
    return Recommendation(
        name, c.ttl_s, capped.ttl, evidence, effect, {**predicted, **_ttl_numbers(capped)}, capped_by=CAPPED_BY_HOLD_BUDGET
    )


def _ttl_numbers(p: TtlPrediction) -> dict[str, float]:
    out = {("hit_rate_predicted_max" if p.at_most else "hit_rate_predicted"): round(p.hit_rate, 3)}
    if p.held_ratio is not None:
        out["held_ratio"] = round(p.held_ratio, 2)
    if p.held_share is not None:
        out["held_share_predicted"] = round(p.held_share, 3)
    return out


def _ttl_effect(s: Signals, before: float, p: TtlPrediction, budget: float | None) -> str:
    effect = f"hit rate of returning turns {_hit_text(before, p)}" + (" (no turn within the TTL yet)" if p.at_most else "")
    if p.held_ratio is None:
        return effect
    if p.held_share is None or s.held_share is None:
        return effect + f"; D's held KV ×{p.held_ratio:.2f} (no hold gauges from D)"
    within = f" (hold budget {_pct(budget)})" if budget is not None else ""
    return effect + f"; D's held KV {_pct(s.held_share)} → {_pct(p.held_share)} of its cache{within}"


def recommend_hold_budget(s: Signals, c: Current) -> Recommendation:
    name = "kv_hold_budget"
    turns = continued_turns(s)
    if turns < MIN_CONTINUED:
        return Recommendation(name, c.hold_budget, None, f"too little data: {_n(turns)} continued turns (need {MIN_CONTINUED})")
    released = s.misses.get(MissCause.RELEASED.value, 0.0)
    d_kv = s.kv_usage.get("decode")
    held = f"; D held {_pct(s.held_share)} of its cache on average" if s.held_share is not None else ""
    evidence = f"{_pct(released / turns)} of {_n(turns)} continued turns lost to holds D released early{held}"
    if d_kv is not None:
        evidence += f"; D's KV use {_pct(d_kv)}"
    if released / turns >= 0.05:
        if d_kv is None:
            return Recommendation(name, c.hold_budget, None, evidence + "; no KV use from D, so no room can be judged")
        if d_kv < D_KV_BUSY and c.hold_budget < HOLD_BUDGET_MAX:
            budget = round(min(c.hold_budget + HOLD_BUDGET_STEP, HOLD_BUDGET_MAX), 2)
            return Recommendation(name, c.hold_budget, budget, evidence, f"up to {_n(released)} more reuses in such a window")
        return Recommendation(name, c.hold_budget, c.hold_budget, evidence + ": D has no room for more holds (add D instead)")
    if d_kv is not None and d_kv >= D_KV_BUSY and s.waiting.get("decode", 0.0) >= QUEUED and c.hold_budget > HOLD_BUDGET_STEP:
        budget = round(c.hold_budget - HOLD_BUDGET_STEP, 2)
        return Recommendation(name, c.hold_budget, budget, evidence + "; D queues", "more room for D's live decodes")
    return Recommendation(name, c.hold_budget, c.hold_budget, evidence)


def recommend_local_max_tokens(s: Signals, c: Current) -> Recommendation:
    name = "paths.local_max_tokens"
    through_p = total(s.new_tokens)
    turns = through_p + s.local_turns
    if turns < MIN_CONTINUED or "decode" not in s.waiting:
        return Recommendation(name, c.local_max_tokens, None, f"too little data: {_n(turns)} continued turns with a path decided")
    d_wait = s.waiting["decode"]
    evidence = f"{_pct(s.local_turns / turns)} of {_n(turns)} continued turns ran on D; D's queue {d_wait:.2f} waiting on average"
    if d_wait >= QUEUED and c.local_max_tokens > 0:
        return Recommendation(name, c.local_max_tokens, c.local_max_tokens // 2, evidence, "fewer local prefills on a queueing D")
    if d_wait < QUEUED / 10 and c.local_max_tokens > 0 and through_p:
        near = cdf(s.new_tokens, 2 * c.local_max_tokens) - cdf(s.new_tokens, c.local_max_tokens)
        evidence += f"; {_pct(near)} of the turns through P had {c.local_max_tokens}-{2 * c.local_max_tokens} new tokens"
        if near >= 0.2:
            return Recommendation(
                name, c.local_max_tokens, 2 * c.local_max_tokens, evidence, f"about {_n(near * through_p)} turns more skip P"
            )
    return Recommendation(name, c.local_max_tokens, c.local_max_tokens, evidence)


def recommend_ratio(s: Signals, c: Current) -> Recommendation:
    name = "P:D"
    now = f"{c.prefill}:{c.decode}"
    if "prefill" not in s.waiting or "decode" not in s.waiting:
        return Recommendation(name, now, None, "too little data: no queue readings of both P and D")
    if s.samples and s.samples < MIN_SAMPLES:
        return Recommendation(name, now, None, f"too little data: {s.samples} queue readings (need {MIN_SAMPLES})")
    qp, qd = s.waiting["prefill"], s.waiting["decode"]
    if qp <= 0 and qd <= 0 and s.in_flight <= 0 and s.requests < MIN_REQUESTS:
        # Nothing queued because nothing came: no queue is no evidence that the sizing fits.
        idle = f"{_n(s.requests)} requests finished in the window (need {MIN_REQUESTS}), none queued or in flight"
        return Recommendation(name, now, None, f"too little data: {idle}")
    kd = s.kv_usage.get("decode", 0.0)
    evidence = f"mean waiting per instance: P {qp:.2f}, D {qd:.2f}; D's KV use {_pct(kd)}"
    if qp >= QUEUED and qp > 2 * qd:
        after = qp * c.prefill / (c.prefill + 1)
        return Recommendation(
            name, now, f"{c.prefill + 1}:{c.decode}", evidence + ": P queues", f"P's queue {qp:.2f} → about {after:.2f} per P"
        )
    if (qd >= QUEUED and qd > 2 * qp) or (kd >= 0.95 and qd >= QUEUED):
        after = qd * c.decode / (c.decode + 1)
        return Recommendation(
            name, now, f"{c.prefill}:{c.decode + 1}", evidence + ": D queues", f"D's queue {qd:.2f} → about {after:.2f} per D"
        )
    return Recommendation(name, now, now, evidence + ": neither side queues much more than the other")


def recommend_margin(s: Signals, c: Current) -> Recommendation:
    """The router's TTL margin: turns the router offered P within its TTL but that P found about to expire on D (D's
    and the router's clocks of one hold differ by the answer's way back, P's pull by its own time)."""
    name = "router.ttl_margin"
    turns = continued_turns(s)
    if turns < MIN_CONTINUED:
        return Recommendation(name, c.ttl_margin_s, None, f"too little data: {_n(turns)} continued turns (need {MIN_CONTINUED})")
    expiring = s.misses.get(MissCause.EXPIRING.value, 0.0)
    evidence = f"{_pct(expiring / turns)} of {_n(turns)} continued turns reached P with D's hold about to expire"
    if expiring / turns >= MARGIN_EXPIRING_SHARE:
        return Recommendation(
            name, c.ttl_margin_s, 2 * c.ttl_margin_s, evidence, f"up to {_n(expiring)} fewer such misses in such a window"
        )
    return Recommendation(name, c.ttl_margin_s, c.ttl_margin_s, evidence)


HOST_TIER_STEP_GIB = 8  # recommended host tiers are rounded up to this
HOST_TIER_HEADROOM = 1.25  # the tier holds this much more than the mean excess: holds come in bursts


def recommend_host_tier(s: Signals, c: Current) -> Recommendation:
    """D's host-memory tier (kv_host_memory_gib) from the same signals as the TTL: the holds the turn gaps ask for
    beyond what D's hold budget keeps in HBM, in GiB of D's KV cache, with headroom — and the hit rate of returning
    turns predicted with the tier (the TTL the gaps ask for, every hold kept: in HBM or in host memory) against HBM only
    (the TTL capped by the budget). A reload from host memory is counted as a hit: it costs PCIe time, not a prefill."""
    name = "kv_host_memory_gib"
    n = total(s.gaps)
    if n < MIN_GAPS:
        return Recommendation(name, c.host_tier_gib, None, f"too little data: {_n(n)} turn gaps (need {MIN_GAPS})")
    p = quantile(s.gaps, TTL_QUANTILE)
    budget = hold_budget_share(s, c)
    if p is None or budget is None:
        why = "the gaps' p90 is beyond the histogram's last bucket" if p is None else "no hold gauges from D"
        return Recommendation(name, c.host_tier_gib, None, f"{why}: what D holds cannot be predicted")
    wanted = int(math.ceil((p + c.ttl_margin_s) / TTL_STEP) * TTL_STEP)
    want = predict_ttl(s, c, wanted)
    if want.held_share is None or want.held_share <= budget + 1e-9:
        evidence = (
            f"the turn gaps' TTL ({wanted} s) holds {_pct(want.held_share or 0.0)} of D's cache, within its hold budget {_pct(budget)}"
        )
        return Recommendation(name, c.host_tier_gib, c.host_tier_gib, evidence + ": HBM holds it all")
    excess = want.held_share - budget
    hbm = ttl_within_budget(s, c, wanted, budget)
    hbm_rate = hbm.hit_rate if hbm is not None else 0.0
    predicted: dict[str, float] = {
        "hit_rate_hbm_only": round(hbm_rate, 3),
        "hit_rate_with_tier": round(want.hit_rate, 3),
        "ttl_with_tier": wanted,
        "excess_share_of_d_kv": round(excess, 3),
    }
    evidence = (
        f"{wanted} s (p{TTL_QUANTILE * 100:.0f} of {_n(n)} turn gaps + margin) would hold {_pct(want.held_share)} of D's cache, "
        f"{_pct(excess)} over its hold budget {_pct(budget)}"
    )
    effect = f"hit rate of returning turns {_pct(hbm_rate)} (HBM only) → {_pct(want.hit_rate)} (with the tier)"
    if c.d_kv_gib is None:
        return Recommendation(
            name, c.host_tier_gib, None, evidence + "; D's KV cache size is unknown (model sizes or GPU memory)", effect, predicted
        )
    need = excess * c.d_kv_gib * HOST_TIER_HEADROOM
    size = int(math.ceil(need / HOST_TIER_STEP_GIB) * HOST_TIER_STEP_GIB)
    predicted.update(host_tier_needed_gib=round(need, 1), d_kv_gib=round(c.d_kv_gib, 1))
    evidence += f" = {excess * c.d_kv_gib:.1f} GiB of D's {c.d_kv_gib:.0f} GiB KV cache (x{HOST_TIER_HEADROOM:g} headroom)"
    if c.host_ram_gib is not None:
        room = int(c.host_ram_gib * HOST_TIER_MAX_SHARE // HOST_TIER_STEP_GIB * HOST_TIER_STEP_GIB)
        if size > room:
            predicted["host_tier_room_gib"] = room
            evidence += f"; capped at {room} GiB by the node's {c.host_ram_gib:g} GiB RAM ({_pct(HOST_TIER_MAX_SHARE)})"
            size = room
    effect += "; needs D's plugin to demote held blocks to the tier instead of releasing them"
    return Recommendation(name, c.host_tier_gib, size, evidence, effect, predicted)


def recommend(s: Signals, c: Current) -> list[Recommendation]:
    steps = (recommend_ttl, recommend_margin, recommend_hold_budget, recommend_local_max_tokens, recommend_ratio, recommend_host_tier)
    return [f(s, c) for f in steps]


# ---- reading the series -----------------------------------------------------------------------------------------------
Sample = tuple[str, Mapping[str, str], float]


def parse_exposition(text: str) -> list[Sample]:
    """Prometheus text → (name, labels, value) samples, through prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return [(s.name, dict(s.labels), float(s.value)) for fam in text_string_to_metric_families(text) for s in fam.samples]
    except ValueError as exc:
        raise TuneError(f"not Prometheus text: {exc}") from None


def _sum(samples: Iterable[Sample], name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def _by(samples: Iterable[Sample], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for n, lab, v in samples:
        if n == name and label in lab:
            out[lab[label]] = out.get(lab[label], 0.0) + v
    return out


def _buckets(samples: Iterable[Sample], name: str, **labels: str) -> Buckets:
    by_le: dict[float, float] = {}
    for n, lab, v in samples:
        if n == name + "_bucket" and all(lab.get(k) == x for k, x in labels.items()):
            le = float(lab["le"])
            by_le[le] = by_le.get(le, 0.0) + v
    return tuple(sorted(by_le.items()))


def _minus(a: Buckets, b: Buckets) -> Buckets:
    before = dict(b)
    return tuple((le, max(v - before.get(le, 0.0), 0.0)) for le, v in a)


def _mean_per_role(scrapes: list[list[Sample]], name: str) -> dict[str, float]:
    """Mean over scrapes of the per-upstream mean, per role label."""
    per_role: dict[str, list[float]] = {}
    for samples in scrapes:
        values: dict[str, list[float]] = {}
        for n, lab, v in samples:
            if n == name and "role" in lab:
                values.setdefault(lab["role"], []).append(v)
        for role, vs in values.items():
            per_role.setdefault(role, []).append(sum(vs) / len(vs))
    return {role: sum(vs) / len(vs) for role, vs in per_role.items()}


def engine_means(scrapes: list[list[list[Sample]]]) -> tuple[float | None, float | None]:
    """(mean requests waiting per instance, mean KV use) of one role from vLLM's own series: per scrape the mean over
    the instances that answered (an instance's DP engines summed, their KV use averaged), then the mean over scrapes."""
    waits: list[float] = []
    kvs: list[float] = []
    for instances in scrapes:
        w = [_sum(s, ENGINE_WAITING) for s in instances if any(n == ENGINE_WAITING for n, _, _ in s)]
        k = [sum(kv) / len(kv) for kv in ([v for n, _, v in s if n in ENGINE_KV_USAGE] for s in instances) if kv]
        if w:
            waits.append(sum(w) / len(w))
        if k:
            kvs.append(sum(k) / len(k))
    return (sum(waits) / len(waits) if waits else None, sum(kvs) / len(kvs) if kvs else None)


def signals_from_scrapes(
    router: list[list[Sample]], decode: list[list[Sample]], window_s: float, engines: Mapping[str, list[list[list[Sample]]]] | None = None
) -> Signals:
    """Signals from successive scrapes of the routers' (summed) and D's /metrics: counters as last - first, gauges as
    their mean over the scrapes. engines (role → per scrape, per instance): vLLM's own queue and KV series, read
    where given; else the router's mirror of them (bpdkv_router_engine_*, as fresh as its paths.load_interval)."""
    if len(router) < 2:
        raise TuneError("need at least two scrapes of the router's /metrics")
    first, last = router[0], router[-1]

    def delta_by(name: str, label: str) -> dict[str, float]:
        a, b = _by(last, name, label), _by(first, name, label)
        return {k: max(v - b.get(k, 0.0), 0.0) for k, v in a.items()}

    held = [
        (_sum(s, "vllm:bpdkv_held_blocks"), _sum(s, "vllm:bpdkv_hold_budget_blocks"), _sum(s, "vllm:bpdkv_kv_blocks_total")) for s in decode
    ]
    held = [h for h in held if h[2] > 0]
    waiting = _mean_per_role(router, "bpdkv_router_engine_waiting")
    kv_usage = _mean_per_role(router, "bpdkv_router_engine_kv_usage")
    for role, scrapes in (engines or {}).items():
        w, k = engine_means(scrapes)
        if w is not None:
            waiting[role] = w
        if k is not None:
            kv_usage[role] = k
    return Signals(
        window_s=window_s,
        samples=len(router),
        gaps=_minus(_buckets(last, contracts.TURN_GAP_METRIC), _buckets(first, contracts.TURN_GAP_METRIC)),
        misses=delta_by(contracts.REUSE_MISSES_METRIC + "_total", "cause"),
        outcomes=delta_by(contracts.REUSE_OUTCOME_METRIC + "_total", "outcome"),
        stored=max(_sum(last, "bpdkv_router_sessions_stored_total") - _sum(first, "bpdkv_router_sessions_stored_total"), 0.0),
        waiting=waiting,
        kv_usage=kv_usage,
        held_share=sum(h[0] / h[2] for h in held) / len(held) if held else None,
        budget_share=sum(h[1] / h[2] for h in held) / len(held) if held else None,
        local_turns=max(
            _sum(last, "bpdkv_router_paths_total", path="decode_local") - _sum(first, "bpdkv_router_paths_total", path="decode_local"), 0.0
        ),
        new_tokens=_minus(
            _buckets(last, "bpdkv_router_turn_new_tokens", path="prefill_pull"),
            _buckets(first, "bpdkv_router_turn_new_tokens", path="prefill_pull"),
        ),
        requests=max(_sum(last, "bpdkv_router_requests_total") - _sum(first, "bpdkv_router_requests_total"), 0.0),
        in_flight=sum(_sum(s, "bpdkv_router_in_flight") for s in router) / len(router),
    )


def fetch_text(url: str, timeout: float = 10.0) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - the operator's own fleet
            return str(resp.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise TuneError(f"{url}: {getattr(exc, 'reason', exc)}") from None


def watch(
    routers: list[str],
    decodes: list[str],
    duration_s: float,
    interval_s: float = 5.0,
    fetch: Callable[[str], str] = fetch_text,
    sleep: Callable[[float], None] = time.sleep,
    prefills: list[str] | None = None,
) -> Signals:
    """Scrape the routers', D's (and P's) /metrics every interval for duration (at least twice) → Signals. Ctrl-C
    (KeyboardInterrupt) ends the watch early: one last scrape, and the window is what was watched."""
    if not routers:
        raise TuneError("no router to watch")
    steps = max(int(duration_s // interval_s), 1)
    router_scrapes: list[list[Sample]] = []
    decode_scrapes: list[list[Sample]] = []

    engines: dict[str, list[list[list[Sample]]]] = {"prefill": [], "decode": []}

    def instances(urls: list[str]) -> list[list[Sample]]:
        out = []
        for url in urls:
            try:
                out.append(parse_exposition(fetch(url.rstrip("/") + "/metrics")))
            except TuneError:
                continue  # an engine's series are optional evidence; the router's are the signals
        return out

    def scrape() -> None:
        got = [s for url in routers for s in parse_exposition(fetch(url.rstrip("/") + "/metrics"))]
        d, p = instances(decodes), instances(prefills or [])
        router_scrapes.append(got)
        decode_scrapes.append([s for one in d for s in one])
        engines["decode"].append(d)
        engines["prefill"].append(p)

    start = time.monotonic()
    stop = False
    # Ctrl-C must end the watch even where SIGINT came in ignored (a shell starts background jobs that way, and their
    # children inherit it: CI's `bpdkv tune --watch` then ran its whole window). Restored afterwards.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler) if threading.current_thread() is threading.main_thread() else None
    try:
        for step in range(steps + 1):
            if step:
                try:
                    sleep(duration_s / steps)
                except KeyboardInterrupt:
                    stop = True
            for _ in range(10):  # a Ctrl-C during a scrape: finish it (again), then stop
                try:
                    scrape()
                    break
                except KeyboardInterrupt:
                    stop = True
            if stop and len(router_scrapes) >= 2:
                break
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return signals_from_scrapes(router_scrapes, decode_scrapes, time.monotonic() - start if stop else duration_s, engines)


# ---- Prometheus' HTTP API ---------------------------------------------------------------------------------------------
PromQuery = Callable[[str], list[tuple[Mapping[str, str], float]]]


def prometheus_query(base: str, at: float | None = None, timeout: float = 30.0) -> PromQuery:
    """An instant query against Prometheus' HTTP API (/api/v1/query) → (labels, value) per series."""

    def run(expr: str) -> list[tuple[Mapping[str, str], float]]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        url = base.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - the operator's own Prometheus
                text = resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:  # Prometheus explains a bad query in the body of its 400/422
            text = exc.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise TuneError(f"{base}: {getattr(exc, 'reason', exc)}") from None
        return parse_query_answer(text, expr)

    return run


def parse_query_answer(text: str, expr: str = "") -> list[tuple[Mapping[str, str], float]]:
    try:
        data = json.loads(text)
    except ValueError:
        raise TuneError(f"Prometheus answered something not JSON to {expr!r}") from None
    if not isinstance(data, dict) or data.get("status") != "success":
        raise TuneError(f"Prometheus refused {expr!r}: {data.get('error') if isinstance(data, dict) else data}")
    result = data.get("data", {}).get("result", [])
    out: list[tuple[Mapping[str, str], float]] = []
    for series in result if isinstance(result, list) else []:
        try:
            value = float(series["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if not math.isnan(value):
            out.append((series.get("metric", {}), value))
    return out


def signals_from_prometheus(query: PromQuery, topology: str, since_s: float) -> Signals:
    """Signals over the last since_s from Prometheus (the scrape config `bpdkv render` writes labels every series with
    its topology)."""
    w = f"{int(since_s)}s"
    sel = f'topology="{topology}"'

    def by(expr: str, label: str) -> dict[str, float]:
        return {str(lab.get(label, "")): v for lab, v in query(expr)}

    def one(expr: str) -> float | None:
        got = query(expr)
        return got[0][1] if got else None

    gaps = tuple(
        sorted((float(le), v) for le, v in by(f"sum by (le) (increase({contracts.TURN_GAP_METRIC}_bucket{{{sel}}}[{w}]))", "le").items())
    )
    new_tokens = tuple(
        sorted(
            (float(le), v)
            for le, v in by(f'sum by (le) (increase(bpdkv_router_turn_new_tokens_bucket{{{sel},path="prefill_pull"}}[{w}]))', "le").items()
        )
    )
    held = one(f"sum(avg_over_time(vllm:bpdkv_held_blocks{{{sel}}}[{w}])) / sum(avg_over_time(vllm:bpdkv_kv_blocks_total{{{sel}}}[{w}]))")
    budget = one(
        f"sum(avg_over_time(vllm:bpdkv_hold_budget_blocks{{{sel}}}[{w}])) / sum(avg_over_time(vllm:bpdkv_kv_blocks_total{{{sel}}}[{w}]))"
    )
    # vLLM's own series (per engine) where Prometheus scrapes P and D, else the router's mirror of them.
    waiting = by(f"avg by (role) (avg_over_time(bpdkv_router_engine_waiting{{{sel}}}[{w}]))", "role")
    kv_usage = by(f"avg by (role) (avg_over_time(bpdkv_router_engine_kv_usage{{{sel}}}[{w}]))", "role")
    waiting.update(by(f"avg by (bpdkv_role) (avg_over_time({ENGINE_WAITING}{{{sel}}}[{w}]))", "bpdkv_role"))
    for name in reversed(ENGINE_KV_USAGE):  # the current name wins
        kv_usage.update(by(f"avg by (bpdkv_role) (avg_over_time({name}{{{sel}}}[{w}]))", "bpdkv_role"))
    return Signals(
        window_s=since_s,
        gaps=gaps,
        misses=by(f"sum by (cause) (increase({contracts.REUSE_MISSES_METRIC}_total{{{sel}}}[{w}]))", "cause"),
        outcomes=by(f"sum by (outcome) (increase({contracts.REUSE_OUTCOME_METRIC}_total{{{sel}}}[{w}]))", "outcome"),
        stored=one(f"sum(increase(bpdkv_router_sessions_stored_total{{{sel}}}[{w}]))") or 0.0,
        waiting=waiting,
        kv_usage=kv_usage,
        held_share=held,
        budget_share=budget,
        local_turns=one(f'sum(increase(bpdkv_router_paths_total{{{sel},path="decode_local"}}[{w}]))') or 0.0,
        new_tokens=new_tokens,
        requests=one(f"sum(increase(bpdkv_router_requests_total{{{sel}}}[{w}]))") or 0.0,
        in_flight=one(f"sum(avg_over_time(bpdkv_router_in_flight{{{sel}}}[{w}]))") or 0.0,
    )


# ---- the result -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TuneResult:
    """One run's recommendations; owns the exit code (0: read and recommended, even "too little data"; 1: error)."""

    source: str
    signals: Signals | None
    recommendations: tuple[Recommendation, ...] = ()
    error: str | None = None

    @property
    def exit_code(self) -> int:
        return 1 if self.error else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "error": self.error,
            "window_s": self.signals.window_s if self.signals else None,
            "recommendations": [dict(asdict(r), changes=r.changes) for r in self.recommendations],
        }


def current_of(topology: Any) -> Current:
    """The settings now, from a loaded topology (bpdkv.topology.model.Topology)."""
    kv, router = topology.kv_transfer, topology.router
    budgets = [i.kv_hold_budget for _, i in topology.instances("decode") if i.kv_hold_budget is not None]
    paths = dict(router.paths)
    decode = topology.instances("decode")
    cap = instance_capacity(topology, *decode[0]) if decode else None
    return Current(
        d_kv_gib=cap.kv_gib * cap.tp if cap is not None and cap.kv_gib > 0 else None,
        host_tier_gib=float(decode[0][1].kv_host_memory_gib or 0.0) if decode else 0.0,
        host_ram_gib=decode[0][0].host_memory_gib if decode else None,
        ttl_s=int(kv.decoder_kv_blocks_ttl),
        ttl_margin_s=int(router.ttl_margin),
        hold_budget=float(budgets[0]) if budgets else contracts.DEFAULT_HOLD_BUDGET,
        local_max_tokens=int(paths.get("local_max_tokens", contracts.ROUTER_PATHS_DEFAULTS["local_max_tokens"])),
        prefill=len(topology.instances("prefill")),
        decode=len(topology.instances("decode")),
    )


def endpoints(topology: Any) -> tuple[list[str], list[str], list[str]]:
    """The routers', D's and P's base URLs (the router serves TLS where the topology gives it a certificate)."""
    scheme = "https" if topology.router.tls_cert else "http"
    routers = [f"{scheme}://{n.host}:{i.port}" for n, i in topology.instances("router")]
    decodes = [f"http://{n.host}:{i.port}" for n, i in topology.instances("decode")]
    prefills = [f"http://{n.host}:{i.port}" for n, i in topology.instances("prefill")]
    return routers, decodes, prefills


def override_yaml(result: TuneResult, source: str) -> str:
    """The changed settings as a topology fragment to merge (top-level keys of the topology file), each with its
    evidence; the same shape as `bpdkv calibrate --write-override`."""
    lines = [
        f"# bpdkv tune, {time.strftime('%Y-%m-%d %H:%M')} from {source}.",
        "# Merge these keys into the topology, then `bpdkv plan` shows the change and `bpdkv apply` makes it.",
    ]
    by = {r.setting: r for r in result.recommendations if r.changes}
    ttl = next((r for r in result.recommendations if r.setting == "decoder_kv_blocks_ttl"), None)
    if ttl is not None and ttl.capped_by:
        lines += _capped_comment(ttl)
    if "kv_host_memory_gib" in by:
        r = by["kv_host_memory_gib"]
        lines.append(f"# kv_host_memory_gib: {r.recommended} on each decode instance (nodes[].instances[]) — {r.evidence}")
    kv = [r for k, r in by.items() if k in ("decoder_kv_blocks_ttl", "kv_hold_budget")]
    if kv:
        lines.append("kv_transfer:")
        lines += [f"  {r.setting}: {r.recommended}  # {r.evidence}" for r in kv]
    router = [r for k, r in by.items() if k in ("router.ttl_margin", "paths.local_max_tokens")]
    if router:
        lines.append("router:")
    if "router.ttl_margin" in by:
        r = by["router.ttl_margin"]
        lines.append(f"  ttl_margin: {r.recommended}  # {r.evidence}")
    if "paths.local_max_tokens" in by:
        r = by["paths.local_max_tokens"]
        lines += ["  paths:", f"    local_max_tokens: {r.recommended}  # {r.evidence}"]
    if "P:D" in by:
        r = by["P:D"]
        lines.append(f"# P:D {r.current} → {r.recommended}: add the instance to `nodes` ({r.evidence})")
    if not any(line and not line.startswith("#") for line in lines):
        lines.append("# nothing to change")
    return "\n".join(lines) + "\n"


# ---- one run, as the CLI calls it -------------------------------------------------------------------------------------
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """ "30s", "5m", "6h", "1d" or plain seconds → seconds (> 0)."""
    raw = text.strip().lower()
    unit = _UNITS.get(raw[-1:], None)
    try:
        value = float(raw[:-1] if unit else raw) * (unit or 1)
    except ValueError:
        raise TuneError(f"not a duration: {text!r} (e.g. 30s, 5m, 6h)") from None
    if not math.isfinite(value) or value <= 0:
        raise TuneError(f"not a duration: {text!r} (must be > 0)")
    return value


def run(
    current: Current,
    routers: list[str],
    decodes: list[str],
    watch_s: float | None = None,
    interval_s: float = 5.0,
    prometheus: str | None = None,
    topology_name: str = "",
    since_s: float = 6 * 3600,
    prefills: list[str] | None = None,
) -> TuneResult:
    """Read the signals from one source, recommend; a source that cannot be read is the result's error."""
    source = f"Prometheus {prometheus} (last {since_s:.0f} s)" if prometheus else f"{', '.join(routers)} watched {watch_s:.0f} s"
    try:
        if prometheus:
            signals = signals_from_prometheus(prometheus_query(prometheus), topology_name, since_s)
        else:
            signals = watch(routers, decodes, watch_s or 60.0, min(interval_s, watch_s or 60.0), prefills=prefills)
    except TuneError as exc:
        return TuneResult(source, None, error=str(exc))
    return TuneResult(source, signals, tuple(recommend(signals, current)))


def _capped_comment(r: Recommendation) -> list[str]:
    """The override's word on a TTL the hold budget capped: what it is, what the traffic asked, what lifts the cap."""
    p = r.predicted
    asked = f"the turn gaps ask for {p.get('ttl_uncapped', 0):.0f} s"
    if r.recommended is None:
        head = f"# decoder_kv_blocks_ttl: no TTL fits D's hold budget ({_pct(p.get('hold_budget_share', 0.0))}); {asked}."
    else:
        what = "stays" if not r.changes else "is"
        head = (
            f"# decoder_kv_blocks_ttl {what} {r.recommended}, capped by D's hold budget ({_pct(p.get('hold_budget_share', 0.0))}): "
            f"{asked}, which would hold {_pct(p.get('held_share_uncapped', 0.0))} of D's cache and be released early."
        )
    lift = f"# Predicted: {r.effect}." if r.effect else ""
    return [head, lift] if lift else [head]


def rows(result: TuneResult) -> list[tuple[str, str, str, str, str]]:
    """(setting, current, recommended, evidence, predicted effect) per setting, for a table."""
    out = []
    for r in result.recommendations:
        rec = "—" if r.recommended is None else ("keep" if not r.changes else str(r.recommended))
        if r.capped_by:
            rec += f" (capped by {r.capped_by})"
        out.append((r.setting, str(r.current), rec, r.evidence, r.effect))
    return out
