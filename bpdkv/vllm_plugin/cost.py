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
- No estimate yet (a new link, no seed) → pull as before: the pull measures the link.
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
  SURPRISE× faster makes the next offer probe at once, one that agrees postpones P's own probe by an interval.
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
    NO_ESTIMATE = "no_estimate"  # nothing measured or seeded for this link or for P's compute yet: pull as before
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


def choose(
    req: Request,
    link: Fit | None,
    compute: Fit | None,
    margin: float = DEFAULT_MARGIN,
    lease_ceiling: float = DEFAULT_LEASE_MAX_S,
    probe_due: bool = False,
    probe_floor_s: float | None = None,
) -> Choice:
    """How many of the offered tokens to pull. `link`: seconds against bytes; `compute`: seconds against tokens.
    `probe_floor_s`: Link.probe_floor_s (a probe is sized to tell a slow link from a fixed cost that large)."""
    bs = req.block_size
    n = req.tokens - req.tokens % bs if bs > 0 else 0
    if req.tokens <= 0 or n <= 0 or (req.threshold > 0 and n < req.threshold):
        return Choice(Outcome.RECOMPUTED, Reason.BELOW_THRESHOLD, 0)
    if link is None or compute is None or compute.slope <= 0:
        return Choice(Outcome.PULLED, Reason.NO_ESTIMATE, n, link.at(_bytes(n, req)) if link else None)
    per_token_pull = link.slope * req.bytes_per_block / bs
    spt = compute.slope

    def pull(k: int) -> float:
        return link.at(_bytes(k, req))

    def pays(k: int) -> bool:
        return pull(k) <= (1.0 - margin) * k * spt

    longest = longest_pull(lease_ceiling)
    if pays(n) and pull(n) <= longest:
        return Choice(Outcome.PULLED, Reason.LINK_FASTER, n, pull(n), n * spt)
    floor = max(req.threshold, bs)
    if pays(n):
        # The whole pull pays but outlasts the lease ceiling: the longest prefix that fits, if it still pays (the
        # overhead weighs more on a shorter pull).
        k = int(max(longest - link.intercept, 0.0) / per_token_pull) if per_token_pull > 0 else n
        k = min(k - k % bs, n)
        if k >= floor and pays(k) and pull(k) <= longest:
            return Choice(Outcome.PARTIAL, Reason.LEASE_CEILING, k, pull(k), k * spt)
        return Choice(Outcome.RECOMPUTED, Reason.LEASE_CEILING, 0, pull(n), n * spt)
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
        rate = seed.get("prefill_tokens_per_s")
        if rate is not None:
            if not isinstance(rate, (int, float)) or rate <= 0:
                raise ValueError(f"{SEED_KEY}.prefill_tokens_per_s must be a positive number, got {rate!r}")
            book.compute = Estimate(seeded=Fit(0.0, 1.0 / float(rate)), rate_only=True)
        for host, values in (seed.get("links") or {}).items():
            try:
                r, a = float(values["bytes_per_s"]), float(values.get("overhead_s", 0.0))
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{SEED_KEY}.links.{host}: needs bytes_per_s (and overhead_s), got {values!r}") from None
            if r <= 0 or a < 0:
                raise ValueError(f"{SEED_KEY}.links.{host}: bytes_per_s must be positive and overhead_s not negative")
            book.seed_links[str(host)] = Fit(a, 1.0 / r)
        return book

    def link(self, key: str) -> Link:
        found = self.links.get(key)
        if found is None:
            host = key.rpartition(":")[0] or key
            seed = self.seed_links.get(host) or self.seed_links.get("*")
            estimate = Estimate(prior_intercept=seed.intercept if seed else 0.0, seeded=seed)
            found = self.links[key] = Link(estimate, probe_interval=self.probe_interval)
        return found

    def decide(self, key: str, req: Request, now: float, hint: Fit | None = None) -> Choice:
        """`hint`: the other end's estimate of this link (D's pulls of P's blocks, contracts.LINK_ESTIMATE). While P's
        own estimate says pulling does not pay, a hint SURPRISE× faster for this offer makes it a probe at once (the
        link may have recovered); a hint that agrees postpones P's own probe (the link is being measured anyway)."""
        link = self.link(key)
        if link.next_probe is None:
            link.next_probe = now + link.probe_interval
        probe_due = now >= link.next_probe
        choice = choose(req, link.estimate.fit, self.compute.fit, self.margin, self.lease_ceiling, False)
        if hint is not None and choice.reason is Reason.LINK_SLOWER and choice.predicted_pull_s:
            offered = choice_bytes(req)
            if hint.at(offered) * SURPRISE < choice.predicted_pull_s:
                probe_due = probe_due or now >= link.hints_ignored_until
            else:
                probe_due = False
                link.next_probe = max(link.next_probe, now + link.probe_interval)
        if choice.reason is Reason.LINK_SLOWER and probe_due:
            choice = choose(req, link.estimate.fit, self.compute.fit, self.margin, self.lease_ceiling, True, link.probe_floor_s)
        if choice.outcome is Outcome.PROBE:
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
