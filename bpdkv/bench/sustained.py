"""Sustained agentic load: N conversations at once for M minutes, each waiting a tool call's latency between turns.

A conversation that reaches its last turn ends and a new one takes its place, so N stay active and P's prefix cache
sees new prompts all the time (natural eviction, no salting). D's KV usage (live/held), its waiting count and the
counters are sampled every few seconds; TTFT is reported per time window.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import aiohttp

from bpdkv.bench.runner import RunResult, Servers, conversation_turns, counter_deltas, d_gauges, fresh_state, scrape
from bpdkv.bench.workload import Conversation, WorkloadSpec


@dataclass(frozen=True)
class ToolLatency:
    """Think time between a reply and the next turn: log-normal, as tool calls are (many quick, a long tail)."""

    median_s: float = 2.0
    sigma: float = 1.0
    max_s: float = 60.0

    def sample(self, rng: random.Random) -> float:
        return min(self.max_s, self.median_s * math.exp(rng.gauss(0.0, self.sigma)))


@dataclass(frozen=True)
class SustainedSpec:
    duration_s: float = 600.0
    think: ToolLatency = ToolLatency()
    sample_every_s: float = 2.0

    def to_json(self) -> dict[str, object]:
        return asdict(self)


async def run_sustained(
    url: str,
    spec: WorkloadSpec,
    sustained: SustainedSpec,
    servers: Servers,
    label: str = "sustained",
    headers: dict[str, str] | None = None,
    timeout: float = 600.0,
    progress: Callable[[int], None] | None = None,
) -> RunResult:
    """spec.conversations at once, spec.turns each, new conversations replacing finished ones until the deadline."""
    url = url.rstrip("/")
    result = RunResult(spec, label)
    rng = random.Random(spec.seed)
    next_index = spec.conversations
    urls = servers.all
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        before = await scrape(session, urls)
        start = time.perf_counter()
        deadline = start + sustained.duration_s
        fresh_checked = asyncio.Event()
        first_turns_left = spec.conversations

        async def slot(index: int) -> None:
            nonlocal next_index, first_turns_left
            conv = Conversation(spec, index)
            first = True
            while time.perf_counter() < deadline:
                # Turn 1 of the first N conversations goes first, then P's cache hits are checked (fresh start).
                ok = await conversation_turns(session, url, conv, range(0, 1), result, headers or {}, timeout, start, progress)
                if first:
                    first, first_turns_left = False, first_turns_left - 1
                    if first_turns_left == 0:
                        fresh_checked.set()
                    await fresh_checked.wait()
                if ok:
                    # Think time, but never past the deadline: a run ends when it says, not up to a capped tool call later.
                    await asyncio.sleep(min(sustained.think.sample(rng), max(deadline - time.perf_counter(), 0.0)))
                    ok = await conversation_turns(
                        session,
                        url,
                        conv,
                        range(1, spec.turns),
                        result,
                        headers or {},
                        timeout,
                        start,
                        progress,
                        think=lambda: sustained.think.sample(rng),
                        deadline=deadline,
                    )
                if not ok:  # a failed turn ends that conversation; the error is in the samples
                    await asyncio.sleep(1.0)
                conv = Conversation(spec, next_index)
                next_index += 1

        async def sampler() -> None:
            while time.perf_counter() < deadline:
                scraped = await scrape(session, list(servers.decode))
                result.timeline.append({"t": time.perf_counter() - start, **d_gauges(scraped, list(servers.decode))})
                await asyncio.sleep(sustained.sample_every_s)

        async def check_fresh() -> None:
            await fresh_checked.wait()
            if servers.prefill:
                after_first = await scrape(session, list(servers.prefill))
                result.fresh = fresh_state(spec, before, after_first, list(servers.prefill))

        await asyncio.gather(*(slot(i) for i in range(spec.conversations)), sampler(), check_fresh())
        result.wall_s = time.perf_counter() - start
        after = await scrape(session, urls)
    result.servers = counter_deltas(before, after, urls)
    return result
