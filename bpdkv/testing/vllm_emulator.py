"""A protocol-faithful vLLM P/D **emulator** — a test double, not vLLM.

It speaks the NixlConnector pull-mode, bidirectional protocol of docs/design.md exactly as the router sees it:
P answers one token and holds its blocks on a lease; D pulls them, generates, keeps its own blocks for
`decoder_kv_blocks_ttl` and returns their location; P pulls D's blocks next turn unless fewer than the threshold
would be reused; a pull is single-use; reads of expired blocks (or within 5 s of expiry) are declined, which
gives HTTP 500 with `kv_load_failure_policy=fail` and a hang with `recompute` — like upstream.

"KV" here is the token list itself, so the emulator can tell when a pull copied the KV of *different* tokens
(upstream's defect) and then, like the real thing, answers differently. Tokens are the UTF-8 bytes of a ChatML
rendering; generation is a deterministic function of the prompt tokens, so a single emulator without
kv_transfer_params is the reference server.

It also answers vLLM's other agent APIs, `/v1/messages` (Anthropic) and `/v1/responses` (OpenAI), as vLLM does: the
request converted to a chat request, served as one, and the chat answer converted back — the conversions are the
router's surfaces (bpdkv/router/messages.py, responses.py), which follow vLLM's; a single emulator is then the
reference server for those APIs too. Like vLLM without VLLM_ENABLE_RESPONSES_API_STORE, it stores no response
(`previous_response_id` is refused).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from bpdkv import contracts
from bpdkv.vllm_plugin import cost, decide, digests, hold

# Engines of this process, by engine id: the emulated NIXL fabric.
FABRIC: dict[str, VllmEmulator] = {}
DECLINE_WITHIN = 5.0  # seconds: P declines reads this close to expiry (upstream behaviour)
BYTES_PER_TOKEN = 1024  # what an emulated pull moves per token (nixl_bytes)
# What the bpdkv connector reports when its cost model computed locally (bpdkv/vllm_plugin/connector.py).
DECLINED_OUTCOME = {cost.Reason.LINK_SLOWER: contracts.PULL_LINK_SLOWER, cost.Reason.LEASE_CEILING: contracts.PULL_LEASE_CEILING}
ALPHABET = "abcdefghijklmnopqrstuvwxyz     .,"


@dataclass
class Held:
    tokens: list[int]
    expires_at: float  # perf_counter clock of the holder, as upstream


@dataclass
class EmulatorSettings:
    role: str = "decode"  # "prefill" | "decode" | "both" (plain server)
    model: str = "emulated"
    decoder_kv_blocks_ttl: float = float(contracts.DEFAULT_BLOCKS_TTL)
    kv_recompute_threshold: int = contracts.DEFAULT_RECOMPUTE_THRESHOLD
    kv_lease_duration: float = float(contracts.DEFAULT_LEASE_DURATION)
    kv_load_failure_policy: str = "fail"
    block_size: int = 16
    stream_params: bool = True  # False emulates stock vLLM: no kv_transfer_params in streams
    relative_expiry: bool = True  # the bpdkv plugin adds remote_blocks_expires_in
    first_token_delay: float = 0.0
    token_interval: float = 0.0
    prefill_seconds_per_token: float = 0.0
    pull_seconds_per_token: float = 0.0
    pull_fixed_seconds: float = 0.0  # per pull, whatever its size (descriptor set-up, notification round trip)
    max_hang: float = 600.0  # bound of the "recompute" hang
    prefix_caching: bool = True  # False emulates a P whose cache was evicted between turns
    prefill_plugin: bool = False  # P runs the bpdkv connector: refuses expiring blocks, cuts pulls where tokens differ
    pull_decision: str = contracts.DEFAULT_PULL_DECISION  # the connector's bpdkv_pull_decision: cost | threshold
    # P's connector also says how many tokens it read from D (bpdkv_pulled_tokens), as the plugin does in its recorded
    # answers (tests/data/vllm_contract/pd_prefill_*); False emulates a plugin from before that count.
    report_pulled_tokens: bool = True
    max_model_len: int = 1 << 20  # tokens (here: bytes of the rendering); longer prompts get vLLM's 400
    reasoning_parser: bool = False  # vLLM's `gemma4` reasoning parser: thoughts apart from the content, reasoning_tokens
    max_num_seqs: int = 0  # engine slots: requests beyond them count as waiting in /metrics (0: unlimited)
    kv_capacity_tokens: int = 0  # KV cache size for /metrics' usage: held and running tokens over it (0: usage 0)
    # D: the node plugin's hold budget (share of kv_capacity_tokens' blocks). Set, D keeps at most that many held
    # blocks (over it, the oldest holds go and D's answer names them, as the plugin's ledger and announcement do) and
    # /metrics carries the plugin's hold gauges. None: holds unbounded, no hold gauges.
    kv_hold_budget: float | None = None
    # D: a host-memory tier (topology kv_host_memory_gib) of this many tokens; 0: none. With a hold budget, a hold over
    # it is demoted there instead of released — still offerable, not announced — and announced released only when the
    # tier, least recently demoted first, has no room for it. A pull of a demoted hold waits for D to reload it into HBM
    # (host_reload_seconds_per_token: PCIe, far below a prefill's per-token time).
    kv_host_tier_tokens: int = 0
    host_reload_seconds_per_token: float = 0.0
    vllm_version: str = "0.32.0"  # GET /version; engines of different releases fail NIXL's handshake (no read)
    model_root: str | None = None  # GET /v1/models' root (vLLM: the --model argument); None: not reported


# vLLM's inter-token latency buckets (vllm/v1/metrics: INTER_TOKEN_LATENCY_BUCKETS), seconds.
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass
class VllmEmulator:
    settings: EmulatorSettings
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    held: dict[str, Held] = field(default_factory=dict)
    prefix_cache: set[bytes] = field(default_factory=set)
    counters: dict[str, float] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)  # what arrived (for tests)
    healthy: bool = True
    health_delay: float = 0.0  # seconds /health takes to answer (a busy or briefly stalled server)
    # P with the bpdkv connector: its cost model, fed with the emulated compute and pull times it measures itself.
    book: cost.Book = field(default_factory=cost.Book)
    running: int = 0  # requests being served now (in /metrics as running, or waiting beyond max_num_seqs)
    running_tokens: int = 0
    load_override: tuple[float, float, float] | None = None  # tests: (running, waiting, KV usage) /metrics reports
    # tests: a D streaming for others — each /metrics read adds this many inter-token gaps of this many seconds
    step_override: tuple[float, int] | None = None
    prefill_rate_override: float | None = None  # tests: P's measured prefill rate (the plugin's gauge), tokens/s
    itl_counts: list[int] = field(default_factory=lambda: [0] * (len(ITL_BUCKETS) + 1))  # per bucket, +Inf last
    itl_sum: float = 0.0
    host_tier: dict[str, Held] = field(default_factory=dict)  # D's demoted holds, least recently demoted first

    def __post_init__(self) -> None:
        FABRIC[self.engine_id] = self
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
                Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ]
        )

    def close(self) -> None:
        """The engine is gone (its server was stopped): its held blocks can no longer be pulled, as after a restart."""
        FABRIC.pop(self.engine_id, None)
        self.held.clear()
        self.host_tier.clear()

    def restart(self) -> None:
        """The engine restarted on the same address: a new engine id, nothing held, an empty prefix cache."""
        self.close()
        self.engine_id = uuid.uuid4().hex
        self.prefix_cache.clear()
        FABRIC[self.engine_id] = self

    def count(self, name: str, value: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + value

    # ---- tokens ---------------------------------------------------------------------------------------------
    @staticmethod
    def chat_tokens(messages: list[dict[str, Any]], tools: list[Any] | None = None) -> list[int]:
        return list(render_chat(messages, tools).encode())

    @staticmethod
    def generate(tokens: list[int], max_tokens: int, ignore_eos: bool) -> tuple[list[int], str]:
        seed = hashlib.sha256(bytes(t % 256 for t in tokens) + len(tokens).to_bytes(4, "little")).digest()
        natural = 4 + seed[0] % 28
        n = max_tokens if ignore_eos else min(natural, max_tokens)
        out = []
        h = seed
        for i in range(n):
            if i % 32 == 0:
                h = hashlib.sha256(h).digest()
            out.append(ord(ALPHABET[h[i % 32] % len(ALPHABET)]))
        return out, ("length" if n == max_tokens else "stop")

    def _cached_prefix(self, tokens: list[int], salt: str) -> int:
        bs = self.settings.block_size
        h = hashlib.sha256(salt.encode()).digest()
        cached = 0
        for end in range(bs, len(tokens) + 1, bs):
            h = hashlib.sha256(h + bytes(str(tokens[end - bs : end]), "ascii")).digest()
            if h not in self.prefix_cache:
                break
            cached = end
        return cached

    def _cache(self, tokens: list[int], salt: str) -> None:
        bs = self.settings.block_size
        h = hashlib.sha256(salt.encode()).digest()
        for end in range(bs, len(tokens) + 1, bs):
            h = hashlib.sha256(h + bytes(str(tokens[end - bs : end]), "ascii")).digest()
            self.prefix_cache.add(h)

    # ---- endpoints ------------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.health_delay:
            await asyncio.sleep(self.health_delay)
        return PlainTextResponse("", status_code=200 if self.healthy else 503)

    async def models(self, request: Request) -> Response:
        model = {"id": self.settings.model, "object": "model", "owned_by": "emulator"}
        if self.settings.model_root is not None:
            model["root"] = self.settings.model_root
        return JSONResponse({"object": "list", "data": [model]})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": self.settings.vllm_version})

    def _other_release(self, peer: VllmEmulator | None) -> bool:
        """A peer of another vLLM release: NIXL's handshake fails (its compatibility hash has the version)."""
        if peer is not None and peer.settings.vllm_version != self.settings.vllm_version:
            self.count("emulator_cross_generation_reads")
            return True
        return False

    async def metrics(self, request: Request) -> Response:
        lines = []
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            v = self.counters.get(f"prompt_tokens:{source}", 0)
            lines.append(f'vllm:prompt_tokens_by_source_total{{source="{source}"}} {v}')
        for name in ("nixl_num_kv_expired_reqs", "nixl_xfer_count", "emulator_wrong_kv_tokens", "emulator_pulls_skipped"):
            lines.append(f"vllm:{name}_total {self.counters.get(name, 0)}")
        lines.append(f"vllm:nixl_bytes_transferred_sum {self.counters.get('nixl_bytes', 0)}")
        running, waiting, usage = self.load()
        labels = f'{{model_name="{self.settings.model}",engine="0"}}'
        lines += [f"vllm:num_requests_running{labels} {running}", f"vllm:num_requests_waiting{labels} {waiting}"]
        lines.append(f"vllm:kv_cache_usage_perc{labels} {usage}")
        lines.append(f"vllm:nixl_xfer_time_seconds_sum {self.counters.get('nixl_xfer_seconds', 0)}")
        if self.step_override is not None:
            self.observe_gaps(*self.step_override)
        lines += self._itl_lines(labels)
        rate = self.prefill_rate_override
        if rate is None and self.settings.prefill_plugin:  # the plugin's gauge: P's own fitted rate (0: none yet)
            fit = self.book.compute.fit
            rate = 1.0 / fit.slope if fit is not None and fit.slope > 0 else 0.0
        if rate is not None:
            lines.append(f"vllm:bpdkv_prefill_tokens_per_second{labels} {rate}")
        if self.settings.kv_hold_budget is not None:  # the node plugin's gauges (bpdkv/vllm_plugin/connector.py)
            total, budget = self._hold_budget()
            lines.append(f"vllm:bpdkv_held_blocks{labels} {self.held_blocks()}")
            lines.append(f"vllm:bpdkv_hold_budget_blocks{labels} {budget}")
            lines.append(f"vllm:bpdkv_kv_blocks_total{labels} {total}")
        return PlainTextResponse("\n".join(lines) + "\n")

    def observe_gaps(self, seconds: float, count: int) -> None:
        """`count` inter-token gaps of `seconds` each, into vLLM's ITL histogram (its buckets)."""
        if count <= 0:
            return
        i = next((k for k, le in enumerate(ITL_BUCKETS) if seconds <= le), len(ITL_BUCKETS))
        self.itl_counts[i] += count
        self.itl_sum += seconds * count

    def _itl_lines(self, labels: str) -> list[str]:
        inner = labels[1:-1]
        lines, total = [], 0
        for le, count in zip([*map(str, ITL_BUCKETS), "+Inf"], self.itl_counts, strict=True):
            total += count
            lines.append(f'vllm:inter_token_latency_seconds_bucket{{{inner},le="{le}"}} {float(total)}')
        lines.append(f"vllm:inter_token_latency_seconds_count{labels} {float(total)}")
        lines.append(f"vllm:inter_token_latency_seconds_sum{labels} {self.itl_sum}")
        return lines

    def held_blocks(self) -> int:
        """KV blocks D holds for a later pull now (holds past their TTL are freed, as the worker does)."""
        now, bs = time.perf_counter(), self.settings.block_size
        return sum(-(-len(h.tokens) // bs) for h in self.held.values() if h.expires_at > now)

    def _hold_budget(self) -> tuple[int, int]:
        """(KV blocks in all, the hold budget in blocks), as the plugin computes them."""
        total = self.settings.kv_capacity_tokens // self.settings.block_size
        return total, hold.budget_blocks(self.settings.kv_hold_budget or 0.0, total)

    def _enforce_hold_budget(self, keep: str) -> list[str]:
        """Over the hold budget: the oldest holds go first (the plugin's HoldLedger), never the one just made."""
        _, budget = self._hold_budget()
        released: list[str] = []
        for rid in list(self.held):
            if self.held_blocks() <= budget:
                break
            if rid != keep:
                released.append(rid)
                if self.settings.kv_host_tier_tokens > 0:
                    self.host_tier[rid] = self.held[rid]
                del self.held[rid]
        if self.settings.kv_host_tier_tokens > 0:
            self.count("emulator_holds_demoted", len(released))
            return self._fit_host_tier()
        self.count("emulator_holds_released_budget", len(released))
        return released

    def _fit_host_tier(self) -> list[str]:
        """Drop the least recently demoted holds (and expired ones) until the tier's tokens fit: those are gone."""
        now = time.perf_counter()
        dropped = [rid for rid, h in self.host_tier.items() if h.expires_at <= now]
        for rid in dropped:
            del self.host_tier[rid]
        while self.host_tier and sum(len(h.tokens) for h in self.host_tier.values()) > self.settings.kv_host_tier_tokens:
            rid = next(iter(self.host_tier))
            del self.host_tier[rid]
            dropped.append(rid)
        self.count("emulator_holds_released_budget", len(dropped))
        return dropped

    async def reload(self, request_id: str) -> Held | None:
        """A demoted hold back into HBM for a reader (D's reload over PCIe), or None when the tier has none."""
        held = self.host_tier.pop(request_id, None)
        if held is None or held.expires_at <= time.perf_counter():
            return None
        self.count("emulator_host_reloads")
        self.count("emulator_host_reload_tokens", len(held.tokens))
        await asyncio.sleep(self.settings.host_reload_seconds_per_token * len(held.tokens))
        self.held[request_id] = held
        return held

    def load(self) -> tuple[float, float, float]:
        """(running, waiting, KV cache usage) as vLLM's /metrics gauges say them."""
        if self.load_override is not None:
            return self.load_override
        slots = self.settings.max_num_seqs
        running = min(self.running, slots) if slots else self.running
        capacity = self.settings.kv_capacity_tokens
        held = sum(len(h.tokens) for h in self.held.values())
        usage = min((held + self.running_tokens) / capacity, 1.0) if capacity else 0.0
        return float(running), float(self.running - running), usage

    async def chat(self, request: Request) -> Response:
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        problem = validate_chat(body) or self._validate_common(body)
        if problem is not None:
            return problem
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        return await self._serve(body, self.chat_tokens(body["messages"], tools), chat=True)

    async def completions(self, request: Request) -> Response:
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        problem = validate_completion(body) or self._validate_common(body)
        if problem is not None:
            return problem
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            # vLLM takes a batch of prompts; the emulator serves a batch of one and says so for more.
            if len(prompt) != 1:
                return vllm_error(400, "the emulator serves one prompt per request (batches are not emulated)", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            return vllm_error(400, "prompt token ids must be non-negative integers", "prompt")
        tokens = prompt if isinstance(prompt, list) else list(str(prompt).encode())
        if not tokens:
            return vllm_error(400, "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", "prompt")
        return await self._serve(body, tokens, chat=False)

    async def messages(self, request: Request) -> Response:
        return await self._agent_api(request, "messages")

    async def count_tokens(self, request: Request) -> Response:
        """vLLM's /v1/messages/count_tokens: the rendered prompt's tokens."""
        from bpdkv.router.messages import to_chat
        from bpdkv.router.surface import SurfaceError

        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        try:
            chat = to_chat(body, counting=True)
        except SurfaceError as refused:
            return vllm_error(refused.status, refused.message, refused.param)
        tokens = self.chat_tokens(chat["messages"], chat.get("tools"))
        return JSONResponse({"input_tokens": len(tokens), "context_management": {"original_input_tokens": len(tokens)}})

    async def responses(self, request: Request) -> Response:
        return await self._agent_api(request, "responses")

    async def _agent_api(self, request: Request, api: str) -> Response:
        """/v1/messages and /v1/responses as vLLM serves them: converted to a chat request, served, converted back
        (a whole answer keeps vLLM's top-level kv_transfer_params; a stream carries none, as vLLM's /v1/messages)."""
        from bpdkv.router.messages import MessagesSurface
        from bpdkv.router.responses import ResponsesSurface
        from bpdkv.router.sessions import MemoryStore
        from bpdkv.router.surface import SurfaceError, chat_chunks

        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        surface: Any = MessagesSurface() if api == "messages" else ResponsesSurface(lambda: MemoryStore())
        if api == "responses" and body.get("previous_response_id") is not None:
            return vllm_error(
                400, "previous_response_id needs the response store (VLLM_ENABLE_RESPONSES_API_STORE=1)", "previous_response_id"
            )
        try:
            turn = await surface.parse(body, dict(request.headers), "emulated")
        except SurfaceError as refused:
            return vllm_error(refused.status, refused.message, refused.param)
        chat_body = dict(turn.body)
        if isinstance(body.get(contracts.KV_TRANSFER_PARAMS), dict):
            chat_body[contracts.KV_TRANSFER_PARAMS] = body[contracts.KV_TRANSFER_PARAMS]
        problem = validate_chat(chat_body) or self._validate_common(chat_body)
        tools = chat_body.get("tools") if isinstance(chat_body.get("tools"), list) else None
        served = problem or await self._serve(chat_body, self.chat_tokens(chat_body["messages"], tools), chat=True)
        if served.status_code != 200:
            if api == "messages":  # vLLM's /v1/messages answers its service errors in Anthropic's shape
                error = json.loads(bytes(served.body)).get("error") or {}
                shaped = {"error": {"message": error.get("message"), "type": error.get("type")}, "type": "error"}
                return JSONResponse(shaped, status_code=served.status_code)
            return served
        if isinstance(served, StreamingResponse):
            translator = surface.translator(turn)

            async def events():  # type: ignore[no-untyped-def]
                async for piece in served.body_iterator:
                    raw = piece if isinstance(piece, bytes) else str(piece).encode()
                    chunks = [c for c in chat_chunks(raw) if not c.pop(contracts.KV_TRANSFER_PARAMS, None) or c.get("choices")]
                    out = translator.feed(chunks)
                    if out:
                        yield out
                yield await translator.finish()

            return StreamingResponse(events(), media_type="text/event-stream")
        data = json.loads(bytes(served.body))
        rendered = await surface.render(turn, data)
        rendered[contracts.KV_TRANSFER_PARAMS] = data.get(contracts.KV_TRANSFER_PARAMS)
        return JSONResponse(rendered)

    def _validate_common(self, body: dict[str, Any]) -> Response | None:
        """What vLLM checks after the request parsed: the model name, then the token budget."""
        model = body.get("model")
        if model is not None and model != self.settings.model:
            message = f"The model `{model}` does not exist. Valid aliases: {self.settings.model}."
            return vllm_error(404, message, "model", "NotFoundError")
        max_tokens = _max_tokens(body)
        if max_tokens is not None and max_tokens < 1:
            return vllm_error(
                400, f"max_tokens must be at least 1, got {max_tokens}. (parameter=max_tokens, value={max_tokens})", "max_tokens"
            )
        if max_tokens is not None and max_tokens > self.settings.max_model_len:
            message = (
                f"max_tokens={max_tokens} cannot be greater than max_model_len={self.settings.max_model_len}. "
                f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})"
            )
            return vllm_error(400, message, "max_tokens")
        return None

    # ---- the protocol ---------------------------------------------------------------------------------------
    async def _serve(self, body: dict[str, Any], tokens: list[int], chat: bool) -> Response:
        self.running += 1
        self.running_tokens += len(tokens)
        streaming = False
        try:
            response = await self._serve_turn(body, tokens, chat)
            streaming = isinstance(response, StreamingResponse)  # ends with its stream (_stream)
            return response
        finally:
            if not streaming:
                self._served(len(tokens))

    def _served(self, prompt_tokens: int) -> None:
        self.running -= 1
        self.running_tokens -= prompt_tokens

    async def _serve_turn(self, body: dict[str, Any], tokens: list[int], chat: bool) -> Response:
        if len(tokens) >= self.settings.max_model_len:
            n, limit = len(tokens), self.settings.max_model_len
            message = (
                f"This model's maximum context length is {limit} tokens. However, your prompt contains at least {n} input "
                f"tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
                f"prompt. (parameter=input_tokens, value={n})"
            )
            return vllm_error(400, message, "input_tokens")
        self.requests.append(body)
        params = body.get(contracts.KV_TRANSFER_PARAMS)
        salt = str(body.get("cache_salt") or "")
        max_tokens = _max_tokens(body) or 16
        cached = self._cached_prefix(tokens, salt) if self.settings.prefix_caching else 0
        external = 0
        poisoned_by: list[int] | None = None
        out_params: dict[str, Any] | None = None
        pull_outcome: str | None = None
        role = self.settings.role

        if isinstance(params, dict) and params.get(contracts.DO_REMOTE_DECODE) and role in ("prefill", "both"):
            if params.get(contracts.REMOTE_BLOCK_IDS) and params.get(contracts.REMOTE_ENGINE_ID):
                pulled = await self._pull_from_decode(params, tokens, cached)
                if isinstance(pulled, Response):
                    return pulled
                external, poisoned_by, pull_outcome = pulled
            request_id = uuid.uuid4().hex
            # What P holds is what it computed: wrong pulled KV travels on to D.
            kv = list(tokens) if poisoned_by is None else poisoned_by + tokens[len(poisoned_by) :]
            self.held[request_id] = Held(kv, time.perf_counter() + self.settings.kv_lease_duration)
            out_params = {
                contracts.DO_REMOTE_PREFILL: True,
                contracts.DO_REMOTE_DECODE: False,
                contracts.REMOTE_BLOCK_IDS: self._block_ids(len(tokens)),
                contracts.REMOTE_ENGINE_ID: self.engine_id,
                contracts.REMOTE_REQUEST_ID: request_id,
                contracts.REMOTE_HOST: "127.0.0.1",
                contracts.REMOTE_PORT: 0,
                "tp_size": 1,
                "dcp_size": 1,
                "pp_size": 1,
                contracts.REMOTE_NUM_TOKENS: len(tokens),
                contracts.REMOTE_BLOCKS_EXPIRY_TIME: None,
                "transfer_mode": "pull",
                contracts.REMOTE_PREFILL_CACHED_TOKENS: cached,
            }
            if pull_outcome is not None:
                out_params[contracts.PULL_OUTCOME] = pull_outcome
                if self.settings.report_pulled_tokens:
                    out_params[contracts.PULLED_TOKENS] = external  # the connector's count of tokens read from D
        elif isinstance(params, dict) and params.get(contracts.LOCAL_TURN) and role in ("decode", "both"):
            # A continued turn (router path decode_local), as the bpdkv plugin on D serves it: the new tokens are
            # computed on top of D's own prefix cache — its held history — and the previous hold, superseded, goes.
            self.count("emulator_local_turns")
            for rid in params.get(contracts.RELEASE_REQUEST_IDS) or ():
                self.held.pop(str(rid), None)
                self.host_tier.pop(str(rid), None)
        elif isinstance(params, dict) and params.get(contracts.DO_REMOTE_PREFILL) and role in ("decode", "both"):
            prefill = FABRIC.get(str(params.get(contracts.REMOTE_ENGINE_ID)))
            held = (
                None
                if self._other_release(prefill)
                else prefill.held.pop(str(params.get(contracts.REMOTE_REQUEST_ID)), None)
                if prefill
                else None
            )
            if held is not None:
                external = min(len(held.tokens), len(tokens))
                self.count("nixl_xfer_count")
                pull_started = time.monotonic()
                await asyncio.sleep(self.settings.pull_seconds_per_token * external)
                if self.settings.relative_expiry:  # the bpdkv plugin on D measures the link to P on every pull
                    link = f"{params.get(contracts.REMOTE_HOST)}:{params.get(contracts.REMOTE_PORT)}"
                    now = time.monotonic()
                    self.book.observe_pull(
                        link, str(params.get(contracts.REMOTE_ENGINE_ID)), external * BYTES_PER_TOKEN, now - pull_started, now
                    )
                if held.tokens[:external] != tokens[:external]:
                    poisoned_by = held.tokens[:external]
            else:
                self.count("emulator_missing_prefill_blocks")

        computed = max(len(tokens) - cached - external, 0)
        self.count("prompt_tokens:local_cache_hit", cached)
        self.count("prompt_tokens:external_kv_transfer", external)
        self.count("prompt_tokens:local_compute", computed)
        started = time.monotonic()
        await asyncio.sleep(self.settings.prefill_seconds_per_token * computed)
        if self.settings.prefill_plugin and role == "prefill":
            self.book.observe_compute(computed, time.monotonic() - started)  # the connector's sample of P's rate
        # Wrong KV yields a different answer, as with the real defect (the emulator does not model cache poisoning).
        basis = tokens if poisoned_by is None else poisoned_by + tokens[len(poisoned_by) :] + [0]
        if poisoned_by is None:
            self._cache(tokens, salt)
        forced = forced_text(body)
        if forced is not None:  # structured outputs: the emulator writes exactly what the (literal) regex allows
            output = list(forced.encode())[:max_tokens]
            finish = "length" if len(forced.encode()) > max_tokens else "stop"
        else:
            output, finish = self.generate(basis, max_tokens, bool(body.get("ignore_eos")))

        # The engine finishes STOPPED or LENGTH_CAPPED; "tool_calls" is the API's name for a stop that called tools.
        continued = isinstance(params, dict) and bool(params.get(contracts.DO_REMOTE_PREFILL) or params.get(contracts.LOCAL_TURN))
        if role in ("decode",) and continued and finish in ("stop", "length"):
            assert isinstance(params, dict)
            # As bpdkv's plugin: a turn the router will not offer again (bpdkv_hold: false) is not held at all.
            if params.get(contracts.HOLD) is not False:
                out_params = self._hold_for_next_turn(tokens, output, salt)
                if params.get(contracts.LOCAL_TURN):
                    out_params[contracts.LOCAL_CACHED_TOKENS] = cached
                fit = self.book.link(f"{params.get(contracts.REMOTE_HOST)}:{params.get(contracts.REMOTE_PORT)}").estimate.fit
                if self.settings.relative_expiry and params.get(contracts.REMOTE_HOST) and fit is not None and fit.slope > 0:
                    # What D measured of the link to that P (from its second pull on: the first paid the handshake).
                    out_params[contracts.LINK_ESTIMATE] = {"bytes_per_s": round(1.0 / fit.slope), "overhead_s": round(fit.intercept, 6)}
        text = bytes(output).decode(errors="replace")
        stream = _lax_bool(body.get("stream"))
        reasoning: str | None = None
        if chat and self.settings.reasoning_parser and (not stream or _thinking(body)):
            # vLLM splits the thought off a whole answer always, off a stream only when the request turned thinking on.
            reasoning, text = split_thought(text)
        calls = hermes_tool_calls(text) if chat and finish == "stop" and _auto_tools(body) else None
        answer = Answer(text, finish, calls, output, len(tokens), reasoning)
        self.observe_gaps(self.settings.token_interval, len(output) - 1)  # vLLM counts them streamed or not
        if stream:
            return StreamingResponse(self._stream(body, answer, chat, out_params), media_type="text/event-stream")
        await asyncio.sleep(self.settings.first_token_delay + self.settings.token_interval * max(len(output) - 1, 0))
        return JSONResponse(self._response(body, tokens, answer, chat, out_params))

    def _block_ids(self, n_tokens: int) -> list[list[int]]:
        """One list per KV-cache group, as vLLM 0.32 writes remote_block_ids."""
        return [list(range(_blocks(n_tokens, self.settings.block_size)))]

    def _response(
        self, body: dict[str, Any], tokens: list[int], answer: Answer, chat: bool, params: dict[str, Any] | None
    ) -> dict[str, Any]:
        """vLLM 0.32's non-streaming response, key for key (tests/data/vllm_contract holds the recorded ones)."""
        token_ids = list(answer.output) if body.get("return_token_ids") else None
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": answer.api_finish,
            "stop_reason": None,
            "token_ids": token_ids,
        }
        if chat:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": answer.content,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": answer.reasoning,
            }
            if answer.calls:
                message["tool_calls"] = [{"id": c["id"], "type": "function", "function": c["function"]} for c in answer.calls]
            choice.update(message=message, routed_experts=None)
        else:
            prompt_ids = list(tokens) if body.get("return_token_ids") else None
            choice.update(text=answer.text, prompt_logprobs=None, prompt_token_ids=prompt_ids, routed_experts=None)
        resp: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.settings.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": {
                "prompt_tokens": len(tokens),
                "total_tokens": len(tokens) + len(answer.output),
                "completion_tokens": len(answer.output),
                "prompt_tokens_details": None,
                "completion_tokens_details": self._completion_details(answer) if chat else None,
            },
            contracts.KV_TRANSFER_PARAMS: params,
            "ec_transfer_params": None,
            "metrics": None,
        }
        if chat:
            resp.update(prompt_logprobs=None, prompt_token_ids=list(tokens) if body.get("return_token_ids") else None, prompt_text=None)
        return resp

    def _completion_details(self, answer: Answer) -> dict[str, int] | None:
        return {"reasoning_tokens": answer.reasoning_tokens} if self.settings.reasoning_parser else None

    async def _pull_from_decode(
        self, params: dict[str, Any], tokens: list[int], cached: int
    ) -> tuple[int, list[int] | None, str | None] | Response:
        """(tokens pulled, D's tokens if they differ from the prompt, the bpdkv connector's outcome) or P's error."""
        plugin = self.settings.prefill_plugin
        expires_at = params.get(contracts.EXPIRES_AT)
        if plugin and isinstance(expires_at, (int, float)) and expires_at - time.time() < decide.DEFAULT_EXPIRY_GUARD:
            return 0, None, "expiring"  # the bpdkv connector computes locally instead of reading expiring blocks
        decode = FABRIC.get(str(params.get(contracts.REMOTE_ENGINE_ID)))
        if self._other_release(decode):
            return vllm_error(500, "NIXL handshake failed: incompatible remote engine", None, "InternalServerError")
        held = decode.held.get(str(params.get(contracts.REMOTE_REQUEST_ID))) if decode else None
        if held is None and decode is not None and decode.host_tier:  # demoted: D reloads it before the read
            held = await decode.reload(str(params.get(contracts.REMOTE_REQUEST_ID)))
        now = time.perf_counter()
        if plugin and params.get(contracts.FENCE) and (held is None or held.expires_at - now < DECLINE_WITHIN):
            # The connector pins D's hold before reading (the read fence): a D that is gone leaves the pin
            # unanswered, a live D refuses a hold it no longer keeps; either way P computes locally and says so.
            return 0, None, "pin_unanswered" if decode is None else "released" if held is None else "expiring"
        if held is None or held.expires_at - now < DECLINE_WITHIN:
            self.count("nixl_num_kv_expired_reqs")
            if self.settings.kv_load_failure_policy == "fail":
                # vLLM logs "Declining expired remote read" (or NIXL_ERR_REMOTE_DISCONNECT); the client sees only this
                return vllm_error(500, "Internal server error", None, "InternalServerError")
            await asyncio.sleep(self.settings.max_hang)  # upstream "recompute" hangs
            return vllm_error(500, "hung", None, "InternalServerError")
        n = min(int(params.get(contracts.REMOTE_NUM_TOKENS) or 0), len(tokens)) - cached
        outcome = "verified" if plugin else None
        if plugin:  # the connector compares block digests and pulls only the blocks whose tokens match
            bs = self.settings.block_size
            same = next(
                (i for i, (a, b) in enumerate(zip(held.tokens, tokens, strict=False)) if a != b), min(len(held.tokens), len(tokens))
            )
            # whole matching blocks, never the last prompt token, never more than D offered
            usable = min(same, len(tokens) - 1, int(params.get(contracts.REMOTE_NUM_TOKENS) or 0)) // bs * bs - cached
            if usable < n:
                outcome, n = ("cut", usable) if usable > 0 else ("mismatch", 0)
        if n < self.settings.kv_recompute_threshold:
            self.count("emulator_pulls_skipped")
            return 0, None, outcome
        assert decode is not None
        link = f"{params.get(contracts.REMOTE_HOST)}:{params.get(contracts.REMOTE_PORT)}"
        bs = self.settings.block_size
        if plugin and self.settings.pull_decision == contracts.PULL_DECISION_COST:
            # the connector's cost model: pull, pull a prefix, or compute locally (and let D's hold go)
            hint = params.get(contracts.LINK_ESTIMATE)  # D's estimate of the link, as the connector reads it
            hint = hint if isinstance(hint, dict) else {}
            rate = hint.get("bytes_per_s")
            fit = cost.Fit(float(hint.get("overhead_s") or 0.0), 1.0 / rate) if isinstance(rate, (int, float)) and rate > 0 else None
            choice = self.book.decide(
                link,
                cost.Request(n, bs, bs * BYTES_PER_TOKEN, self.settings.kv_recompute_threshold),
                time.monotonic(),
                fit,
                decode.engine_id,  # a D engine not pulled from yet: the shortest pull (the handshake), as the connector
            )
            self.count(f"emulator_decisions:{choice.outcome.value}:{choice.reason.value}")
            if not choice.pulls:
                decode.held.pop(str(params.get(contracts.REMOTE_REQUEST_ID)), None)  # the fence's release
                return 0, None, DECLINED_OUTCOME.get(choice.reason, choice.reason.value)
            if choice.tokens < n:
                n, outcome = choice.tokens, choice.outcome.value
        decode.held.pop(str(params.get(contracts.REMOTE_REQUEST_ID)), None)  # notify: D frees its blocks (single use)
        self.count("nixl_xfer_count")
        self.count("nixl_bytes", n * BYTES_PER_TOKEN)
        seconds = self.settings.pull_fixed_seconds + self.settings.pull_seconds_per_token * n
        self.count("nixl_xfer_seconds", seconds)
        started = time.monotonic()
        await asyncio.sleep(seconds)
        if plugin and self.settings.pull_decision == contracts.PULL_DECISION_COST:
            probe = choice.outcome is cost.Outcome.PROBE
            self.book.observe_pull(link, decode.engine_id, n * BYTES_PER_TOKEN, time.monotonic() - started, time.monotonic(), probe)
        theirs = held.tokens[: cached + n]
        if theirs != tokens[: cached + n]:
            bad = sum(1 for a, b in zip(theirs[cached:], tokens[cached : cached + n], strict=False) if a != b)
            self.count("emulator_wrong_kv_tokens", bad)
            return n, theirs, outcome
        return n, None, outcome

    def _hold_for_next_turn(self, tokens: list[int], output: list[int], salt: str = "") -> dict[str, Any]:
        request_id = uuid.uuid4().hex
        seq = tokens + output[:-1]  # the last sampled token has no KV yet
        self._cache(seq, salt)  # as vLLM: full blocks of what D computed and generated are in its prefix cache
        ttl = self.settings.decoder_kv_blocks_ttl
        self.held[request_id] = Held(seq, time.perf_counter() + ttl)
        params: dict[str, Any] = {
            contracts.DO_REMOTE_PREFILL: False,
            contracts.DO_REMOTE_DECODE: True,
            contracts.REMOTE_BLOCK_IDS: self._block_ids(len(seq)),
            contracts.REMOTE_ENGINE_ID: self.engine_id,
            contracts.REMOTE_REQUEST_ID: request_id,
            contracts.REMOTE_HOST: "127.0.0.1",
            contracts.REMOTE_PORT: 0,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            contracts.REMOTE_NUM_TOKENS: len(seq),
            contracts.REMOTE_BLOCKS_EXPIRY_TIME: time.perf_counter() + ttl,
            "transfer_mode": "pull",
        }
        if self.settings.relative_expiry:  # the bpdkv node plugin on D
            params[contracts.REMOTE_BLOCKS_EXPIRES_IN] = ttl
            params[contracts.EXPIRES_AT] = time.time() + ttl
            params[contracts.BLOCK_SIZE] = self.settings.block_size
            params[contracts.BLOCK_DIGESTS] = digests.encode(digests.block_digests(seq, self.settings.block_size))
            # Where P would pin the hold before reading (the plugin's UDP read fence); nothing listens: the emulated
            # P does not pin, and the router passes the key through untouched.
            params[contracts.FENCE] = "127.0.0.1:0"
        if self.settings.kv_hold_budget is not None:
            released = self._enforce_hold_budget(request_id)
            if released:  # announced to the router, which stops offering them
                params[contracts.RELEASED_REQUEST_IDS] = released
        return params

    async def _stream(self, body: dict[str, Any], answer: Answer, chat: bool, params: dict[str, Any] | None):  # type: ignore[no-untyped-def]
        try:
            async for piece in self._chunks(body, answer, chat, params):
                yield piece
        except (asyncio.CancelledError, GeneratorExit):
            self.count("emulator_streams_cancelled")
            raise
        finally:
            self._served(answer.prompt_tokens)

    async def _chunks(self, body: dict[str, Any], answer: Answer, chat: bool, params: dict[str, Any] | None):  # type: ignore[no-untyped-def]
        """vLLM 0.32's event shapes: a role chunk (chat), content (or Hermes tool-call) deltas, a finish chunk with an
        empty delta, the usage chunk if asked, the bpdkv plugin's params chunk, [DONE]."""
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.settings.model,
        }
        usage = isinstance(body.get("stream_options"), dict) and bool(body["stream_options"].get("include_usage"))
        await asyncio.sleep(self.settings.first_token_delay)
        if chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield _sse({**head, "choices": [role], "prompt_token_ids": None, "prompt_text": None})
        deltas = answer.deltas(chat)
        # vLLM sends the last token's text with the finish reason (a tool call's closing tag has none to send).
        last = deltas.pop() if deltas and not answer.calls else {}
        for i, delta in enumerate(deltas):
            if i:
                await asyncio.sleep(self.settings.token_interval)
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None, "token_ids": None}
            if chat:
                choice["delta"] = delta
            else:
                choice.update(text=delta["content"], stop_reason=None, prompt_token_ids=None)
            yield _sse({**head, "choices": [choice]})
        if deltas:
            await asyncio.sleep(self.settings.token_interval)
        finish: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": answer.api_finish, "stop_reason": None, "token_ids": None}
        if chat:
            finish["delta"] = last
        else:
            finish.update(text=last.get("content", ""), prompt_token_ids=None)
        yield _sse({**head, "choices": [finish], **({} if usage else {"system_fingerprint": SYSTEM_FINGERPRINT})})
        if usage:
            n_prompt, n_out = answer.prompt_tokens, len(answer.output)
            counts: dict[str, Any] = {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n_out, "completion_tokens": n_out}
            details = self._completion_details(answer) if chat else None
            if details is not None:
                counts["completion_tokens_details"] = details
            yield _sse({**head, "choices": [], "system_fingerprint": SYSTEM_FINGERPRINT, "usage": counts})
        if params is not None and self.settings.stream_params:
            yield _sse({**head, "choices": [], contracts.KV_TRANSFER_PARAMS: params})
        yield b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Answer:
    """What the emulated model wrote, and how the API presents it (content, or parsed Hermes tool calls)."""

    text: str
    finish: str  # the engine's: stop | length
    calls: list[dict[str, Any]] | None
    output: list[int]
    prompt_tokens: int
    reasoning: str | None = None  # the thought, split off `text` by the reasoning parser

    @property
    def reasoning_tokens(self) -> int:
        return len((THOUGHT_START + (self.reasoning or "") + THOUGHT_END).encode()) if self.reasoning is not None else 0

    @property
    def api_finish(self) -> str:
        return "tool_calls" if self.calls else self.finish

    @property
    def content(self) -> str | None:
        if not self.calls:
            return self.text
        before = self.text[: self.text.find(TOOL_CALL_START)]
        return before or None

    def deltas(self, chat: bool) -> list[dict[str, Any]]:
        """Stream deltas: a character per chunk (the thought's first); a tool call as its name, then its arguments a
        character at a time."""
        thought = [{"reasoning": ch} for ch in self.reasoning or ""]
        if not self.calls:
            return thought + [{"content": ch} for ch in self.text]
        out: list[dict[str, Any]] = thought + [{"content": ch} for ch in self.content or ""]
        for i, call in enumerate(self.calls):
            head = {"index": i, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"]}}
            out.append({"content": None, "tool_calls": [head]})
            out += [{"content": None, "tool_calls": [{"index": i, "function": {"arguments": ch}}]} for ch in call["function"]["arguments"]]
        return out


# ---- the chat template and tool calls of the emulated model (Hermes style, like tests' tool template) -----------------
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


# Gemma 4's thought channel, as vLLM's `gemma4` reasoning parser reads it: plain text to a tokenizer that lacks the
# special tokens (the tiny test model's, and the emulator's bytes).
THOUGHT_START = "<|channel>thought\n"
THOUGHT_END = "<channel|>"


def split_thought(text: str) -> tuple[str | None, str]:
    """(thought, content) of an answer that opens with a closed thought channel; (None, text) otherwise."""
    if not text.startswith(THOUGHT_START) or THOUGHT_END not in text:
        return None, text
    thought, _, content = text[len(THOUGHT_START) :].partition(THOUGHT_END)
    return thought, content


def _thinking(body: dict[str, Any]) -> bool:
    kwargs = body.get("chat_template_kwargs")
    return isinstance(kwargs, dict) and kwargs.get("enable_thinking") is True


def hermes_block(name: str, arguments: Any) -> str:
    """One call as a Hermes model writes it; `arguments` as a JSON string (verbatim) or an object."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return f'{TOOL_CALL_START}\n{{"name": "{name}", "arguments": {args}}}\n{TOOL_CALL_END}'


def render_chat(messages: list[dict[str, Any]], tools: list[Any] | None = None) -> str:
    """ChatML; tools listed in the system turn, assistant tool calls as Hermes blocks, tool results as user turns.
    An assistant turn renders exactly as the model wrote it, so D's tokens stay a prefix of the next prompt."""
    parts = []
    first_system = bool(messages) and messages[0].get("role") == "system"
    if tools or first_system:
        system = _content(messages[0].get("content")) if first_system else ""
        if tools:
            listing = "".join("\n" + json.dumps(t) for t in tools)
            system += ("\n\n" if first_system else "") + f"# Tools\n<tools>{listing}</tools>\n"
            system += 'Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>.'
        parts.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "system" and i == 0:
            continue
        if role == "assistant":
            content = _content(m.get("content"))
            calls = [hermes_block(c["function"]["name"], c["function"].get("arguments", "{}")) for c in m.get("tool_calls") or []]
            text = content + ("\n" if content and calls else "") + "\n".join(calls)
            parts.append(f"<|im_start|>assistant\n{text}<|im_end|>\n")
        elif role == "tool":
            parts.append(f"<|im_start|>user\n<tool_response>\n{_content(m.get('content'))}\n</tool_response><|im_end|>\n")
        else:
            parts.append(f"<|im_start|>{role}\n{_content(m.get('content'))}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"


def hermes_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """vLLM's hermes parser: every <tool_call> block whose body is JSON with a name and arguments; None if none."""
    calls = []
    for match in _TOOL_CALL.finditer(text):
        try:
            data = json.loads(match.group(1))
            name, args = data["name"], data["arguments"]
        except (ValueError, KeyError, TypeError):
            return None
        calls.append(
            {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        )
    return calls or None


def _auto_tools(body: dict[str, Any]) -> bool:
    return bool(body.get("tools")) and body.get("tool_choice", "auto") in ("auto", None)


def literal_regex(text: str) -> str:
    """A regex that matches exactly `text` (the form vLLM's structured outputs accept)."""
    return re.sub(r"([\\.^$*+?()\[\]{}|])", r"\\\1", text).replace("\n", "\\n")


def forced_text(body: dict[str, Any]) -> str | None:
    """The one text a literal `structured_outputs.regex` allows (the emulator supports no other constraint)."""
    so = body.get("structured_outputs")
    regex = so.get("regex") if isinstance(so, dict) else None
    if not isinstance(regex, str):
        return None
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), regex)


# ---- request checks with vLLM's answers (status, error type, param) ----------------------------------------------------
SYSTEM_FINGERPRINT = "fp_emulated"
_ROLES = ("developer", "system", "user", "assistant", "tool", "function")
_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def vllm_error(status: int, message: str, param: str | None, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


def _validation_error(kind: str, loc: str, msg: str, value: Any, count: int = 1) -> JSONResponse:
    """FastAPI/pydantic's request-validation answer, as vLLM serves it."""
    shown = f"<dict of {len(value)} items>" if isinstance(value, dict) else str(value)
    detail = f"  {{'type': '{kind}', 'loc': '{loc}', 'msg': '{msg}', 'input': {shown!r}}}"
    return vllm_error(400, f"{count} validation error{'s' if count > 1 else ''}:\n{detail}", loc, "Bad Request")


def _lax_bool(value: Any) -> bool | None:
    """pydantic's lax boolean: true/false, 0/1, and strings like 'yes'/'off'; None if it is none of them."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    return None


def _max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_tokens", body.get("max_completion_tokens"))
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _validate_fields(body: dict[str, Any]) -> Response | None:
    if "stream" in body and body["stream"] is not None and _lax_bool(body["stream"]) is None:
        return _validation_error(
            "bool_parsing", "body.stream", "Input should be a valid boolean, unable to interpret input", body["stream"]
        )
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if isinstance(value, str):
            try:
                float(value)
            except ValueError:
                msg = "Input should be a valid number, unable to parse string as a number"
                return _validation_error("float_parsing", f"body.{name}", msg, value)
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return _validation_error("int_parsing", f"body.{name}", "Input should be a valid integer", value)
    return None


def validate_chat(body: dict[str, Any]) -> Response | None:
    messages = body.get("messages")
    if messages is None:
        return _validation_error("missing", "body.messages", "Field required", body)
    if not isinstance(messages, list):
        return _validation_error("list_type", "body.messages", "Input should be a valid list", messages)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            # pydantic tries each message type of the union; vLLM names the first that failed
            return _validation_error("missing", f"body.messages.{i}.ChatCompletionDeveloperMessageParam.role", "Field required", m, 11)
    return _validate_fields(body)


def validate_completion(body: dict[str, Any]) -> Response | None:
    problem = _validate_fields(body)
    if problem is not None:
        return problem
    if body.get("prompt") in (None, "", []):
        return vllm_error(400, "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", "prompt")
    return None


async def _json_body(request: Request) -> dict[str, Any] | Response:
    try:
        body = await request.json()
    except ValueError:
        return vllm_error(400, "JSON decode error", "body", "Bad Request")
    if not isinstance(body, dict):
        return _validation_error(
            "model_attributes_type", "body", "Input should be a valid dictionary or object to extract fields from", body
        )
    return body


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def _blocks(n: int, bs: int) -> int:
    return (n + bs - 1) // bs


def _content(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


class ServerGroup:
    """Several ASGI apps served by uvicorn on loopback from one background thread (bounded lifetime)."""

    def __init__(self, apps: list[Any], host: str = "127.0.0.1", ports: list[int] | None = None) -> None:
        """`ports`: fixed ports (a restarted server comes back where the router expects it); default: free ones."""
        import threading

        import uvicorn

        self._servers = [
            uvicorn.Server(
                uvicorn.Config(app, host=host, port=port, log_level="error", access_log=False, lifespan="on", timeout_graceful_shutdown=2)
            )
            for app, port in zip(apps, ports or [0] * len(apps), strict=True)
        ]
        self._host = host
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            self._tasks = [asyncio.ensure_future(s.serve()) for s in self._servers]
            while not all(s.started for s in self._servers):
                await asyncio.sleep(0.01)
            self._ready.set()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        self._loop.run_until_complete(main())
        # Responses cut off by crash(): let them unwind here rather than in a closed loop.
        pending = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()

    def start(self, timeout: float = 10.0) -> list[str]:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("servers did not start")
        return self.urls

    @property
    def urls(self) -> list[str]:
        return [f"http://{self._host}:{s.servers[0].sockets[0].getsockname()[1]}" for s in self._servers]

    def stop_one(self, index: int, timeout: float = 10.0) -> None:
        """Stop one server (emulates an upstream dying); the others keep running."""
        import threading

        server = self._servers[index]
        server.should_exit = True
        done = threading.Event()

        async def wait() -> None:
            while not self._tasks[index].done():
                await asyncio.sleep(0.01)
            done.set()

        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(wait(), self._loop)
        done.wait(timeout)

    def crash(self, timeout: float = 15.0) -> None:
        """End every server as a killed process would: open connections reset, in-flight responses cut off."""

        async def abort() -> None:
            for server in self._servers:
                server.should_exit = server.force_exit = True
                for conn in list(server.server_state.connections):
                    if conn.transport is not None:
                        conn.transport.abort()
                for task in list(server.server_state.tasks):
                    task.cancel()

        if self._loop is not None and self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(abort(), self._loop).result(timeout)
        self.stop(timeout)

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the servers' loop (e.g. to inspect a router's store)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, timeout: float = 15.0) -> None:
        for server in self._servers:
            server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            for server in self._servers:
                server.force_exit = True
            self._thread.join(timeout)


def main(argv: list[str] | None = None) -> None:
    """Run emulated P and D servers in one process: python -m bpdkv.testing.vllm_emulator --prefill 1 --decode 1."""
    import argparse
    import signal
    import sys
    import threading

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--first-token-delay", type=float, default=0.0)
    ap.add_argument("--token-interval", type=float, default=0.0)
    ap.add_argument("--ttl", type=float, default=float(contracts.DEFAULT_BLOCKS_TTL))
    ap.add_argument("--max-seconds", type=float, default=3600.0, help="exit after this long (bounded lifetime)")
    args = ap.parse_args(argv)
    emus = [VllmEmulator(EmulatorSettings(role="prefill", decoder_kv_blocks_ttl=args.ttl)) for _ in range(args.prefill)]
    emus += [
        VllmEmulator(
            EmulatorSettings(
                role="decode", decoder_kv_blocks_ttl=args.ttl, first_token_delay=args.first_token_delay, token_interval=args.token_interval
            )
        )
        for _ in range(args.decode)
    ]
    group = ServerGroup([e.app for e in emus])
    urls = group.start()
    print(json.dumps({"prefill": urls[: args.prefill], "decode": urls[args.prefill :]}), flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait(args.max_seconds)
    except KeyboardInterrupt:
        pass
    group.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
