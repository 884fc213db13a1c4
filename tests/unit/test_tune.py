"""bpdkv tune's estimators and rules, pure: gap distributions, sample sizes, budgets and queues in → recommendations out."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from bpdkv import tune
from bpdkv.contracts import TURN_GAP_BUCKETS, MissCause
from bpdkv.topology.validate import load_topology
from bpdkv.tune import Current, Signals

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests/data/tune"
BOUNDS = (*map(float, TURN_GAP_BUCKETS), math.inf)
CURRENT = Current(ttl_s=120, ttl_margin_s=10, hold_budget=0.5, local_max_tokens=512, prefill=2, decode=2)


def bucketize(gaps: list[float]) -> tune.Buckets:
    return tuple((b, float(sum(1 for g in gaps if g <= b))) for b in BOUNDS)


def signals(gaps: list[float], ttl_s: float, margin: float = 10, **extra: Any) -> Signals:
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


gap_lists = st.lists(st.floats(min_value=0.5, max_value=3000, allow_nan=False), min_size=tune.MIN_GAPS, max_size=400)


@given(gap_lists, st.floats(min_value=0, max_value=4000))
def test_cdf_is_a_share_and_grows(gaps: list[float], x: float) -> None:
    b = bucketize(gaps)
    assert 0.0 <= tune.cdf(b, x) <= 1.0
    assert tune.cdf(b, x) <= tune.cdf(b, x + 10) + 1e-12
    # exact at every bucket bound
    for bound, cum in b[:-1]:
        assert tune.cdf(b, bound) == pytest.approx(cum / len(gaps))


@given(gap_lists, st.floats(min_value=0.01, max_value=0.99))
def test_quantile_inverts_cdf(gaps: list[float], q: float) -> None:
    b = bucketize(gaps)
    x = tune.quantile(b, q)
    assert x is not None  # every gap is under the last finite bucket
    assert tune.cdf(b, x) == pytest.approx(q, abs=1e-9)


@settings(max_examples=60)
@given(gap_lists, st.integers(min_value=20, max_value=3000))
def test_ttl_covers_the_p90_and_its_prediction_is_consistent(gaps: list[float], ttl: int) -> None:
    rec = tune.recommend_ttl(signals(gaps, ttl), Current(ttl, 10, 0.5, 512, 1, 1))
    assert rec.recommended is not None
    assert rec.recommended % tune.TTL_STEP == 0
    # the recommended TTL (less the router's margin) covers at least 90 % of the gaps, as the histogram sees them
    assert tune.cdf(bucketize(gaps), rec.recommended - 10) >= 0.9 - 1e-9
    predicted = rec.predicted.get("hit_rate_predicted", rec.predicted.get("hit_rate_predicted_max"))
    assert predicted is not None and 0.0 <= predicted <= 1.0
    assert 0.0 <= rec.predicted["hit_rate_before"] <= 1.0


@settings(max_examples=40)
@given(st.floats(min_value=10, max_value=900), st.integers(min_value=100, max_value=2000))
def test_ttl_near_the_p90_of_a_known_distribution(scale: float, n: int) -> None:
    """Exponential think times (scale s): the true p90 is scale·ln 10; tune lands within 20 % of it (where the
    buckets are no wider than that)."""
    gaps = [-scale * math.log(1 - (i + 0.5) / n) for i in range(n)]  # exact quantiles of the distribution
    rec = tune.recommend_ttl(signals(gaps, 100), Current(100, 0, 0.5, 512, 1, 1))
    p90 = scale * math.log(10)
    assert rec.recommended is not None
    assert 0.8 * p90 <= rec.recommended <= 1.2 * p90 + tune.TTL_STEP, (rec, p90)


@given(st.integers(min_value=0, max_value=tune.MIN_GAPS - 1))
def test_too_few_gaps_recommend_nothing(n: int) -> None:
    rec = tune.recommend_ttl(signals([30.0] * n, 120), CURRENT)
    assert rec.recommended is None and not rec.changes
    assert rec.evidence.startswith("too little data")


def test_prediction_from_the_gap_histogram() -> None:
    """Gaps 5..300 s against a 100 s router TTL (the lab workload): p90 270 s → TTL 280; 19 of 60 hit now; at 280
    s, 54 of 60 would (all turns within the TTL hit today)."""
    gaps = [5.0 * (i + 1) for i in range(60)]
    rec = tune.recommend_ttl(signals(gaps, 110), Current(110, 10, 0.5, 512, 1, 1))
    assert rec.recommended == 280
    assert rec.evidence == "p90 of 60 turn gaps = 270 s; 100 % of 41 misses expired"
    assert rec.predicted["hit_rate_before"] == round(19 / 60, 3)
    assert rec.predicted["hit_rate_predicted"] == 0.9
    assert "32 % → 90 %" in rec.effect


def test_held_memory_predicted_against_the_budget() -> None:
    gaps = [5.0 * (i + 1) for i in range(60)]
    s = signals(gaps, 110, held_share=0.3, budget_share=0.5)
    rec = tune.recommend_ttl(s, Current(110, 10, 0.5, 512, 1, 1))
    ratio = rec.predicted["held_ratio"]
    assert ratio > 1  # a longer TTL holds more
    assert rec.predicted["held_share_predicted"] == pytest.approx(0.3 * ratio, abs=0.01)
    # 30 % held at 110 s would become more than the 50 % budget at 280 s (the p90's TTL): capped where it fits
    assert rec.capped_by == tune.CAPPED_BY_HOLD_BUDGET and rec.recommended is not None and 110 < rec.recommended < 280
    assert rec.predicted["held_share_uncapped"] > 0.5 >= rec.predicted["held_share_predicted"]
    assert "over its hold budget" in rec.evidence and "capped by the hold budget" in rec.effect


@given(gap_lists, st.floats(min_value=1, max_value=3000), st.floats(min_value=1, max_value=3000), st.floats(min_value=0, max_value=500))
def test_mean_hold_grows_with_the_ttl_and_stays_under_it(gaps: list[float], a: float, b: float, never: float) -> None:
    lo, hi = sorted((a, b))
    bk = bucketize(gaps)
    assert tune.mean_hold(bk, never, lo) <= tune.mean_hold(bk, never, hi) + 1e-9
    assert tune.mean_hold(bk, never, lo) <= lo + 1e-9


def test_no_gap_within_the_ttl_predicts_only_a_bound() -> None:
    gaps = [500.0] * 40
    rec = tune.recommend_ttl(signals(gaps, 100), Current(100, 10, 0.5, 512, 1, 1))
    assert rec.recommended is not None and "hit_rate_predicted" not in rec.predicted
    assert rec.predicted["hit_rate_predicted_max"] >= 0.9  # what the histogram says (interpolated inside 480-600 s)
    assert "at most" in rec.effect


def _turns(hits: float, **misses: float) -> dict[str, Any]:
    return {"outcomes": {"hit": hits}, "misses": misses}


@pytest.mark.parametrize(
    ("budget", "signals_", "expected"),
    [
        (0.5, dict(_turns(80, released=20), kv_usage={"decode": 0.6}), 0.6),  # holds let go, D has room: up
        (0.8, dict(_turns(80, released=20), kv_usage={"decode": 0.6}), 0.8),  # at the ceiling: keep
        (0.5, dict(_turns(80, released=20), kv_usage={"decode": 0.95}), 0.5),  # D full: keep (add D)
        (0.5, dict(_turns(80, released=20)), None),  # no KV use from D: nothing to judge
        (0.5, dict(_turns(100), kv_usage={"decode": 0.95}, waiting={"decode": 3.0}), 0.4),  # D queues, nothing lost: down
        (0.5, dict(_turns(100), kv_usage={"decode": 0.5}), 0.5),
        (0.5, dict(_turns(10)), None),  # too little data
    ],
)
def test_hold_budget(budget: float, signals_: dict[str, Any], expected: float | None) -> None:
    rec = tune.recommend_hold_budget(Signals(window_s=60, **signals_), Current(120, 10, budget, 512, 1, 1))
    assert rec.recommended == expected, rec


@pytest.mark.parametrize(
    ("waiting", "kv", "expected"),
    [
        ({"prefill": 4.0, "decode": 0.2}, 0.5, "3:2"),  # P queues
        ({"prefill": 0.1, "decode": 3.0}, 0.5, "2:3"),  # D queues
        ({"prefill": 1.5, "decode": 1.2}, 0.96, "2:3"),  # D's KV full and queueing
        ({"prefill": 0.2, "decode": 0.3}, 0.5, "2:2"),  # balanced
        ({"prefill": 0.2}, 0.5, None),  # no D readings
    ],
)
def test_ratio_names_the_side_that_queues(waiting: dict[str, float], kv: float, expected: str | None) -> None:
    rec = tune.recommend_ratio(Signals(window_s=60, samples=10, waiting=waiting, kv_usage={"decode": kv}), CURRENT)
    assert rec.recommended == expected
    if expected and expected != "2:2":
        assert "→ about" in rec.effect


def test_local_max_tokens() -> None:
    tokens = bucketize([700.0] * 30 + [100.0] * 10)  # many turns just over the limit went through P
    idle = Signals(window_s=60, waiting={"decode": 0.0}, new_tokens=tokens, local_turns=20)
    assert tune.recommend_local_max_tokens(idle, CURRENT).recommended == 1024
    busy = Signals(window_s=60, waiting={"decode": 2.0}, new_tokens=tokens, local_turns=20)
    assert tune.recommend_local_max_tokens(busy, CURRENT).recommended == 256
    assert tune.recommend_local_max_tokens(Signals(window_s=60, waiting={"decode": 0.0}), CURRENT).recommended is None


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30), ("5m", 300), ("6h", 21600), ("1d", 86400), ("90", 90), ("1.5h", 5400)])
def test_durations(text: str, seconds: float) -> None:
    assert tune.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "-5m", "0s", "5x", "nan", "inf"])
def test_bad_durations_are_one_line(text: str) -> None:
    with pytest.raises(tune.TuneError, match="not a duration"):
        tune.parse_duration(text)


def _scrape(gaps: list[float], hits: int, expired: int, waiting_p: float, waiting_d: float) -> str:
    lines = [
        f'bpdkv_router_turn_gap_seconds_bucket{{le="{b}"}} {sum(1 for g in gaps if g <= float(b))}'
        for b in (*map(float, TURN_GAP_BUCKETS), "+Inf")
    ]
    lines += [f"bpdkv_router_turn_gap_seconds_count {len(gaps)}", f"bpdkv_router_turn_gap_seconds_sum {sum(gaps)}"]
    lines += [f'bpdkv_router_reuse_total{{outcome="hit"}} {hits}', f'bpdkv_router_reuse_misses_total{{cause="expired"}} {expired}']
    lines += [
        f'bpdkv_router_engine_waiting{{role="prefill",upstream="p0"}} {waiting_p}',
        f'bpdkv_router_engine_waiting{{role="decode",upstream="d0"}} {waiting_d}',
    ]
    return "\n".join(["# TYPE bpdkv_router_turn_gap_seconds histogram", *lines]) + "\n"


def test_watch_takes_counter_deltas_and_gauge_means() -> None:
    scrapes = iter(
        [
            _scrape([1.0] * 50, 10, 5, 0, 0),
            _scrape([1.0] * 60 + [200.0] * 40, 70, 45, 4, 1),
            _scrape([1.0] * 60 + [200.0] * 40, 70, 45, 2, 2),
        ]
    )
    s = tune.watch(["http://router"], [], duration_s=2, interval_s=1, fetch=lambda url: next(scrapes), sleep=lambda _: None)
    assert s.samples == 3
    assert tune.total(s.gaps) == 50  # 10 more at 1 s, 40 at 200 s
    assert tune.cdf(s.gaps, 1.0) == pytest.approx(10 / 50)
    assert s.outcomes == {"hit": 60.0} and s.misses == {"expired": 40.0}
    assert s.waiting == {"prefill": 2.0, "decode": 1.0}


def test_prometheus_answers_recorded_from_a_real_server() -> None:
    """Answers of Prometheus 2.42 (Debian) to tune's queries, recorded from the lab: parsed, and an error answer is
    the server's own words."""
    ok = (DATA / "prometheus-gap-buckets.json").read_text()
    series = tune.parse_query_answer(ok)
    assert series and all("le" in labels for labels, _ in series)
    bad = (DATA / "prometheus-bad-query.json").read_text()
    with pytest.raises(tune.TuneError, match="parse error"):
        tune.parse_query_answer(bad, "sum(")


def test_override_fragment_merges_into_the_topology(tmp_path: Path) -> None:
    gaps = [5.0 * (i + 1) for i in range(60)]
    s = signals(gaps, 110, kv_usage={"decode": 0.5}, waiting={"prefill": 4.0, "decode": 0.1})
    s = Signals(**{**s.__dict__, "misses": {"expired": 41.0, "released": 20.0}})
    result = tune.TuneResult("test", s, tuple(tune.recommend(s, CURRENT)))
    fragment = yaml.safe_load(tune.override_yaml(result, "test"))
    assert fragment["kv_transfer"]["decoder_kv_blocks_ttl"] == 280
    assert fragment["kv_transfer"]["kv_hold_budget"] == 0.6
    example = ROOT / "examples/local-cpu.yaml"
    doc = yaml.safe_load(example.read_text())
    doc.setdefault("kv_transfer", {}).update(fragment["kv_transfer"])
    merged = tmp_path / "local-cpu.yaml"
    merged.write_text(yaml.safe_dump(doc))
    for name in ("profiles", "keys"):  # whatever the example refers to relative to itself
        if (example.parent / name).exists():
            (tmp_path / name).symlink_to(example.parent / name)
    topology = load_topology(merged, str(merged)).topology
    assert topology.kv_transfer.decoder_kv_blocks_ttl == 280
    assert tune.current_of(topology).hold_budget == 0.6
    assert json.dumps(result.to_json())  # JSON-able for --output json
    assert result.exit_code == 0 and tune.TuneResult("x", None, error="down").exit_code == 1


@pytest.mark.parametrize(
    ("outcomes", "misses", "expected"),
    [
        ({"hit": 95.0}, {"expiring": 5.0}, 20),  # 5 % reached P expiring: the margin doubles
        ({"hit": 99.0}, {"expiring": 1.0}, 10),  # 1 %: keep
        ({"hit": 10.0}, {"expiring": 5.0}, None),  # too little data
    ],
)
def test_ttl_margin(outcomes: dict[str, float], misses: dict[str, float], expected: int | None) -> None:
    rec = tune.recommend_margin(Signals(window_s=60, outcomes=outcomes, misses=misses), CURRENT)
    assert rec.recommended == expected


def test_every_setting_changed_lands_in_the_fragment() -> None:
    gaps = [5.0 * (i + 1) for i in range(60)]
    s = signals(gaps, 110, kv_usage={"decode": 0.5}, waiting={"prefill": 4.0, "decode": 0.0})
    s = Signals(
        **{
            **s.__dict__,
            "misses": {"expired": 41.0, "released": 20.0, "expiring": 5.0},
            "new_tokens": bucketize([700.0] * 40),
            "local_turns": 10,
        }
    )
    result = tune.TuneResult("test", s, tuple(tune.recommend(s, CURRENT)))
    fragment = yaml.safe_load(tune.override_yaml(result, "test"))
    assert fragment == {
        "kv_transfer": {"decoder_kv_blocks_ttl": 280, "kv_hold_budget": 0.6},
        "router": {"ttl_margin": 20, "paths": {"local_max_tokens": 1024}},
    }
    assert "# P:D 2:2 → 3:2" in tune.override_yaml(result, "test")


def test_router_keys_of_the_fragment_load(tmp_path: Path) -> None:
    example = ROOT / "examples/local-cpu.yaml"
    doc = yaml.safe_load(example.read_text())
    router = doc.setdefault("router", {})
    router["ttl_margin"] = 20
    router.setdefault("paths", {})["local_max_tokens"] = 1024
    merged = tmp_path / "local-cpu.yaml"
    merged.write_text(yaml.safe_dump(doc))
    topology = load_topology(merged, str(merged)).topology
    current = tune.current_of(topology)
    assert (current.ttl_margin_s, current.local_max_tokens) == (20, 1024)


def test_engines_own_series_win_over_the_routers_mirror() -> None:
    router = _scrape([], 0, 0, 0, 0)  # the mirror says nobody waits (stale: the router's load reads were off)
    p = 'vllm:num_requests_waiting{engine="0"} 3\nvllm:num_requests_waiting{engine="1"} 1\nvllm:kv_cache_usage_perc{engine="0"} 0.5\n'
    d = "vllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.25\n"
    pages = {"http://router/metrics": router, "http://p/metrics": p, "http://d/metrics": d}
    s = tune.watch(["http://router"], ["http://d", "http://down"], 2, 1, fetch=_fetch(pages), sleep=lambda _: None, prefills=["http://p"])
    assert s.waiting == {"prefill": 4.0, "decode": 0.0}  # one P of two DP engines: 3 + 1 waiting
    assert s.kv_usage == {"prefill": 0.5, "decode": 0.25}  # the older series name read too
    assert tune.recommend_ratio(s, CURRENT).recommended == "3:2"


def _fetch(pages: dict[str, str]) -> Any:
    def fetch(url: str) -> str:
        if url not in pages:
            raise tune.TuneError(f"{url}: Connection refused")
        return pages[url]

    return fetch
