"""Run a workload against a router: per-request TTFT, inter-token latency, end-to-end; server metrics before/after."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bpdkv.bench.workload import Conversation, WorkloadSpec

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
}


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


@dataclass
class RunResult:
    spec: WorkloadSpec
    label: str
    samples: list[Sample] = field(default_factory=list)
    servers: dict[str, dict[str, float]] = field(default_factory=dict)  # url → counter deltas
    wall_s: float = 0.0


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of one metric in Prometheus text whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in (labels or {}).items()):
            try:
                total += float(value)
            except ValueError:
                pass
    return total


def parse_metrics(text: str) -> dict[str, float]:
    return {key: metric_value(text, name, labels) for key, (name, labels) in SERVER_COUNTERS.items()}


async def scrape(session: aiohttp.ClientSession, urls: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for url in urls:
        try:
            async with session.get(url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                out[url] = parse_metrics(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError):
            out[url] = {}
    return out


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str], timeout: float
) -> tuple[Sample, str, list[int]]:
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    start = time.perf_counter()
    first: float | None = None
    stamps: list[float] = []
    text: list[str] = []
    token_ids: list[int] = []
    async with session.post(url + route, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        if resp.status != 200:
            detail = (await resp.text())[:200]
            return Sample(-1, -1, 0, None, None, time.perf_counter() - start, 0, f"HTTP {resp.status}: {detail}"), "", []
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
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    data = json.loads(event[6:])
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
    return Sample(-1, -1, 0, first, itl, e2e, max(len(stamps), len(token_ids))), "".join(text), token_ids


async def run_workload(
    url: str,
    spec: WorkloadSpec,
    label: str = "run",
    headers: dict[str, str] | None = None,
    metrics_urls: list[str] | None = None,
    timeout: float = 600.0,
    progress: Callable[[int], None] | None = None,
) -> RunResult:
    url = url.rstrip("/")
    result = RunResult(spec, label)
    conversations = [Conversation(spec, i) for i in range(spec.conversations)]
    queue: asyncio.Queue[Conversation] = asyncio.Queue()
    for conv in conversations:
        queue.put_nowait(conv)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        before = await scrape(session, metrics_urls or [])
        start = time.perf_counter()

        async def worker() -> None:
            while True:
                try:
                    conv = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                for turn in range(spec.turns):
                    body = conv.next_request(turn)
                    history = conv.history_tokens
                    try:
                        sample, text, ids = await one_request(session, url, body, headers or {}, timeout)
                    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                        sample, text, ids = Sample(-1, -1, 0, None, None, 0.0, 0, type(exc).__name__), "", []
                    sample.conversation, sample.turn, sample.history_tokens = conv.index, turn, history
                    result.samples.append(sample)
                    if progress:
                        progress(1)
                    if sample.error:
                        break
                    conv.record_answer(text, ids)
                    if spec.think_time:
                        await asyncio.sleep(spec.think_time)

        await asyncio.gather(*(worker() for _ in range(max(1, spec.concurrency))))
        result.wall_s = time.perf_counter() - start
        after = await scrape(session, metrics_urls or [])
    for u in metrics_urls or []:
        result.servers[u] = {k: after.get(u, {}).get(k, 0.0) - before.get(u, {}).get(k, 0.0) for k in SERVER_COUNTERS}
    return result
