"""Engine load signals: each P's and D's own vLLM `/metrics` (requests running and waiting, KV cache usage, the
inter-token gap histogram, and P's measured prefill rate from the node plugin), read about once a second per upstream,
bounded (one read per upstream in flight, a timeout, at most MAX_METRICS_BYTES scanned). What placement
(upstreams.Pool.pick) and the path decision (paths.py) read; a signal older than STALE_AFTER intervals is not used (the
router's own outstanding counts are). D's step time comes from a window of these reads (steps.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from bpdkv.router import steps
from bpdkv.router.upstream_http import UpstreamClient, UpstreamFailure
from bpdkv.router.upstreams import EngineLoad, Pool, Upstream

log = logging.getLogger("bpdkv.router")

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # 0.32 name, older name; a fraction 0..1
PREFILL_RATE = "vllm:bpdkv_prefill_tokens_per_second"  # the node plugin's gauge on P (0: not measured yet)
MAX_METRICS_BYTES = 4 * 1024 * 1024
STALE_AFTER = 3.0  # intervals


def _le(labels: str) -> float | None:
    for part in labels.split(","):
        key, _, value = part.partition("=")
        if key.strip() == "le":
            try:
                return float(value.strip().strip('"'))
            except ValueError:
                return None
    return None


def parse_load(text: str, at: float) -> EngineLoad | None:
    """The gauges from a Prometheus text exposition (running and waiting summed over a server's engines, KV usage
    the highest, the ITL histogram summed per bucket, the prefill rate the lowest measured); None when it has
    neither running nor waiting (not vLLM)."""
    running = waiting = 0.0
    kv: float | None = None
    rate: float | None = None
    itl: dict[float, float] = {}
    itl_seconds = 0.0
    itl_name: str | None = None
    seen = False
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, brace, rest = line.partition("{")
        labels, _, tail = rest.rpartition("}")
        fields = (tail if brace else name).split()
        name = name.split()[0] if not brace else name
        try:
            value = float(fields[0] if brace else fields[1])
        except (ValueError, IndexError):
            continue
        if name == RUNNING:
            running += value
            seen = True
        elif name == WAITING:
            waiting += value
            seen = True
        elif name in KV_USAGE:
            kv = value if kv is None else max(kv, value)
        elif name in (steps.ITL_BUCKET, steps.ITL_BUCKET_OLD) and itl_name in (None, name):
            le = _le(labels)
            if le is not None:
                itl_name = name
                itl[le] = itl.get(le, 0.0) + value
        elif name in (steps.ITL_SUM, steps.ITL_SUM_OLD) and itl_name in (None, name.removesuffix("_sum") + "_bucket"):
            itl_seconds += value
        elif name == PREFILL_RATE and value > 0:
            rate = value if rate is None else min(rate, value)
    if not seen:
        return None
    buckets = tuple(sorted(itl.items()))
    return EngineLoad(running, waiting, kv, at, itl_buckets=buckets, itl_seconds=itl_seconds, prefill_rate=rate)


async def read_load(member: Upstream, client: UpstreamClient, timeout: float) -> None:
    own = member.outstanding  # this router's requests there during the read: the most at its start or its end
    try:
        answer = await client.fetch("GET", member.url + "/metrics", None, {}, timeout)
    except UpstreamFailure:
        return  # health checks judge the upstream; a missed read only ages its signal
    if answer.status != 200:
        return
    load = parse_load(answer.content[:MAX_METRICS_BYTES].decode(errors="replace"), time.monotonic())
    if load is not None:
        member.engine_load = dataclasses.replace(load, own=max(own, member.outstanding))
        member.steps.add(load.at, load.itl_buckets, load.itl_seconds)


async def load_loop(pools: list[Pool], client: UpstreamClient, interval: float, stop: asyncio.Event) -> None:
    """Every interval: one bounded /metrics read per upstream, all at once."""
    timeout = max(min(interval, 2.0), 0.2)
    while not stop.is_set():
        await asyncio.gather(*(read_load(m, client, timeout) for p in pools for m in p.members))
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass
