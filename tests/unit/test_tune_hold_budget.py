"""bpdkv tune past D's hold budget, pure: a TTL whose holds would not fit the budget is capped at the longest that
does, the hit rate is predicted at the cap, and what lifting the budget would give is said beside it — in the
recommendation, its JSON, the table row and the override's comments. The override never carries a TTL the budget
contradicts. And a window without traffic gives the P:D ratio "too little data", not "keep"."""

from __future__ import annotations

import math
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from bpdkv import tune
from bpdkv.contracts import TURN_GAP_BUCKETS, MissCause
from bpdkv.tune import Current, Signals

BOUNDS = (*map(float, TURN_GAP_BUCKETS), math.inf)
# The lab workload: think times 5..300 s (p90 270 s) against a 110 s TTL (100 s at the router, 10 s margin).
GAPS = [5.0 * (i + 1) for i in range(60)]
NOW = Current(ttl_s=110, ttl_margin_s=10, hold_budget=0.3, local_max_tokens=512, prefill=1, decode=1)


def bucketize(gaps: list[float]) -> tune.Buckets:
    return tuple((b, float(sum(1 for g in gaps if g <= b))) for b in BOUNDS)


def signals(gaps: list[float], ttl_s: float = 110, margin: float = 10, **extra: Any) -> Signals:
    """What the router would count for these gaps at this TTL, every turn within it a hit."""
    hits = sum(1 for g in gaps if g < ttl_s - margin)
    return Signals(
        window_s=600,
        gaps=bucketize(gaps),
        misses={MissCause.EXPIRED.value: float(len(gaps) - hits)},
        outcomes={"hit": float(hits)},
        stored=float(len(gaps)),
        **extra,
    )


def fragment_ttl(rec: tune.Recommendation) -> Any:
    text = tune.override_yaml(tune.TuneResult("test", None, (rec,)), "test")
    return (yaml.safe_load(text) or {}).get("kv_transfer", {}).get("decoder_kv_blocks_ttl"), text


def test_the_held_share_grows_with_the_ttl_from_the_gauges() -> None:
    s = signals(GAPS, held_share=0.2, budget_share=0.3)
    at = {t: tune.predict_ttl(s, NOW, t) for t in (110, 160, 280)}
    assert at[110].held_ratio == pytest.approx(1.0) and at[110].held_share == pytest.approx(0.2)
    assert at[110].held_share < at[160].held_share < at[280].held_share  # type: ignore[operator]
    assert at[280].hit_rate == pytest.approx(0.9)  # 54 of 60 gaps within 270 s, every turn within the TTL hit
    assert tune.predict_ttl(signals(GAPS), NOW, 280).held_share is None  # no gauges from D: no share


def test_over_the_budget_the_ttl_is_capped_where_the_holds_fit() -> None:
    """25 % of D's cache held at 110 s; the p90's 280 s would hold about 1.8x that, 45 %, over the 30 % budget.
    Recommended: the longest TTL that fits, and the hit rate at it (not the 90 % of a TTL D would cut short)."""
    s = signals(GAPS, held_share=0.25, budget_share=0.3)
    rec = tune.recommend_ttl(s, NOW)
    assert rec.capped_by == tune.CAPPED_BY_HOLD_BUDGET
    cap = rec.recommended
    assert cap is not None and NOW.ttl_s < cap < 280 and cap % tune.TTL_STEP == 0
    assert tune.predict_ttl(s, NOW, cap).held_share <= 0.3  # type: ignore[operator]
    assert tune.predict_ttl(s, NOW, cap + tune.TTL_STEP).held_share > 0.3  # type: ignore[operator]  # the longest that fits
    p = rec.predicted
    assert p["hit_rate_predicted"] == round(tune.predict_ttl(s, NOW, cap).hit_rate, 3) < p["hit_rate_uncapped"] == 0.9
    assert p["held_share_predicted"] <= p["hold_budget_share"] == 0.3 < p["held_share_uncapped"]
    assert p["ttl_uncapped"] == 280 and p["hold_budget_needed"] == 0.5  # 45 % held: the next budget step up
    assert f"capped at {cap} s by D's hold budget" in rec.evidence and "over its hold budget 30 %" in rec.evidence
    assert rec.effect.startswith(f"at {cap} s (capped by the hold budget): hit rate of returning turns 32 % → ")
    assert "kv_hold_budget 0.5 would allow 280 s: hit rate 90 %" in rec.effect

    ttl, text = fragment_ttl(rec)
    assert ttl == cap  # never 280, the TTL the budget contradicts
    assert f"# decoder_kv_blocks_ttl is {cap}, capped by D's hold budget (30 %): the turn gaps ask for 280 s" in text
    assert "kv_hold_budget 0.5 would allow 280 s" in text
    (row,) = tune.rows(tune.TuneResult("test", s, (rec,)))
    assert row[2] == f"{cap} (capped by kv_hold_budget)"
    as_json = tune.TuneResult("test", s, (rec,)).to_json()["recommendations"][0]
    assert as_json["capped_by"] == "kv_hold_budget" and as_json["recommended"] == cap


def test_a_budget_beyond_what_a_budget_should_take_says_add_d() -> None:
    """58 % of D's cache held at 110 s: 280 s would need more than all of it. The cap still holds, the way out is
    more D, and the most a budget should take (80 %) is priced."""
    s = signals(GAPS, held_share=0.58, budget_share=0.6)
    rec = tune.recommend_ttl(s, NOW)
    assert rec.capped_by and rec.recommended is not None and rec.recommended < 280
    assert rec.predicted["hold_budget_needed"] > 1.0
    assert "more than D's cache: add D" in rec.effect
    widest = rec.predicted["ttl_at_max_budget"]
    assert rec.recommended < widest < 280
    assert tune.predict_ttl(s, NOW, int(widest)).held_share <= tune.HOLD_BUDGET_MAX  # type: ignore[operator]
    assert f"kv_hold_budget 0.8 would allow {widest:.0f} s" in rec.effect


def test_d_already_at_its_budget_keeps_the_ttl_and_says_why() -> None:
    s = signals(GAPS, held_share=0.3, budget_share=0.3)
    rec = tune.recommend_ttl(s, NOW)
    assert rec.recommended == NOW.ttl_s and not rec.changes and rec.capped_by
    ttl, text = fragment_ttl(rec)
    assert ttl is None  # nothing to change in the topology ...
    assert "# decoder_kv_blocks_ttl stays 110, capped by D's hold budget (30 %)" in text  # ... and why it is not 280
    assert tune.rows(tune.TuneResult("t", s, (rec,)))[0][2] == "keep (capped by kv_hold_budget)"


def test_no_ttl_fits_a_budget_d_already_overran() -> None:
    s = signals(GAPS, held_share=0.9, budget_share=0.1)
    rec = tune.recommend_ttl(s, NOW)
    assert rec.recommended is None and rec.capped_by
    assert "no TTL fits D's hold budget 10 %" in rec.evidence
    ttl, text = fragment_ttl(rec)
    assert ttl is None and "no TTL fits D's hold budget" in text


def test_within_the_budget_or_without_gauges_nothing_is_capped() -> None:
    within = tune.recommend_ttl(signals(GAPS, held_share=0.1, budget_share=0.5), NOW)
    assert within.recommended == 280 and not within.capped_by and "ttl_uncapped" not in within.predicted
    blind = tune.recommend_ttl(signals(GAPS), NOW)
    assert blind.recommended == 280 and not blind.capped_by and "no hold gauges from D" in blind.effect


def test_the_topologys_budget_stands_in_for_a_missing_budget_gauge() -> None:
    rec = tune.recommend_ttl(signals(GAPS, held_share=0.2), NOW)  # NOW.hold_budget: 30 %
    assert rec.capped_by and rec.predicted["hold_budget_share"] == 0.3


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.floats(min_value=0.5, max_value=3000, allow_nan=False), min_size=tune.MIN_GAPS, max_size=200),
    st.integers(min_value=20, max_value=1200),
    st.floats(min_value=0.0, max_value=1.0),
    st.floats(min_value=0.05, max_value=1.0),
)
def test_the_override_never_carries_a_ttl_the_budget_contradicts(gaps: list[float], ttl: int, held: float, budget: float) -> None:
    current = Current(ttl, 10, budget, 512, 1, 1)
    s = signals(gaps, ttl, held_share=held, budget_share=budget)
    rec = tune.recommend_ttl(s, current)
    written, _ = fragment_ttl(rec)
    if written is not None:
        assert tune.predict_ttl(s, current, written).held_share <= budget + 1e-9  # type: ignore[operator]
    if rec.capped_by and rec.recommended is not None:
        assert rec.predicted["hit_rate_predicted"] <= rec.predicted["hit_rate_uncapped"] + 1e-9
        assert rec.recommended < rec.predicted["ttl_uncapped"]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, None),  # no traffic: nothing queued because nothing came
        ({"requests": 3.0}, None),  # a handful of requests, none in flight at any reading
        ({"requests": 50.0}, "1:1"),  # served without queueing: the sizing fits
        ({"in_flight": 2.0}, "1:1"),  # long requests in flight the whole window
    ],
)
def test_pd_without_traffic_is_too_little_data(extra: dict[str, float], expected: str | None) -> None:
    s = Signals(window_s=60, samples=10, waiting={"prefill": 0.0, "decode": 0.0}, kv_usage={"decode": 0.0}, **extra)
    rec = tune.recommend_ratio(s, NOW)
    assert rec.recommended == expected, rec
    if expected is None:
        assert rec.evidence.startswith("too little data") and tune.rows(tune.TuneResult("t", s, (rec,)))[0][2] == "—"
