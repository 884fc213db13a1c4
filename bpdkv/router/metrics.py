"""Prometheus metrics of one router (own registry, so several routers can live in one process).

With several worker processes a scrape lands on any one of them, so the supervisor gives every worker the same
PROMETHEUS_MULTIPROC_DIR (prometheus-client's multiprocess mode: each process writes its values to memory-mapped files
there) and /metrics aggregates all the workers' files. prometheus-client picks its value storage when it is first
imported, so the variable must be in the worker's environment from its start: the supervisor sets it only for workers,
and a single router keeps the plain in-memory values (no file writes on the hot path).
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from bpdkv import contracts
from bpdkv.router.paths import TurnPath
from bpdkv.router.sessions import Reuse

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.multiprocess_dir = os.environ.get(MULTIPROC_DIR_ENV) or None
        r = self.registry
        self.requests = Counter("bpdkv_router_requests", "Client requests by route and status", ["route", "status"], registry=r)
        self.reuse = Counter(
            "bpdkv_router_reuse",
            "Reuse outcome per request: hit, partial, miss, mismatch, expired, refused, skipped, unavailable",
            ["outcome"],
            registry=r,
        )
        self.stored = Counter("bpdkv_router_sessions_stored", "D locations stored for a next turn", registry=r)
        self.store_refused = Counter(
            "bpdkv_router_sessions_not_stored", "D locations not stored: a live entry of that session id has another history", registry=r
        )
        self.reuse_fallbacks = Counter(
            "bpdkv_router_reuse_fallbacks", "Turns P failed while pulling D's KV, served again without D's params", ["reason"], registry=r
        )
        self.pull_outcomes = Counter(
            "bpdkv_router_pull_outcomes", "What P's connector did with the D blocks offered (bpdkv plugin)", ["outcome"], registry=r
        )
        self.last_turns = Counter(
            "bpdkv_router_last_turns", "Turns the client marked last (X-Bpdkv-Last-Turn): not stored, D told not to hold", registry=r
        )
        self.released = Counter("bpdkv_router_released_holds", "Held D blocks D announced it let go (never offered again)", registry=r)
        self.paths = Counter(
            "bpdkv_router_paths",
            "Turns by path (decode_local, prefill_pull, prefill_full) and the reason it was taken",
            ["path", "reason"],
            registry=r,
        )
        self.new_tokens = Histogram(
            "bpdkv_router_turn_new_tokens",
            "Estimated new tokens of continued turns (beyond the stored history), by the path taken",
            ["path"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.engine_running = Gauge(
            "bpdkv_router_engine_running",
            "Requests running on the engine (its /metrics)",
            ["role", "upstream"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.engine_waiting = Gauge(
            "bpdkv_router_engine_waiting",
            "Requests waiting in the engine (its /metrics)",
            ["role", "upstream"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.engine_kv_usage = Gauge(
            "bpdkv_router_engine_kv_usage",
            "Engine KV cache usage, 0..1 (its /metrics)",
            ["role", "upstream"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.engine_step = Gauge(
            "bpdkv_router_engine_step_seconds",
            "D's step time: the median of its streams' inter-token gaps over the last minute (its /metrics)",
            ["role", "upstream"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.local_budget = Gauge(
            "bpdkv_router_local_budget_tokens",
            "New tokens a continued turn may have on this D while it streams (paths.local_max_step_cost of its step)",
            ["role", "upstream"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.api_turns = Counter(
            "bpdkv_router_api_turns",
            "Turns by client API (chat_completions, completions, messages, responses), path and reuse outcome",
            ["api", "path", "reuse"],
            registry=r,
        )
        self.rejected = Counter("bpdkv_router_rejected", "Requests the router refused before any upstream saw them", ["reason"], registry=r)
        self.d_params_missing = Counter(
            "bpdkv_router_d_params_missing", "D finished without returning kv_transfer_params (unpatched streaming?)", registry=r
        )
        self.ttft = Histogram("bpdkv_router_ttft_seconds", "Time to first byte sent to the client", buckets=LATENCY_BUCKETS, registry=r)
        self.upstream = Histogram(
            "bpdkv_router_upstream_seconds",
            "Upstream latency (P: whole request, D: to first byte)",
            ["role"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter("bpdkv_router_upstream_errors", "Upstream failures", ["role", "upstream", "kind"], registry=r)
        self.retries = Counter("bpdkv_router_retries", "Requests retried on another upstream", ["role"], registry=r)
        self.active_sessions = Gauge(
            # The count comes from the shared store, the same for every worker: the latest one set is right.
            "bpdkv_router_active_sessions",
            "Stored, unexpired sessions",
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.backend_healthy = Gauge(
            # Each worker has its own health view: 1 only if every live worker finds the upstream usable.
            "bpdkv_router_backend_healthy",
            "1 if the upstream is usable",
            ["role", "upstream"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.outstanding = Gauge(
            "bpdkv_router_backend_outstanding",
            "Requests in flight per upstream",
            ["role", "upstream"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.store_errors = Counter("bpdkv_router_store_errors", "Session store (Redis) failures; served without reuse", registry=r)
        self.disconnects = Counter("bpdkv_router_client_disconnects", "Clients that went away mid-request", registry=r)
        self.in_flight = Gauge("bpdkv_router_in_flight", "Client requests in flight", registry=r, multiprocess_mode="livesum")
        # The signals `bpdkv tune` reads (docs/operations.md, Tuning): how long users take between turns, and why a
        # continued turn did not reuse D's KV.
        self.turn_gap = Histogram(
            contracts.TURN_GAP_METRIC,
            "Seconds from the end of a conversation's turn (its location stored) to the arrival of its next turn",
            buckets=contracts.TURN_GAP_BUCKETS,
            registry=r,
        )
        self.reuse_misses = Counter(
            contracts.REUSE_MISSES_METRIC, "Continued turns that did not reuse D's KV, by cause", ["cause"], registry=r
        )
        # Every cause and outcome exported from the start (0): a series born at its first event loses that event to
        # Prometheus' increase() (no earlier sample), which `bpdkv tune --prometheus` reads.
        for cause in contracts.MissCause:
            self.reuse_misses.labels(cause.value)
        for outcome in Reuse:
            self.reuse.labels(outcome.value)
        for path in TurnPath:
            self.new_tokens.labels(path.value)
        self._children: dict[tuple[Any, ...], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """metric.labels(*labels), kept: labels() takes a lock and validates its arguments on every call (hot path)."""
        key = (id(metric), *labels)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = metric.labels(*labels)
        return got

    def miss(self, cause: contracts.MissCause) -> None:
        self.child(self.reuse_misses, cause.value).inc()

    def gap(self, seconds: float) -> None:
        if seconds >= 0:  # a clock stepped back: no measurement
            self.turn_gap.observe(seconds)

    def exposition(self) -> bytes:
        """The text /metrics answers: this router's registry, or every worker's values in multiprocess mode."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, self.multiprocess_dir)
        return generate_latest(registry)
