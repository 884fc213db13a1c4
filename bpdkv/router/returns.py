"""Holds ranked by predicted return, the router's side (issue 40): how soon a conversation comes back after a turn,
learned from the requests themselves and sent to D with the turn (contracts.RETURN_FORECAST).

Every continued request carries its history, so it shows how the previous turns ended — its last assistant message
has tool_calls (finish_reason "tool_calls": an agent waiting on a tool) or not (a final answer) — and, with the stored
location the lookup found, how long after that ending it came (now − the entry's stored_at). The router keeps, per
ending, a decayed histogram of those gaps on the turn-gap buckets `bpdkv tune` reads, and the transitions from one
ending to the next (an agent loop that called a tool mostly calls another, then answers). D's request carries each
ending's quantiles and the likely ending of this turn: the router cannot know how the turn ends before D generates it;
D (the node plugin) applies the quantiles of the ending it sees where it can tell, else the likely one.

Only returns within the router's TTL are seen (a later turn finds no entry): the quantiles are those of the gaps that
came back while held — the window a hold lives in. While an ending has fewer than MIN_SAMPLES returns, its quantiles
are those of the router's turn-gap histogram over every ending (bpdkv_router_turn_gap_seconds), or None before any.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, overload

from prometheus_client import Counter, Histogram

from bpdkv import contracts
from bpdkv.contracts import TurnEnding
from bpdkv.router.metrics import RouterMetrics
from bpdkv.router.sessions import SessionEntry

# Each observation multiplies the older ones by this: the estimate follows the traffic of the last ~1,000 returns.
DECAY = 0.999
# Returns of one ending before its own quantiles replace the pooled ones.
MIN_SAMPLES = 8.0
BOUNDS: tuple[float, ...] = (*(float(b) for b in contracts.TURN_GAP_BUCKETS), math.inf)
START = "start"  # the "previous ending" of a conversation's first assistant turn


def endings(body: dict[str, Any]) -> list[TurnEnding]:
    """How each assistant turn of a chat request's history ended, oldest first (none for a text prompt)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    out: list[TurnEnding] = []
    for msg in messages:
        if isinstance(msg, dict) and msg.get("role") == "assistant":
            calls = msg.get("tool_calls")
            out.append(TurnEnding.TOOL_CALLS if isinstance(calls, list) and calls else TurnEnding.FINAL)
    return out


def may_call_tools(body: dict[str, Any]) -> bool:
    """Whether this turn can end in tool calls: the request offers tools (and does not forbid them)."""
    tools = body.get("tools") or body.get("functions")
    return bool(tools) and body.get("tool_choice") != "none"


def quantile(counts: Sequence[float], q: float) -> float | None:
    """The q-quantile of a histogram on BOUNDS (counts per bucket, not cumulative), interpolated inside its bucket as
    Prometheus' histogram_quantile does; the overflow bucket answers with the last finite bound."""
    total = sum(counts)
    if total <= 0:
        return None
    target = q * total
    seen = 0.0
    for i, count in enumerate(counts):
        if count > 0 and seen + count >= target:
            upper = BOUNDS[i]
            if math.isinf(upper):
                return BOUNDS[i - 1]
            lower = BOUNDS[i - 1] if i else 0.0
            return lower + (upper - lower) * (target - seen) / count
        seen += count
    return BOUNDS[-2]


def bucket_of(seconds: float) -> int:
    return next(i for i, bound in enumerate(BOUNDS) if seconds <= bound)


def histogram_counts(histogram: Histogram) -> list[float]:
    """Per-bucket counts of an unlabelled prometheus Histogram on BOUNDS (this process's values)."""
    cumulative: dict[float, float] = {}
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                cumulative[float(sample.labels["le"])] = sample.value
    if not cumulative:
        return [0.0] * len(BOUNDS)
    counts, before = [], 0.0
    for bound in BOUNDS:
        total = cumulative.get(bound, before)
        counts.append(max(total - before, 0.0))
        before = total
    return counts


class ReturnModel:
    """Per-ending gap histograms and ending transitions of one router process, and the forecast D gets."""

    def __init__(self, metrics: RouterMetrics, clock: Callable[[], float]) -> None:
        self.metrics = metrics
        self.clock = clock
        self.gaps: dict[TurnEnding, list[float]] = {e: [0.0] * len(BOUNDS) for e in TurnEnding}
        # previous ending (or START) → next ending → decayed count
        self.transitions: dict[str, dict[TurnEnding, float]] = {}
        self._cache: dict[TurnEnding, dict[str, float] | None] = {}  # an ending's quantiles until its next return
        r = metrics.registry
        self.gap_metric = Histogram(
            contracts.RETURN_GAP_METRIC,
            "Seconds from the end of a turn to its conversation's next turn, by how the turn ended (returns within the TTL)",
            ["ending"],
            buckets=contracts.TURN_GAP_BUCKETS,
            registry=r,
        )
        self.forecasts = Counter(
            "bpdkv_router_return_forecasts", "Return forecasts sent to D with a turn, by the ending predicted", ["likely"], registry=r
        )
        self.predicted = Histogram(
            "bpdkv_router_return_predicted_seconds",
            "Median return predicted for the ending a turn was expected to have, as sent to D",
            ["likely"],
            buckets=contracts.TURN_GAP_BUCKETS,
            registry=r,
        )
        for ending in TurnEnding:
            self.gap_metric.labels(ending.value)
            self.forecasts.labels(ending.value)
            self.predicted.labels(ending.value)

    def observe(self, body: dict[str, Any], entry: SessionEntry | None) -> list[TurnEnding]:
        """Learn from one request: the latest ending's transition and, when the lookup found its stored turn, its gap."""
        seen = endings(body)
        if not seen:
            return seen
        last = seen[-1]
        row = self.transitions.setdefault(seen[-2].value if len(seen) > 1 else START, {})
        for key in row:
            row[key] *= DECAY
        row[last] = row.get(last, 0.0) + 1.0
        if entry is not None and entry.stored_at > 0:
            gap = self.clock() - entry.stored_at
            if gap >= 0:  # a clock stepped back: no measurement
                counts = self.gaps[last]
                for i in range(len(counts)):
                    counts[i] *= DECAY
                counts[bucket_of(gap)] += 1.0
                self._cache.pop(last, None)
                self.metrics.child(self.gap_metric, last.value).observe(gap)
        return seen

    def p_tool_calls(self, body: dict[str, Any], seen: list[TurnEnding]) -> float:
        """P(this turn ends in tool calls | how the previous one ended), Laplace-smoothed; 0 without tools offered."""
        if not may_call_tools(body):
            return 0.0
        row = self.transitions.get(seen[-1].value if seen else START, {})
        return (row.get(TurnEnding.TOOL_CALLS, 0.0) + 1.0) / (sum(row.values()) + 2.0)

    def quantiles(self, ending: TurnEnding) -> dict[str, float] | None:
        """Its quantiles: from its own returns once there are MIN_SAMPLES (recomputed only after a new one: the hot
        path makes one forecast per turn), else from the pooled turn gaps (read each time, while few are measured)."""
        counts = self.gaps[ending]
        samples = sum(counts)
        if samples < MIN_SAMPLES:
            counts = histogram_counts(self.metrics.turn_gap)
            samples = sum(counts)
        elif ending in self._cache:
            return self._cache[ending]
        p50, p90 = quantile(counts, 0.5), quantile(counts, 0.9)
        got = None
        if p50 is not None and p90 is not None:
            got = {contracts.RETURN_P50: round(p50, 3), contracts.RETURN_P90: round(p90, 3), contracts.RETURN_SAMPLES: round(samples, 1)}
        if counts is self.gaps[ending]:
            self._cache[ending] = got
        return got

    def forecast(self, body: dict[str, Any], seen: list[TurnEnding]) -> dict[str, Any]:
        p_tool = self.p_tool_calls(body, seen)
        likely = TurnEnding.TOOL_CALLS if p_tool >= 0.5 else TurnEnding.FINAL
        out: dict[str, Any] = {e.value: self.quantiles(e) for e in TurnEnding}
        out[contracts.RETURN_LIKELY] = likely.value
        out[contracts.RETURN_P_TOOL] = round(p_tool, 3)
        self.metrics.child(self.forecasts, likely.value).inc()
        expected = out[likely.value]
        if expected is not None:
            self.metrics.child(self.predicted, likely.value).observe(expected[contracts.RETURN_P50])
        return out

    def turn(self, body: dict[str, Any], entry: SessionEntry | None, hold: bool) -> dict[str, Any] | None:
        """One request: learn from its history, and the forecast for D when D will hold this turn (else None)."""
        seen = self.observe(body, entry)
        return self.forecast(body, seen) if hold else None


@overload
def stamp(params: dict[str, Any], forecast: dict[str, Any] | None) -> dict[str, Any]: ...
@overload
def stamp(params: dict[str, Any] | None, forecast: dict[str, Any] | None) -> dict[str, Any] | None: ...
def stamp(params: dict[str, Any] | None, forecast: dict[str, Any] | None) -> dict[str, Any] | None:
    """D's request params with the forecast added (a copy); unchanged without params or forecast."""
    if not params or forecast is None:
        return params
    return dict(params, **{contracts.RETURN_FORECAST: forecast})
