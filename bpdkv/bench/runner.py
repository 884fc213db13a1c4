"""Run a workload against a router: per-request TTFT, inter-token latency, end-to-end; server metrics before/after."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bpdkv import contracts
from bpdkv.bench.workload import Conversation, WorkloadSpec
from bpdkv.prometheus_text import metric_value as metric_value  # re-exported: the tests read metrics through the bench
from bpdkv.sse import sse_events

SERVER_COUNTERS = {
    "external_tokens": ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
    "local_compute_tokens": ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    "local_cache_hit_tokens": ("vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}),
    "nixl_xfer_seconds_sum": ("vllm:nixl_xfer_time_seconds_sum", {}),
    "nixl_xfer_count": ("vllm:nixl_xfer_time_seconds_count", {}),
    "nixl_bytes_sum": ("vllm:nixl_bytes_transferred_sum", {}),
    "nixl_expired": ("vllm:nixl_num_kv_expired_reqs_total", {}),
    "bpdkv_verified_tokens": ("vllm:bpdkv_verified_tokens_total", {}),
    "bpdkv_mismatch_cuts": ("vllm:bpdkv_mismatch_cuts_total", {}),
    "bpdkv_expiring_refused": ("vllm:bpdkv_expiring_refused_total", {}),
    **{f"hold_released_{r}": (f"vllm:bpdkv_hold_released_{r}_total", {}) for r in ("pulled", "budget", "pressure", "ttl", "not_offered")},
    # Where the time goes per request (vLLM's own histograms): queued → scheduled, scheduled → first token, decode steps.
    "nixl_post_seconds_sum": ("vllm:nixl_post_time_seconds_sum", {}),
    "nixl_descriptors_sum": ("vllm:nixl_num_descriptors_sum", {}),
    "queue_seconds_sum": ("vllm:request_queue_time_seconds_sum", {}),
    "queue_count": ("vllm:request_queue_time_seconds_count", {}),
    "prefill_seconds_sum": ("vllm:request_prefill_time_seconds_sum", {}),
    "prefill_count": ("vllm:request_prefill_time_seconds_count", {}),
    "server_ttft_seconds_sum": ("vllm:time_to_first_token_seconds_sum", {}),
    "server_ttft_count": ("vllm:time_to_first_token_seconds_count", {}),
    "itl_seconds_sum": ("vllm:inter_token_latency_seconds_sum", {}),
    "itl_count": ("vllm:inter_token_latency_seconds_count", {}),
}
# Gauges sampled over time on D (sustained mode): KV usage split into held (finished, waiting for a pull) and live.
SERVER_GAUGES: dict[str, tuple[str, dict[str, str]]] = {
    "kv_usage": ("vllm:kv_cache_usage_perc", {}),
    "held_blocks": ("vllm:bpdkv_held_blocks", {}),
    "kv_blocks_total": ("vllm:bpdkv_kv_blocks_total", {}),
    "waiting": ("vllm:num_requests_waiting", {}),
    "running": ("vllm:num_requests_running", {}),
}
# Why D's requests wait (vLLM >= 0.24): "capacity" = not yet given blocks/a batch slot (what held blocks could cause),
# "deferred" = set aside, e.g. WAITING_FOR_REMOTE_KVS (a D request whose KV is still arriving from P). Only reported
# when the server exports the series: a missing series is not a zero.
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
WAITING_REASONS = {"waiting_capacity": "capacity", "waiting_deferred": "deferred"}


@dataclass
class Sample:
    conversation: int
    turn: int
    history_tokens: int
    ttft: float | None
    itl: float | None
    e2e: float
    output_tokens: int
    error: str | None = None
    started: float = 0.0  # seconds since the run began
    new_tokens: int = 0  # what this turn added to the conversation (workload.Conversation.turn_size)
    kind: str = ""  # first | turn | tool | doc


@dataclass(frozen=True)
class FreshState:
    """Did this mode start from the same state as the others? P's own cache hits during turn 1."""

    hit_tokens: float  # P's local prefix-cache hits while every conversation sent its first turn
    allowed_tokens: float  # what a fresh P hits at most: the shared system prompt, once per conversation after the first
    fresh: bool


@dataclass
class RunResult:
    spec: WorkloadSpec
    label: str
    samples: list[Sample] = field(default_factory=list)
    servers: dict[str, dict[str, float]] = field(default_factory=dict)  # url → counter deltas
    wall_s: float = 0.0
    fresh: FreshState | None = None
    timeline: list[dict[str, float]] = field(default_factory=list)  # sustained mode: D's gauges over time
    gaps: list[float] = field(default_factory=list)  # every inter-token gap of every stream (ITL percentiles)


@dataclass(frozen=True)
class Servers:
    """Whose /metrics to read: P's (turn-1 cache check) and D's (KV usage over time); `other` only for counters."""

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    other: tuple[str, ...] = ()

    @property
    def all(self) -> list[str]:
        return list(dict.fromkeys(self.prefill + self.decode + self.other))


DECISIONS = "vllm:bpdkv_pull_decisions_total"  # P's cost model, by outcome and reason (keys "decision:outcome/reason")
DECISION_KEY = "decision:"


def decision_counts(text: str) -> dict[str, float]:
    """P's pull decisions by "decision:outcome/reason", summed over engines."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(DECISIONS + "{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("{", 1)[1].rsplit("}", 1)[0]))
        outcome, reason = labels.get("outcome", ""), labels.get("reason", "")
        try:
            value = float(line.rpartition(" ")[2])
        except ValueError:
            continue
        key = f"{DECISION_KEY}{outcome}/{reason}"
        out[key] = out.get(key, 0.0) + value
    return out


def parse_metrics(text: str) -> dict[str, float]:
    out = {key: metric_value(text, name, labels) for key, (name, labels) in SERVER_COUNTERS.items()}
    out.update(decision_counts(text))
    out.update({key: metric_value(text, name, labels) for key, (name, labels) in SERVER_GAUGES.items()})
    if any(line.startswith(WAITING_BY_REASON + "{") for line in text.splitlines()):
        out.update({key: metric_value(text, WAITING_BY_REASON, {"reason": r}) for key, r in WAITING_REASONS.items()})
    return out


async def scrape(session: aiohttp.ClientSession, urls: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for url in urls:
        try:
            async with session.get(url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                out[url] = parse_metrics(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError):
            out[url] = {}
    return out


def fresh_state(
    spec: WorkloadSpec, before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], prefill: list[str]
) -> FreshState:
    hits = sum(after.get(u, {}).get("local_cache_hit_tokens", 0.0) - before.get(u, {}).get("local_cache_hit_tokens", 0.0) for u in prefill)
    # A fresh P computes each conversation's first prompt but may reuse the shared system prompt (whole blocks of it)
    # from the conversations before. Chat: system_tokens counts words; allow for their tokens and the chat template.
    shared = spec.system_tokens if spec.mode == "tokens" else 2 * spec.system_tokens + 64
    allowed = float(max(spec.conversations - 1, 0) * shared)
    return FreshState(hits, allowed, hits <= allowed)


def counter_deltas(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], urls: list[str]) -> dict[str, dict[str, float]]:
    def keys(u: str) -> list[str]:
        seen = {k for side in (before.get(u, {}), after.get(u, {})) for k in side if k.startswith(DECISION_KEY)}
        return list(SERVER_COUNTERS) + sorted(seen)

    return {u: {k: after.get(u, {}).get(k, 0.0) - before.get(u, {}).get(k, 0.0) for k in keys(u)} for u in urls}


def d_gauges(scraped: dict[str, dict[str, float]], decode: list[str]) -> dict[str, float]:
    """D's KV usage split: held = finished requests' blocks waiting for a pull, live = the rest of what is used."""
    total = sum(scraped.get(u, {}).get("kv_blocks_total", 0.0) for u in decode)
    held = sum(scraped.get(u, {}).get("held_blocks", 0.0) for u in decode)
    usage = sum(scraped.get(u, {}).get("kv_usage", 0.0) for u in decode) / max(len(decode), 1)
    held_share = held / total if total else 0.0
    out = {
        "kv_usage": usage,
        "held_share": held_share,
        "live_share": max(usage - held_share, 0.0),
        "held_blocks": held,
        "waiting": sum(scraped.get(u, {}).get("waiting", 0.0) for u in decode),
        "running": sum(scraped.get(u, {}).get("running", 0.0) for u in decode),
    }
    for key in WAITING_REASONS:
        if decode and all(key in scraped.get(u, {}) for u in decode):
            out[key] = sum(scraped[u][key] for u in decode)
    return out


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str], timeout: float
) -> tuple[Sample, str, list[int], list[float]]:
    """One request: its sample, the text and token ids it answered, and its inter-token gaps (seconds)."""
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    start = time.perf_counter()
    first: float | None = None
    stamps: list[float] = []
    text: list[str] = []
    token_ids: list[int] = []
    async with session.post(url + route, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        if resp.status != 200:
            detail = (await resp.text())[:200]
            return Sample(-1, -1, 0, None, None, time.perf_counter() - start, 0, f"HTTP {resp.status}: {detail}"), "", [], []
        if not body.get("stream"):
            data = await resp.json()
            first = time.perf_counter() - start
            choice = data["choices"][0]
            text.append(choice.get("text") or (choice.get("message") or {}).get("content") or "")
            token_ids = list(choice.get("token_ids") or [])
        else:
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for data in sse_events(event):  # the one SSE parser (bpdkv.sse)
                        for choice in data.get("choices") or []:
                            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                            ids = choice.get("token_ids") or []
                            if piece or ids:
                                now = time.perf_counter() - start
                                if first is None:
                                    first = now
                                stamps.append(now)
                                text.append(piece)
                                token_ids += ids
    e2e = time.perf_counter() - start
    itl = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    sample = Sample(-1, -1, 0, first, itl, e2e, max(len(stamps), len(token_ids)))
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return sample, "".join(text), token_ids, gaps


async def conversation_turns(
    session: aiohttp.ClientSession,
    url: str,
    conv: Conversation,
    turns: range,
    result: RunResult,
    headers: dict[str, str],
    timeout: float,
    t0: float,
    progress: Callable[[int], None] | None,
    think: Callable[[], float] | None = None,
    deadline: float | None = None,
) -> bool:
    """Send a conversation's turns in order; False when one failed (the conversation stops there)."""
    for turn in turns:
        if deadline is not None and time.perf_counter() >= deadline:
            return True
        body = conv.next_request(turn)
        history = conv.history_tokens
        started = time.perf_counter() - t0
        sent = headers
        if conv.spec.mark_last_turn and turn == conv.spec.turns - 1:
            sent = {**headers, contracts.LAST_TURN_HEADER: "true"}
        try:
            sample, text, ids, gaps = await one_request(session, url, body, sent, timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            sample, text, ids, gaps = Sample(-1, -1, 0, None, None, 0.0, 0, type(exc).__name__), "", [], []
        sample.conversation, sample.turn, sample.history_tokens, sample.started = conv.index, turn, history, started
        sample.new_tokens, sample.kind = conv.new_tokens, conv.kind
        result.gaps += gaps
        result.samples.append(sample)
        if progress:
            progress(1)
        if sample.error:
            return False
        conv.record_answer(text, ids)
        pause = think() if think else conv.spec.think_time
        if deadline is not None:
            pause = min(pause, max(deadline - time.perf_counter(), 0.0))
        if pause and turn + 1 < turns.stop:
            await asyncio.sleep(pause)
    return True


async def run_workload(
    url: str,
    spec: WorkloadSpec,
    label: str = "run",
    headers: dict[str, str] | None = None,
    metrics_urls: list[str] | None = None,
    timeout: float = 600.0,
    progress: Callable[[int], None] | None = None,
    servers: Servers | None = None,
) -> RunResult:
    """Every conversation's turns; with P's metrics URLs, turn 1 of all conversations goes first and P's cache hits
    during it are checked (a mode that finds its prompts already cached on P did not start fresh)."""
    url = url.rstrip("/")
    servers = servers or Servers(other=tuple(metrics_urls or ()))
    urls = servers.all
    result = RunResult(spec, label)
    conversations = [Conversation(spec, i) for i in range(spec.conversations)]
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        before = await scrape(session, urls)
        start = time.perf_counter()
        gate = asyncio.Semaphore(max(1, spec.concurrency))
        alive: dict[int, bool] = {}
        done_at: dict[int, float] = {}

        async def run(conv: Conversation, turns: range, delay: float = 0.0) -> None:
            if not alive.get(conv.index, True):
                return
            await asyncio.sleep(delay)
            async with gate:
                alive[conv.index] = await conversation_turns(session, url, conv, turns, result, headers or {}, timeout, start, progress)
            done_at[conv.index] = time.perf_counter()

        first_turn_only = bool(servers.prefill) and spec.turns > 1
        if first_turn_only:
            await asyncio.gather(*(run(c, range(0, 1)) for c in conversations))
            result.fresh = fresh_state(spec, before, await scrape(session, list(servers.prefill)), list(servers.prefill))
            # Each conversation goes on as late after the others as its first turn ended: the check must not make every
            # conversation send turn 2 at the same instant (that would pile all pulls onto one moment).
            first_done = min(done_at.values(), default=0.0)
            delays = {c.index: done_at.get(c.index, first_done) - first_done for c in conversations}
        else:
            delays = {}
        await asyncio.gather(*(run(c, range(1 if first_turn_only else 0, spec.turns), delays.get(c.index, 0.0)) for c in conversations))
        result.wall_s = time.perf_counter() - start
        after = await scrape(session, urls)
    result.servers = counter_deltas(before, after, urls)
    return result
