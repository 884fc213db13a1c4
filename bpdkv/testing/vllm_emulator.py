"""A protocol-faithful vLLM P/D **emulator** — a test double, not vLLM.

It speaks the NixlConnector pull-mode, bidirectional protocol of DESIGN.md exactly as the router sees it:
P answers one token and holds its blocks on a lease; D pulls them, generates, keeps its own blocks for
`decoder_kv_blocks_ttl` and returns their location; P pulls D's blocks next turn unless fewer than the threshold
would be reused; a pull is single-use; reads of expired blocks (or within 5 s of expiry) are declined, which
gives HTTP 500 with `kv_load_failure_policy=fail` and a hang with `recompute` — like upstream.

"KV" here is the token list itself, so the emulator can tell when a pull copied the KV of *different* tokens
(upstream's defect) and then, like the real thing, answers differently. Tokens are the UTF-8 bytes of a ChatML
rendering; generation is a deterministic function of the prompt tokens, so a single emulator without
kv_transfer_params is the reference server.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from bpdkv import contracts

# Engines of this process, by engine id: the emulated NIXL fabric.
FABRIC: dict[str, VllmEmulator] = {}
DECLINE_WITHIN = 5.0  # seconds: P declines reads this close to expiry (upstream behaviour)
ALPHABET = "abcdefghijklmnopqrstuvwxyz     .,"


@dataclass
class Held:
    tokens: list[int]
    expires_at: float  # perf_counter clock of the holder, as upstream


@dataclass
class EmulatorSettings:
    role: str = "decode"  # "prefill" | "decode" | "both" (plain server)
    model: str = "emulated"
    decoder_kv_blocks_ttl: float = 480.0
    kv_recompute_threshold: int = 64
    kv_lease_duration: float = 30.0
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


@dataclass
class VllmEmulator:
    settings: EmulatorSettings
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    held: dict[str, Held] = field(default_factory=dict)
    prefix_cache: set[bytes] = field(default_factory=set)
    counters: dict[str, float] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)  # what arrived (for tests)
    healthy: bool = True

    def __post_init__(self) -> None:
        FABRIC[self.engine_id] = self
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ]
        )

    def count(self, name: str, value: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + value

    # ---- tokens ---------------------------------------------------------------------------------------------
    @staticmethod
    def chat_tokens(messages: list[dict[str, Any]]) -> list[int]:
        text = "".join(f"<|im_start|>{m.get('role')}\n{_content(m.get('content'))}<|im_end|>\n" for m in messages)
        return list((text + "<|im_start|>assistant\n").encode())

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
        return PlainTextResponse("", status_code=200 if self.healthy else 503)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.settings.model, "object": "model", "owned_by": "emulator"}]})

    async def metrics(self, request: Request) -> Response:
        lines = []
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            v = self.counters.get(f"prompt_tokens:{source}", 0)
            lines.append(f'vllm:prompt_tokens_by_source_total{{source="{source}"}} {v}')
        for name in ("nixl_num_kv_expired_reqs", "nixl_xfer_count", "emulator_wrong_kv_tokens", "emulator_pulls_skipped"):
            lines.append(f"vllm:{name}_total {self.counters.get(name, 0)}")
        lines.append(f"vllm:nixl_bytes_transferred_sum {self.counters.get('nixl_bytes', 0)}")
        lines.append(f"vllm:nixl_xfer_time_seconds_sum {self.counters.get('nixl_xfer_seconds', 0)}")
        return PlainTextResponse("\n".join(lines) + "\n")

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        tokens = self.chat_tokens(body.get("messages") or [])
        return await self._serve(body, tokens, chat=True)

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        prompt = body.get("prompt")
        tokens = prompt if isinstance(prompt, list) else list(str(prompt).encode())
        return await self._serve(body, tokens, chat=False)

    # ---- the protocol ---------------------------------------------------------------------------------------
    async def _serve(self, body: dict[str, Any], tokens: list[int], chat: bool) -> Response:
        self.requests.append(body)
        params = body.get("kv_transfer_params")
        salt = str(body.get("cache_salt") or "")
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        cached = self._cached_prefix(tokens, salt) if self.settings.prefix_caching else 0
        external = 0
        poisoned_by: list[int] | None = None
        out_params: dict[str, Any] | None = None
        role = self.settings.role

        if isinstance(params, dict) and params.get("do_remote_decode") and role in ("prefill", "both"):
            if params.get("remote_block_ids") and params.get("remote_engine_id"):
                pulled = await self._pull_from_decode(params, tokens, cached)
                if isinstance(pulled, Response):
                    return pulled
                external, poisoned_by = pulled
            request_id = uuid.uuid4().hex
            # What P holds is what it computed: wrong pulled KV travels on to D.
            kv = list(tokens) if poisoned_by is None else poisoned_by + tokens[len(poisoned_by) :]
            self.held[request_id] = Held(kv, time.perf_counter() + self.settings.kv_lease_duration)
            out_params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": list(range(_blocks(len(tokens), self.settings.block_size))),
                "remote_engine_id": self.engine_id,
                "remote_request_id": request_id,
                "remote_host": "emulated",
                "remote_port": 0,
                "tp_size": 1,
                "remote_num_tokens": len(tokens),
                "remote_blocks_expiry_time": None,
                "transfer_mode": "pull",
                "remote_prefill_cached_tokens": cached,
            }
        elif isinstance(params, dict) and params.get("do_remote_prefill") and role in ("decode", "both"):
            prefill = FABRIC.get(str(params.get("remote_engine_id")))
            held = prefill.held.pop(str(params.get("remote_request_id")), None) if prefill else None
            if held is not None:
                external = min(len(held.tokens), len(tokens))
                self.count("nixl_xfer_count")
                await asyncio.sleep(self.settings.pull_seconds_per_token * external)
                if held.tokens[:external] != tokens[:external]:
                    poisoned_by = held.tokens[:external]
            else:
                self.count("emulator_missing_prefill_blocks")

        computed = max(len(tokens) - cached - external, 0)
        self.count("prompt_tokens:local_cache_hit", cached)
        self.count("prompt_tokens:external_kv_transfer", external)
        self.count("prompt_tokens:local_compute", computed)
        await asyncio.sleep(self.settings.prefill_seconds_per_token * computed)
        # Wrong KV yields a different answer, as with the real defect (the emulator does not model cache poisoning).
        basis = tokens if poisoned_by is None else poisoned_by + tokens[len(poisoned_by) :] + [0]
        if poisoned_by is None:
            self._cache(tokens, salt)
        ignore_eos = bool(body.get("ignore_eos"))
        output, finish = self.generate(basis, max_tokens, ignore_eos)

        if role in ("decode",) and isinstance(params, dict) and params.get("do_remote_prefill") and finish in ("stop", "length"):
            out_params = self._hold_for_next_turn(tokens, output)
        if body.get("stream"):
            return StreamingResponse(self._stream(body, output, finish, chat, out_params), media_type="text/event-stream")
        await asyncio.sleep(self.settings.first_token_delay + self.settings.token_interval * max(len(output) - 1, 0))
        text = bytes(output).decode()
        choice: dict[str, Any]
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        if body.get("return_token_ids"):
            choice["token_ids"] = list(output)
        resp: dict[str, Any] = {
            "id": f"cmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.settings.model,
            "choices": [choice],
            "usage": {"prompt_tokens": len(tokens), "completion_tokens": len(output), "total_tokens": len(tokens) + len(output)},
        }
        if out_params is not None:
            resp["kv_transfer_params"] = out_params
        return JSONResponse(resp)

    async def _pull_from_decode(self, params: dict[str, Any], tokens: list[int], cached: int) -> tuple[int, list[int] | None] | Response:
        decode = FABRIC.get(str(params.get("remote_engine_id")))
        held = decode.held.get(str(params.get("remote_request_id"))) if decode else None
        now = time.perf_counter()
        if held is None or held.expires_at - now < DECLINE_WITHIN:
            self.count("nixl_num_kv_expired_reqs")
            if self.settings.kv_load_failure_policy == "fail":
                return JSONResponse({"error": {"message": "Declining expired remote read", "code": 500}}, status_code=500)
            await asyncio.sleep(self.settings.max_hang)  # upstream "recompute" hangs
            return JSONResponse({"error": {"message": "hung"}}, status_code=500)
        n = min(int(params.get("remote_num_tokens") or 0), len(tokens)) - cached
        if n < self.settings.kv_recompute_threshold:
            self.count("emulator_pulls_skipped")
            return 0, None
        assert decode is not None
        decode.held.pop(str(params.get("remote_request_id")), None)  # notify: D frees its blocks (single use)
        self.count("nixl_xfer_count")
        self.count("nixl_bytes", n * 1024)
        seconds = self.settings.pull_fixed_seconds + self.settings.pull_seconds_per_token * n
        self.count("nixl_xfer_seconds", seconds)
        await asyncio.sleep(seconds)
        theirs = held.tokens[: cached + n]
        if theirs != tokens[: cached + n]:
            bad = sum(1 for a, b in zip(theirs[cached:], tokens[cached : cached + n], strict=False) if a != b)
            self.count("emulator_wrong_kv_tokens", bad)
            return n, theirs
        return n, None

    def _hold_for_next_turn(self, tokens: list[int], output: list[int]) -> dict[str, Any]:
        request_id = uuid.uuid4().hex
        seq = tokens + output[:-1]  # the last sampled token has no KV yet
        ttl = self.settings.decoder_kv_blocks_ttl
        self.held[request_id] = Held(seq, time.perf_counter() + ttl)
        params: dict[str, Any] = {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_block_ids": list(range(_blocks(len(seq), self.settings.block_size))),
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": "emulated",
            "remote_port": 0,
            "tp_size": 1,
            "remote_num_tokens": len(seq),
            "remote_blocks_expiry_time": time.perf_counter() + ttl,
            "transfer_mode": "pull",
        }
        if self.settings.relative_expiry:
            params[contracts.REMOTE_BLOCKS_EXPIRES_IN] = ttl
        return params

    async def _stream(self, body: dict[str, Any], output: list[int], finish: str, chat: bool, params: dict[str, Any] | None):  # type: ignore[no-untyped-def]
        rid = f"cmpl-{uuid.uuid4().hex[:12]}"
        created = int(time.time())
        model = body.get("model") or self.settings.model
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            async for piece in self._chunks(rid, created, model, obj, output, finish, chat, params):
                yield piece
        except (asyncio.CancelledError, GeneratorExit):
            self.count("emulator_streams_cancelled")
            raise

    async def _chunks(self, rid, created, model, obj, output, finish, chat, params):  # type: ignore[no-untyped-def]
        await asyncio.sleep(self.settings.first_token_delay)
        if chat:
            yield _sse(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                }
            )
        for i, tok in enumerate(output):
            if i:
                await asyncio.sleep(self.settings.token_interval)
            last = i == len(output) - 1
            piece = chr(tok)
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish if last else None}
            if chat:
                choice["delta"] = {"content": piece}
            else:
                choice["text"] = piece
            chunk: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if last and params is not None and self.settings.stream_params:
                chunk["kv_transfer_params"] = params
            yield _sse(chunk)
        yield b"data: [DONE]\n\n"


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

    def __init__(self, apps: list[Any], host: str = "127.0.0.1") -> None:
        import threading

        import uvicorn

        self._servers = [
            uvicorn.Server(
                uvicorn.Config(app, host=host, port=0, log_level="error", access_log=False, lifespan="on", timeout_graceful_shutdown=2)
            )
            for app in apps
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
    ap.add_argument("--ttl", type=float, default=480.0)
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
