"""D's step time, measured: the median of its engine's inter-token gaps over the last WINDOW_S seconds, from the
`vllm:inter_token_latency_seconds` histogram the router already reads with each engine's load (engines.py).

vLLM's histogram is cumulative since the engine started; the window is the difference between the newest read and
the oldest read still inside it, so the median is of the gaps D's streams saw lately. The quantile is interpolated
inside its bucket as Prometheus' histogram_quantile does. A counter that went down (the engine restarted) starts the
window again. Too few gaps in the window (MIN_GAPS) is no measurement.

vLLM's first ITL bucket ends at 10 ms, so a fast D's median interpolates to about 5 ms whatever it is; the window's
mean gap (the histogram's sum over its count) is exact, and higher than the median only when long gaps pull it up. The
step time is the lower of the two: never above either estimate of a typical step.

Why the median and not the p99: the budget of a continued turn (paths.py) bounds what one local prefill adds to one
of D's steps to a share of a step. Gaps that earlier local prefills lengthened sit in the histogram's tail, so a p99
base would grow with every local turn it allowed (the budget would feed itself); the median does not move with rare
long steps, and a bound on the median is a tighter bound on the p99."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

ITL = "vllm:inter_token_latency_seconds"
ITL_OLD = "vllm:time_per_output_token_seconds"  # before vLLM 0.11's name
ITL_BUCKET, ITL_BUCKET_OLD = ITL + "_bucket", ITL_OLD + "_bucket"
ITL_SUM, ITL_SUM_OLD = ITL + "_sum", ITL_OLD + "_sum"
WINDOW_S = 60.0
MIN_GAPS = 32

Buckets = tuple[tuple[float, float], ...]  # (upper bound "le", cumulative count), ascending; +Inf last


def quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile of a (cumulative) histogram, interpolated inside its bucket; None when it is empty. A quantile in
    the +Inf bucket is the largest finite bound (histogram_quantile's answer)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


def delta(new: Buckets, old: Buckets) -> Buckets | None:
    """new - old, bucket by bucket; None when they do not line up or a count went down (the engine restarted)."""
    if len(new) != len(old) or any(a[0] != b[0] for a, b in zip(new, old, strict=True)):
        return None
    out = tuple((le, count - before) for (le, count), (_, before) in zip(new, old, strict=True))
    return None if any(c < 0 for _, c in out) else out


@dataclass
class StepWindow:
    """The reads of one engine's ITL histogram (and its sum of seconds) within the last WINDOW_S seconds, oldest
    first."""

    reads: deque[tuple[float, Buckets, float]] = field(default_factory=deque)

    def add(self, at: float, buckets: Buckets, seconds: float = 0.0) -> None:
        if not buckets:
            return
        if self.reads and (delta(buckets, self.reads[-1][1]) is None or seconds < self.reads[-1][2]):
            self.reads.clear()  # restarted, or another layout: what came before is another engine's
        self.reads.append((at, buckets, seconds))
        while len(self.reads) > 2 and at - self.reads[1][0] >= WINDOW_S:
            self.reads.popleft()  # keep one read at or before the window's start as its base

    def median(self, now: float, fresh_for: float) -> float | None:
        """D's step time over the window, in seconds: its median inter-token gap, or the mean gap where that is lower
        (the module's docstring); None with no fresh read or too few gaps."""
        if len(self.reads) < 2 or now - self.reads[-1][0] > fresh_for:
            return None
        (_, new, new_s), (_, old, old_s) = self.reads[-1], self.reads[0]
        window = delta(new, old)
        if window is None or window[-1][1] < MIN_GAPS:
            return None
        median = quantile(0.5, window)
        mean = (new_s - old_s) / window[-1][1] if new_s > old_s else None
        return min(median, mean) if median is not None and mean is not None else median
