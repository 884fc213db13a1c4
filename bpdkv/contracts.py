"""Names shared on the wire and in the router config by the router, the vLLM node plugin, the renderer and the emulator.

Standard library only: the plugin imports this inside vLLM's process. One place for each literal, so a rename
cannot leave one side speaking an old name.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Any, Final

# ---- kv_transfer_params (vLLM NixlConnector, pull mode) -------------------------------------------------------------
KV_TRANSFER_PARAMS: Final = "kv_transfer_params"
DO_REMOTE_DECODE: Final = "do_remote_decode"
DO_REMOTE_PREFILL: Final = "do_remote_prefill"
REMOTE_ENGINE_ID: Final = "remote_engine_id"
REMOTE_BLOCK_IDS: Final = "remote_block_ids"
REMOTE_REQUEST_ID: Final = "remote_request_id"
REMOTE_HOST: Final = "remote_host"
REMOTE_PORT: Final = "remote_port"
REMOTE_NUM_TOKENS: Final = "remote_num_tokens"
REMOTE_BLOCKS_EXPIRY_TIME: Final = "remote_blocks_expiry_time"  # upstream: holder's clock, not comparable across hosts
REMOTE_PREFILL_CACHED_TOKENS: Final = "remote_prefill_cached_tokens"
# Where to pull from: cleared when P must compute locally.
REMOTE_LOCATION_KEYS: Final = (REMOTE_BLOCK_IDS, REMOTE_ENGINE_ID, REMOTE_REQUEST_ID, REMOTE_HOST, REMOTE_PORT)

# bpdkv's own keys, added by the node plugin on D's returned params.
REMOTE_BLOCKS_EXPIRES_IN: Final = "remote_blocks_expires_in"  # seconds left when D answered (clock-free, for the router)
BLOCK_DIGESTS: Final = "bpdkv_block_digests"  # chained per-block token digests of D's sequence (hex)
BLOCK_SIZE: Final = "bpdkv_block_size"
EXPIRES_AT: Final = "bpdkv_expires_at"  # D's wall clock (epoch s) when its blocks are freed
FENCE: Final = "bpdkv_fence"  # "host:port" of D's read fence (UDP): P pins the hold there before reading (vllm_plugin/fence.py)
# D's hold budget (node plugin, bpdkv/vllm_plugin/hold.py). D → router: ids of D requests whose held blocks D let go
# since its previous answer (budget, pressure): never offer them to P again (their blocks may belong to others now).
RELEASED_REQUEST_IDS: Final = "bpdkv_released_request_ids"
# Router → D, in D's request params: False = nobody will offer this turn's KV again (reuse off for it): hold nothing.
HOLD: Final = "bpdkv_hold"
# Router → D (any request's params): D request ids whose held blocks will not be offered again (taken, evicted).
RELEASE_REQUEST_IDS: Final = "bpdkv_release_request_ids"
# P → router, on P's answer: what became of the offered D blocks (verified, cut, mismatch, expiring, unverified_*).
PULL_OUTCOME: Final = "bpdkv_pull_outcome"
# Its values from P's cost model (bpdkv/vllm_plugin/cost.py): P computed locally because the pull was predicted slower
# than computing, or would have outlasted the longest pin lease (D's hold was let go at once); P pulled a prefix only
# (the rest computed: the lease ceiling, or a probe re-measuring a slow link).
PULL_LINK_SLOWER: Final = "link_slower"
PULL_LEASE_CEILING: Final = "lease_ceiling"
PULL_PARTIAL: Final = "partial"
PULL_PROBE: Final = "probe"
# Sent straight to P by `bpdkv calibrate` (never through the router, which strips clients' kv_transfer_params): pull
# what the digests allow whatever the cost model predicts — calibrate measures the pull.
PULL_ALWAYS: Final = "bpdkv_pull_always"
# D → router → P, on D's answer: D's own estimate of the link to the P it just pulled from ({"bytes_per_s",
# "overhead_s"}, its last pulls of P's blocks). P's cost model takes it as a free probe of the same link: a D that
# moves the bytes fast again makes P probe at once; one that confirms a slow link spares P a probe.
LINK_ESTIMATE: Final = "bpdkv_link_estimate"
# Router → D, in a continued turn's params (path decode_local: the turn goes straight to the D that holds the
# conversation, no P): compute the new tokens from your own prefix cache, then hold the result and return its location
# exactly as after a P/D turn (do_remote_decode true, remote_block_ids, …) so the next turn can again go either way.
# Sent with RELEASE_REQUEST_IDS naming the previous hold (superseded: its blocks are this turn's prefix) and, when
# no turn follows, HOLD false. A D without the plugin ignores it: it serves the turn from its cache and holds nothing.
LOCAL_TURN: Final = "bpdkv_local_turn"
# D → router, on a continued turn's answer (optional): prompt tokens D found in its own prefix cache.
LOCAL_CACHED_TOKENS: Final = "bpdkv_local_cached_tokens"
# P → router, on P's answer: how many prompt tokens P read from D's blocks for this request (0: nothing read — its own
# prefix cache covered them, the pull was under kv_recompute_threshold, or it was refused). A turn is a reuse `hit` only
# when this is > 0.
PULLED_TOKENS: Final = "bpdkv_pulled_tokens"

# Router → D, in D's request params (issue 40: holds ranked by predicted return). How soon this conversation is likely
# to come back once this turn ends, for D to rank the hold the turn leaves: keep in HBM what returns soon, demote to
# the host tier what returns later, drop first what may not return. The router cannot know how the turn ends before D
# generates it, so the forecast is per way it can end (TurnEnding values as keys → {RETURN_P50, RETURN_P90} seconds
# measured after such endings, or None while too few were seen) plus the router's guess (RETURN_LIKELY, RETURN_P_TOOL).
RETURN_FORECAST: Final = "bpdkv_return_forecast"
RETURN_P50: Final = "p50_s"
RETURN_P90: Final = "p90_s"
RETURN_SAMPLES: Final = "samples"  # the (decayed) number of returns the quantiles come from
RETURN_LIKELY: Final = "likely"  # a TurnEnding value: how this turn most likely ends
RETURN_P_TOOL: Final = "p_tool_calls"  # the router's probability that this turn ends in tool calls


class TurnEnding(str, enum.Enum):
    """How a turn ended, as the next request shows it: its last assistant message carries tool_calls (finish_reason
    "tool_calls": an agent loop waiting on a tool, back in seconds) or not (a final answer: back when a person is)."""

    TOOL_CALLS = "tool_calls"
    FINAL = "final"


def prefill_template() -> dict[str, Any]:
    """What the router sends P on a first turn: prefill for a remote decode, nothing to pull."""
    return {
        DO_REMOTE_DECODE: True,
        DO_REMOTE_PREFILL: False,
        REMOTE_ENGINE_ID: None,
        REMOTE_BLOCK_IDS: None,
        REMOTE_HOST: None,
        REMOTE_PORT: None,
    }


# ---- kv_connector_extra_config: written by render from the topology, read by vLLM's NixlConnector and the plugin ------
EXTRA_BACKENDS: Final = "backends"  # NIXL backends, e.g. ["UCX"] or ["LIBFABRIC"]
EXTRA_BIDIRECTIONAL: Final = "bidirectional_kv_xfer"  # D keeps its blocks after a turn and returns where they are
EXTRA_LEASE_DURATION: Final = "kv_lease_duration"  # seconds P holds its blocks for D (renewed by D's heartbeats)
EXTRA_BLOCKS_TTL: Final = "decoder_kv_blocks_ttl"  # seconds D keeps a finished request's blocks for the next turn
EXTRA_RECOMPUTE_THRESHOLD: Final = "kv_recompute_threshold"  # fewer tokens than this to pull: P computes them
EXTRA_UNVERIFIED_REUSE: Final = "unverified_reuse"  # bpdkv's: "refuse" | "allow" a pull from a D that sent no digests
EXTRA_HOLD_BUDGET: Final = "bpdkv_hold_budget"  # bpdkv's: share of D's KV cache blocks finished requests may hold, (0, 1]
EXTRA_PULL_DECISION: Final = "bpdkv_pull_decision"  # bpdkv's (P): PULL_DECISIONS (topology kv_transfer.pull_decision)
EXTRA_COST_SEED: Final = (
    "bpdkv_cost_seed"  # bpdkv's (P): its cost model's seed from `bpdkv calibrate` (topology kv_transfer.pull_cost_seed)
)
# bpdkv's (P): where `bpdkv apply` writes the links it measured after its gates (bpdkv/vllm_plugin/seedfile.py); P
# watches it. Rendered for every prefill instance as LINK_SEED_DIR/<instance>/LINK_SEED_NAME.
EXTRA_LINK_SEED_FILE: Final = "bpdkv_link_seed_file"
LINK_SEED_DIR: Final = "/var/lib/bpdkv"
LINK_SEED_NAME: Final = "link-seed.json"
# The host-memory tier (topology kv_host_memory_gib): vLLM 0.34's own OffloadingConnector beside the NIXL connector in a
# MultiConnector (vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py: kv_connector_extra_config
# "connectors", a list of whole connector configs, loads from the first that matches tokens, saves to all).
MULTI_CONNECTOR: Final = "MultiConnector"
MULTI_CONNECTORS: Final = "connectors"
OFFLOADING_CONNECTOR: Final = "OffloadingConnector"
OFFLOAD_CPU_BYTES: Final = "cpu_bytes_to_use"  # vllm/v1/kv_offload/cpu/spec.py: the tier's bytes, all TP workers together
OFFLOAD_PROMPT_ONLY: Final = "offload_prompt_only"  # vllm/v1/kv_offload/base.py: default true (answer blocks skipped)
# Defaults: upstream's (NixlConnector) for its keys; the topology, the plugin and the emulator all read these.
DEFAULT_LEASE_DURATION: Final = 30
DEFAULT_BLOCKS_TTL: Final = 480
DEFAULT_RECOMPUTE_THRESHOLD: Final = 64
DEFAULT_UNVERIFIED_REUSE: Final = "refuse"
# P's pull-or-recompute rule: "cost" pulls only where the pull is predicted faster than computing the same tokens
# (bpdkv/vllm_plugin/cost.py); "threshold" is upstream's rule, pull whenever kv_recompute_threshold tokens or more match.
PULL_DECISION_COST: Final = "cost"
PULL_DECISION_THRESHOLD: Final = "threshold"
PULL_DECISIONS: Final = (PULL_DECISION_COST, PULL_DECISION_THRESHOLD)
DEFAULT_PULL_DECISION: Final = PULL_DECISION_COST
# Why the default budget is a half (benchmarks/results/gpu-h200x2/session3/README.md): D must keep room for its
# live decodes (their KV grows every step) and for the next turns' prefills it pulls from P; held blocks beyond a
# half only raise reuse hits for conversations idle long enough that P's own cache covers most of them.
DEFAULT_HOLD_BUDGET: Final = 0.5

# ---- the router's reuse signals (bpdkv/router/metrics.py), read back by `bpdkv tune` (bpdkv/tune.py) ------------------
TURN_GAP_METRIC: Final = "bpdkv_router_turn_gap_seconds"  # histogram: end of turn k's answer → arrival of turn k+1
# The same gaps by how turn k ended (label `ending`: TurnEnding), for those that came back within the TTL (router/returns.py)
RETURN_GAP_METRIC: Final = "bpdkv_router_return_gap_seconds"
REUSE_MISSES_METRIC: Final = "bpdkv_router_reuse_misses"  # counter (Prometheus adds _total), label `cause`
REUSE_OUTCOME_METRIC: Final = "bpdkv_router_reuse"  # counter, label `outcome` (hit, partial, miss, ...)
# Seconds to 1 h: think time of chat users (tens of s) to agent loops paused on a tool or a human (tens of min).
TURN_GAP_BUCKETS: Final = (1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 240, 300, 360, 420, 480, 600, 720, 900, 1200, 1800, 2700, 3600)
# How long the router remembers when a conversation's turn ended (beyond its stored D location), so a turn arriving
# after the TTL is still seen — counted `expired`, its gap measured — up to the histogram's last bucket.
TURN_END_HORIZON_S: Final = 3600.0


class MissCause(str, enum.Enum):
    """Why a continued turn (one that extends a stored conversation) did not reuse D's KV: the label of
    bpdkv_router_reuse_misses. First turns are not misses (nothing could have been stored)."""

    EXPIRED = "expired"  # the turn came after the stored location's TTL (the router's)
    EXPIRING = "expiring"  # within the router's TTL, but P found D's hold about to expire (the TTL margin is too thin)
    RELEASED = "released"  # D let the hold go before its TTL (hold budget or memory pressure)
    RESTARTED = "restarted"  # the holding D restarted, was drained, ejected as unhealthy, or left the fleet
    NOTHING_STORED = "nothing_stored"  # no location stored for this history (D returned none, or the turn before was last)
    CONSUMED = "consumed"  # an earlier request of the same history took the location (a retried or regenerated turn)
    OTHER_HISTORY = "other_history"  # the session id's entry belongs to another history (left alone)
    OTHER_GENERATION = "other_generation"  # the holding D is of another P/D generation than the P available
    REFUSED_PIN = "refused_pin"  # P's pin on D's hold was refused or unanswered, or the pull was unverifiable
    MISMATCH = "mismatch"  # D's blocks did not match the prompt (P's digest check)
    PULL_FAILED = "pull_failed"  # P failed while pulling; the turn was computed instead
    COMPUTED = "computed"  # P decided to compute (predicted faster than the pull, its own cache, under the threshold)
    STORE_UNAVAILABLE = "store_unavailable"  # the session store (Redis) failed


# ---- HTTP headers and request fields (lower case: ASGI and aiohttp give lower-case names) ---------------------------
SESSION_HEADER: Final = "x-session-id"
SESSION_FIELDS: Final = ("session_id", "conversation_id")  # body fields naming a session; never forwarded to vLLM
REQUEST_ID_HEADER: Final = "x-request-id"
# Benchmark switches, per request: skip reuse (no lookup, no store), or give P a fresh cache_salt (emulates eviction).
REUSE_HEADER: Final = "x-bpdkv-reuse"  # value "off"
P_CACHE_HEADER: Final = "x-bpdkv-prefill-cache"  # value "off"
SWITCH_OFF: Final = "off"
# Client hint: this is the conversation's last turn. It still reuses the previous turn's KV, but D holds nothing for
# it and the router stores nothing (no later turn will pull), so D's hold budget stays free for live conversations.
LAST_TURN_HEADER: Final = "x-bpdkv-last-turn"  # value "true" (or "1", "yes")
LAST_TURN_VALUES: Final = frozenset({"true", "1", "yes"})
# Benchmark switch, per request: "pull-only" = never continue this turn on D (path decode_local off), for A/B runs.
PATHS_HEADER: Final = "x-bpdkv-paths"
PATHS_PULL_ONLY: Final = "pull-only"

# ---- router config (schemas/router.schema.json): keys written by render, read by the router --------------------------
ROUTER_DEFAULTS: Final[dict[str, Any]] = {
    "listen": "127.0.0.1",
    "port": 8000,
    "state": "memory",
    "session_identity": "auto",
    "session_ttl": 470.0,
    "expiry_margin": 10.0,
    "reuse": True,
    "backend_api_key_env": "BPDKV_BACKEND_API_KEY",
    "workers": 1,  # or "auto": 1 below 4 usable cores, else cores - 1 (router/workers.auto_workers)
    "max_body_bytes": 32 * 1024 * 1024,
    "max_json_depth": 64,
    "max_header_bytes": 64 * 1024,  # a request head (request line + headers) larger than this gets 431, connection closed
    "admin_key_file": None,
}
# Seconds (whole numbers, so the rendered YAML stays as people write it).
ROUTER_TIMEOUT_DEFAULTS: Final[dict[str, float]] = {"connect": 5, "prefill": 600, "decode_first_byte": 600, "decode_idle": 300}
# Router config keys a running router re-reads from its file without a restart (bpdkv/router/reload.py); the planner
# lets a cohort roll change only these without restarting the router (bpdkv/deploy/planner.py).
ROUTER_RELOADABLE_KEYS: Final[tuple[str, ...]] = ("prefill", "decode", "generations")
ROUTER_HEALTH_DEFAULTS: Final[dict[str, float]] = {"interval": 5, "failures_to_eject": 3, "backoff_max": 60}
# Per-turn paths (router.paths): a continued turn of at most local_max_tokens new tokens (estimated: exact for token-id
# prompts, else UTF-8 bytes of the new messages / chars_per_token plus per-message template overhead) runs on the D
# that holds the conversation, while D's engine is not queueing (waiting ≤ local_max_waiting), its KV cache usage is
# under local_max_kv_usage and the local prefills already in flight on it stay within local_max_tokens; 0 = off. While
# D streams, those prefills may add at most local_max_step_cost of D's measured step time to its streams' next gap
# (router/paths.py; 0 = the token cap alone).
ROUTER_PATHS_DEFAULTS: Final[dict[str, float]] = {
    "local_max_tokens": 512,
    "chars_per_token": 3.0,
    "local_max_waiting": 0,
    "local_max_kv_usage": 0.9,
    "local_max_step_cost": 0.05,
    "load_interval": 1.0,  # seconds between reads of each engine's /metrics (running, waiting, KV usage); 0 = never
}
# Slow clients: seconds for a request head (from the connection or the previous response) and for its whole body → 408.
ROUTER_CLIENT_TIMEOUT_DEFAULTS: Final[dict[str, float]] = {"header": 10, "body": 60}
# Redis the router node runs for itself when workers > 1 and the topology names no external Redis.
LOCAL_REDIS_PORT: Final = 6390
LOCAL_REDIS_URL: Final = f"redis://127.0.0.1:{LOCAL_REDIS_PORT}/0"


def local_redis_conf(router: str, port: int, work_dir: str) -> str:
    """redis-server config of the session store a multi-worker router runs for itself (render writes it, the router
    starts redis-server on it): loopback, no persistence (sessions are worth seconds), bounded memory dropping the
    entries nearest to expiry first."""
    return (
        f"# Managed by bpdkv: session store of router {router} (its workers share sessions through it).\n"
        "bind 127.0.0.1\n"
        f"port {port}\n"
        "protected-mode yes\n"
        "daemonize no\n"
        'save ""\n'
        "appendonly no\n"
        f"dir {work_dir}\n"
        "maxmemory 512mb\n"
        "maxmemory-policy volatile-ttl\n"
    )


# ---- the router's inbound API keys file (api_keys_file): written by render, read by the router ----------------------
KEY_DIGEST_PREFIX: Final = "sha256:"


def hashed_key_line(tenant: str, key: str) -> str:
    """One line of a keys file as render writes it: the tenant and the key's digest, never the key."""
    return f"{tenant} {KEY_DIGEST_PREFIX}{hashlib.sha256(key.encode()).hexdigest()}"
