"""Prometheus metrics of one router (own registry, so several routers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
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
        self.released = Counter("bpdkv_router_released_holds", "Held D blocks D announced it let go (never offered again)", registry=r)
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
        self.active_sessions = Gauge("bpdkv_router_active_sessions", "Stored, unexpired sessions", registry=r)
        self.backend_healthy = Gauge("bpdkv_router_backend_healthy", "1 if the upstream is usable", ["role", "upstream"], registry=r)
        self.outstanding = Gauge("bpdkv_router_backend_outstanding", "Requests in flight per upstream", ["role", "upstream"], registry=r)
        self.store_errors = Counter("bpdkv_router_store_errors", "Session store (Redis) failures; served without reuse", registry=r)
        self.disconnects = Counter("bpdkv_router_client_disconnects", "Clients that went away mid-request", registry=r)
        self.in_flight = Gauge("bpdkv_router_in_flight", "Client requests in flight", registry=r)
