"""The router's ASGI app: P (one token, no stream) then D (streaming as the client asked), reuse via stored D params."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from bpdkv.router import protocol, sessions
from bpdkv.router.config import RouterConfig
from bpdkv.router.metrics import RouterMetrics
from bpdkv.router.security import KeyRing, redis_options
from bpdkv.router.upstreams import Pool, Upstream, check_all, health_loop

log = logging.getLogger("bpdkv.router")
T = TypeVar("T")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
REUSABLE_FINISH = ("stop", "length")
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


@dataclass(frozen=True)
class Buffered:
    """A whole upstream response."""

    status: int
    content_type: str
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)


class SseStream:
    """A streamed response written straight to the ASGI send; a client disconnect cancels the relay."""

    def __init__(self, body: AsyncIterator[bytes], content_type: str, abandon: Callable[[], None] | None = None) -> None:
        self.body = body
        self.content_type = content_type.encode("latin-1")
        self.status_code = 200
        self.abandon = abandon  # releases the upstream if the body never starts (client gone before the first byte)
        self.started = False

    async def send_to(self, send: Send, receive: Receive) -> None:
        relay = asyncio.current_task()

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if relay is not None:
                        relay.cancel()
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", self.content_type), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")],
                }
            )
            self.started = True  # from here the relay's own finally releases the upstream
            async for chunk in self.body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            pass  # the client went away; closing the relay below drops the upstream connection
        finally:
            watcher.cancel()
            if not self.started and self.abandon is not None:
                self.abandon()
            aclose = getattr(self.body, "aclose", None)
            if aclose is not None:
                await aclose()


class ClientGone(Exception):
    pass


class UpstreamFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _error(status: int, message: str, kind: str = "router_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class Router:
    def __init__(
        self,
        config: RouterConfig,
        store: sessions.SessionStore | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.clock = clock
        self.store = store or sessions.make_store(config.state, clock, redis_options(config.state_password_file, config.state_ca_file))
        self.metrics = RouterMetrics()
        self.api_keys = KeyRing.load(config.api_keys_file)  # digests only: no key is held in memory
        h = config.health
        self.prefill = Pool("prefill", [Upstream(u.name, u.url, "prefill") for u in config.prefill], h.failures_to_eject, h.backoff_max)
        self.decode = Pool("decode", [Upstream(u.name, u.url, "decode") for u in config.decode], h.failures_to_eject, h.backoff_max)
        self.client: aiohttp.ClientSession | None = None
        self._stop = asyncio.Event()
        self._health_task: asyncio.Task[None] | None = None
        self._warned_missing = False
        key_env = config.backend_api_key_env
        self._backend_key = os.environ.get(key_env) if key_env else None
        self.app = self  # the ASGI application (kept as an attribute for symmetry with Starlette apps)
        self._starlette = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/ready", self.ready, methods=["GET"]),
                Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            ],
            lifespan=self._lifespan,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry. The two completion routes skip Starlette's middleware stack: every SSE chunk would
        otherwise pass three send wrappers, which profiled at a quarter of the router's CPU."""
        path = scope.get("path")
        if scope["type"] == "http" and scope.get("method") == "POST" and path in (CHAT, COMPLETIONS):
            await self._serve_completion(scope, receive, send, path)
            return
        await self._starlette(scope, receive, send)

    async def _serve_completion(self, scope: Scope, receive: Receive, send: Send, route: str) -> None:
        request = Request(scope, receive)
        try:
            response = await self._handle(request, route)
        except Exception:  # noqa: BLE001 - a bug must cost one request a 500, never the process
            log.exception("router error on %s", route)
            response = _error(500, "internal router error")
        if isinstance(response, SseStream):
            await response.send_to(send, receive)
        else:
            await response(scope, receive, send)

    # ---- lifecycle -------------------------------------------------------------------------------------------
    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def start(self) -> None:
        # Long-lived objects (config, pools, metrics) leave the GC's young generations: fewer, shorter pauses (p99).
        gc.collect()
        gc.freeze()
        t = self.config.timeouts
        # aiohttp rather than httpx: httpcore's pool scans every connection per request (is_socket_readable), which
        # profiled at 84% of router CPU at 64 concurrent streams; aiohttp's connector keeps per-host idle lists.
        self.client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=t.connect, sock_read=t.decode_idle),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        self._stop.clear()
        if self.config.health.interval > 0:
            self._health_task = asyncio.create_task(
                health_loop([self.prefill, self.decode], self.client, self.config.health.interval, self._stop)
            )

    async def stop(self) -> None:
        self._stop.set()
        if self._health_task:
            self._health_task.cancel()
            try:
                await self._health_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        if self.client:
            await self.client.close()
        await self.store.close()

    # ---- small endpoints -------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        now = time.monotonic()
        p = [m.name for m in self.prefill.members if m.available(now)]
        d = [m.name for m in self.decode.members if m.available(now)]
        body = {"ready": bool(p and d), "prefill": p, "decode": d}
        return JSONResponse(body, status_code=200 if p and d else 503)

    async def models(self, request: Request) -> Response:
        tenant = self._tenant(request)
        if tenant is None:
            return _error(401, "invalid or missing API key", "authentication_error")
        assert self.client is not None
        for member in self.decode.candidates(set()) + self.prefill.candidates(set()):
            try:
                got = await self._call(
                    member.url + "/v1/models", None, self._upstream_headers(request), self.config.timeouts.connect, "GET"
                )
                return Response(got.content, status_code=got.status, media_type="application/json")
            except UPSTREAM_ERRORS:
                continue
        if self.config.model:
            return JSONResponse({"object": "list", "data": [{"id": self.config.model, "object": "model", "owned_by": "bpdkv"}]})
        return _error(503, "no upstream answered /v1/models")

    async def metrics_endpoint(self, request: Request) -> Response:
        now = time.monotonic()
        for pool in (self.prefill, self.decode):
            for m in pool.members:
                self.metrics.backend_healthy.labels(pool.role, m.name).set(1 if m.available(now) else 0)
                self.metrics.outstanding.labels(pool.role, m.name).set(m.outstanding)
        try:
            self.metrics.active_sessions.set(await self.store.count())
        except sessions.StoreUnavailable:
            self.metrics.store_errors.inc()
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def check_health_now(self) -> None:
        assert self.client is not None
        await check_all([self.prefill, self.decode], self.client, timeout=2.0)

    # ---- auth ------------------------------------------------------------------------------------------------
    def _bearer(self, request: Request) -> str | None:
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip()
        return None

    def _tenant(self, request: Request) -> str | None:
        """None = rejected. Tenant = the key's tenant name (or a hash of a pass-through key): sessions never cross
        tenants, keys never reach logs or metric labels."""
        key = self._bearer(request)
        if self.api_keys:
            return self.api_keys.tenant(key)
        return hashlib.sha256(key.encode()).hexdigest() if key else "anonymous"

    def _upstream_headers(self, request: Request) -> dict[str, str]:
        headers = {}
        if self._backend_key:
            headers["authorization"] = f"Bearer {self._backend_key}"
        elif not self.api_keys and request.headers.get("authorization"):
            headers["authorization"] = request.headers["authorization"]  # pass-through fleets (vLLM --api-key)
        rid = request.headers.get("x-request-id")
        if rid:
            headers["x-request-id"] = rid
        return headers

    # ---- identity --------------------------------------------------------------------------------------------
    def identity(
        self, route: str, tenant: str, body: dict[str, Any], session_id: str | None
    ) -> tuple[sessions.Identity | None, bytes | None, bytes]:
        """(identity for lookup, affinity key for P selection, scope). Identity None = not eligible for reuse."""
        scope = sessions.scope_digest(tenant, route, body)
        mode = self.config.session_identity
        explicit = session_id if mode != "auto" or session_id else None
        if (body.get("n") or 1) != 1:
            return None, None, scope
        if route == CHAT:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return None, None, scope
            chain = sessions.chat_chain(scope, messages)
            affinity = chain[min(1, len(chain) - 1)]
            if explicit:
                key = "x:" + sessions._h(scope, explicit.encode()).hex()
                return sessions.Identity([key], {h.hex() for h in chain[:-1]}, True), sessions._h(scope, explicit.encode()), scope
            if mode != "auto":
                return None, affinity, scope
            keys = []
            for i in range(len(messages) - 2, -1, -1):
                if isinstance(messages[i], dict) and messages[i].get("role") == "assistant":
                    keys.append("c:" + chain[i].hex())
                    if len(keys) >= 8:
                        break
            return sessions.Identity(keys, set(), False), affinity, scope
        prompt = body.get("prompt")
        tokens = prompt if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt) else None
        if explicit:
            key = "x:" + sessions._h(scope, explicit.encode()).hex()
            return sessions.Identity([key], set(), True), sessions._h(scope, explicit.encode()), scope
        if tokens is None or mode != "auto":
            return None, None, scope
        chain_t = sessions.token_chain(scope, tokens)
        affinity_t = chain_t[0][1] if chain_t else None
        keys = ["t:" + h.hex() for _, h in reversed(chain_t)][: sessions.MAX_CANDIDATES]
        return sessions.Identity(keys, set(), False), affinity_t, scope

    def _history_ok(self, route: str, ident: sessions.Identity, entry: sessions.SessionEntry, body: dict[str, Any], scope: bytes) -> bool:
        if route == CHAT:
            return not ident.explicit or entry.history in ident.history
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return not ident.explicit  # explicit ids with text prompts: trust the id
        return 0 < entry.length <= len(prompt) and sessions.token_digest(scope, prompt[: entry.length]) == entry.history

    async def lookup(
        self, route: str, ident: sessions.Identity | None, body: dict[str, Any], scope: bytes
    ) -> tuple[dict[str, Any] | None, str]:
        if not self.config.reuse or ident is None:
            return None, "skipped"
        if not ident.lookup_keys:
            return None, "miss"  # first turn: nothing could have been stored yet
        try:
            found = await self.store.take(ident.lookup_keys)
        except sessions.StoreUnavailable:
            self.metrics.store_errors.inc()
            return None, "unavailable"
        if found is None:
            return None, "miss"
        _, entry = found
        if entry.expires_at <= self.clock():
            return None, "expired"
        if not self._history_ok(route, ident, entry, body, scope):
            return None, "mismatch"
        return entry.params, "hit"

    async def remember(
        self,
        route: str,
        scope: bytes,
        body: dict[str, Any],
        session_id: str | None,
        reply: dict[str, Any] | None,
        params: dict[str, Any],
        decode: str,
    ) -> None:
        now = self.clock()
        ttl = self.config.session_ttl
        # A patched D (bpdkv node plugin) says how long its blocks live in relative seconds, which needs no clock sync.
        expires_in = params.get("remote_blocks_expires_in")
        if isinstance(expires_in, (int, float)):
            ttl = min(ttl, float(expires_in) - self.config.expiry_margin)
        if ttl <= 0:
            return
        entry = sessions.SessionEntry(params=params, expires_at=now + ttl, history="", decode=decode)
        keys: list[str] = []
        explicit = session_id if self.config.session_identity != "auto" or session_id else None
        if route == CHAT:
            messages = list(body.get("messages") or []) + ([reply] if reply else [])
            digest = sessions.chat_chain(scope, messages)[-1].hex()
            entry.history = digest
            keys.append("x:" + sessions._h(scope, explicit.encode()).hex() if explicit else "c:" + digest)
        else:
            prompt = body.get("prompt")
            tokens = prompt if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt) else None
            if tokens is not None:
                entry.history = sessions.token_digest(scope, tokens)
                entry.length = len(tokens)
            if explicit:
                keys.append("x:" + sessions._h(scope, explicit.encode()).hex())
            elif tokens is not None:
                chain = sessions.token_chain(scope, tokens)
                if chain:
                    keys.append("t:" + chain[-1][1].hex())
        if not keys:
            return
        try:
            for key in keys:
                await self.store.put(key, entry, ttl)
            self.metrics.stored.inc()
        except sessions.StoreUnavailable:
            self.metrics.store_errors.inc()

    # ---- the P/D flow ----------------------------------------------------------------------------------------
    async def _race_disconnect(self, request: Request, work: Awaitable[T]) -> T:
        """Run work; if the client disconnects first, cancel it (and with it the upstream request)."""
        task = asyncio.ensure_future(work)

        async def gone() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(gone())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            watcher.cancel()
            raise
        if task in done:
            watcher.cancel()
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001
            pass
        raise ClientGone()

    async def _handle(self, request: Request, route: str) -> Response | SseStream:
        start = time.perf_counter()
        self.metrics.in_flight.inc()
        status = 500
        streaming = False
        try:
            response = await self._flow(request, route, start)
            status = response.status_code
            streaming = isinstance(response, SseStream)
            return response
        except ClientGone:
            self.metrics.disconnects.inc()
            status = 499
            return Response(status_code=499)
        finally:
            if not streaming:  # a stream is counted by _relay when it ends
                self.metrics.in_flight.dec()
                self.metrics.requests.labels(route, str(status)).inc()

    async def _flow(self, request: Request, route: str, start: float) -> Response | SseStream:
        tenant = self._tenant(request)
        if tenant is None:
            return _error(401, "invalid or missing API key", "authentication_error")
        try:
            raw = await request.body()
            body = json.loads(raw)
        except ValueError:
            return _error(400, "request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        body, field_id = protocol.sanitize(body)
        header_id = request.headers.get(protocol.SESSION_HEADER) or None
        mode = self.config.session_identity
        session_id = header_id if mode == "header" else field_id if mode == "field" else (header_id or field_id)
        ident, affinity, scope = self.identity(route, tenant, body, session_id)
        if request.headers.get(protocol.REUSE_HEADER, "").lower() == "off":
            ident = None  # benchmark A/B on one fleet: neither look up nor store
        d_params, outcome = await self.lookup(route, ident, body, scope)
        self.metrics.reuse.labels(outcome).inc()
        headers = self._upstream_headers(request)

        salt = uuid.uuid4().hex if request.headers.get(protocol.P_CACHE_HEADER, "").lower() == "off" else None
        p_params = await self._race_disconnect(request, self._prefill(route, body, d_params, affinity, headers, salt))
        if isinstance(p_params, Response):
            return p_params
        stream = bool(body.get("stream"))
        reuse_ctx = (route, scope, body, session_id if ident is not None else None, ident is not None)
        if stream:
            return await self._decode_stream(request, route, body, p_params, headers, start, reuse_ctx)
        return await self._race_disconnect(request, self._decode_whole(route, body, p_params, headers, start, reuse_ctx))

    async def _prefill(
        self,
        route: str,
        body: dict[str, Any],
        d_params: dict[str, Any] | None,
        affinity: bytes | None,
        headers: dict[str, str],
        salt: str | None = None,
    ) -> dict[str, Any] | None | Response:
        assert self.client is not None
        last = "no prefill upstream available"
        for member in self._attempts(self.prefill, affinity):
            t0 = time.perf_counter()
            member.outstanding += 1
            try:
                resp = await self._call(member.url + route, protocol.p_request(body, d_params, salt), headers, self.config.timeouts.prefill)
            except UPSTREAM_ERRORS as exc:
                last = self._failed(self.prefill, member, type(exc).__name__)
                d_params = None  # the failed P may have started the pull; never hand D's blocks out twice
                continue
            finally:
                member.outstanding -= 1
            self.metrics.upstream.labels("prefill").observe(time.perf_counter() - t0)
            if resp.status >= 500:
                last = self._failed(self.prefill, member, f"http_{resp.status}")
                d_params = None
                continue
            if resp.status != 200:
                return self._passthrough_error(resp)
            self.prefill.success(member)
            try:
                params = resp.json().get("kv_transfer_params")
            except ValueError:
                params = None
            return params if isinstance(params, dict) else None
        return _error(502, f"no prefill upstream succeeded ({last})", "upstream_error")

    async def _call(self, url: str, payload: Any, headers: dict[str, str], read_timeout: float, method: str = "POST") -> Buffered:
        assert self.client is not None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.timeouts.connect, sock_read=read_timeout)
        data = None if payload is None else json.dumps(payload, separators=(",", ":")).encode()
        hdrs = dict(headers, **{"content-type": "application/json"}) if data is not None else headers
        async with self.client.request(method, url, data=data, headers=hdrs, timeout=timeout) as resp:
            return Buffered(resp.status, resp.headers.get("content-type", "application/json"), await resp.read())

    def _failed(self, pool: Pool, member: Upstream, kind: str) -> str:
        """Passive health + metrics for one failed upstream attempt; returns the text for the client's error."""
        pool.failure(member, kind)
        self.metrics.upstream_errors.labels(pool.role, member.name, kind).inc()
        return f"{pool.role} {member.name}: {kind}"

    def _attempts(self, pool: Pool, affinity: bytes | None) -> Iterator[Upstream]:
        """Each upstream at most once, best first; retries counted."""
        tried: set[str] = set()
        for attempt in range(len(pool.members)):
            member = pool.pick(affinity, tried)
            if member is None:
                return
            tried.add(member.name)
            if attempt:
                self.metrics.retries.labels(pool.role).inc()
            yield member

    def _passthrough_error(self, resp: Buffered) -> Response:
        content = resp.content
        try:
            data = json.loads(content)
            if isinstance(data, dict) and "kv_transfer_params" in data:
                data.pop("kv_transfer_params")
                content = json.dumps(data).encode()
        except ValueError:
            pass
        return Response(content, status_code=resp.status, media_type=resp.content_type)

    def _d_params_missing(self, member: Upstream) -> None:
        self.metrics.d_params_missing.inc()
        if not self._warned_missing:
            self._warned_missing = True
            log.warning(
                "decode %s returned no kv_transfer_params; reuse needs the bpdkv node plugin (vLLM streams carry none)", member.name
            )

    async def _after_decode(
        self, ctx: tuple[Any, ...], reply: dict[str, Any] | None, finish: str | None, params: Any, member: Upstream
    ) -> None:
        route, scope, body, session_id, eligible = ctx
        if not self.config.reuse or not eligible:
            return
        if params is None:
            if finish in REUSABLE_FINISH:
                self._d_params_missing(member)
            return
        if finish in REUSABLE_FINISH and protocol.usable_d_params(params):
            await self.remember(route, scope, body, session_id, reply, params, member.name)

    async def _decode_whole(
        self, route: str, body: dict[str, Any], p_params: dict[str, Any] | None, headers: dict[str, str], start: float, ctx: tuple[Any, ...]
    ) -> Response:
        assert self.client is not None
        last = "no decode upstream available"
        t = self.config.timeouts
        for member in self._attempts(self.decode, None):
            member.outstanding += 1
            t0 = time.perf_counter()
            try:
                # A whole answer arrives at once: the read bound is the first-byte bound.
                resp = await self._call(
                    member.url + route, protocol.d_request(body, p_params), headers, max(t.decode_first_byte, t.decode_idle)
                )
            except UPSTREAM_ERRORS as exc:
                last = self._failed(self.decode, member, type(exc).__name__)
                continue
            finally:
                member.outstanding -= 1
            self.metrics.upstream.labels("decode").observe(time.perf_counter() - t0)
            if resp.status >= 500:
                last = self._failed(self.decode, member, f"http_{resp.status}")
                continue
            self.decode.success(member)
            if resp.status != 200:
                return self._passthrough_error(resp)
            try:
                data = resp.json()
            except ValueError:
                return Response(resp.content, status_code=resp.status, media_type=resp.content_type)
            params = data.pop("kv_transfer_params", None) if isinstance(data, dict) else None
            reply, finish = protocol.assistant_from_body(data, route == CHAT) if isinstance(data, dict) else (None, None)
            await self._after_decode(ctx, reply, finish, params, member)
            self.metrics.ttft.observe(time.perf_counter() - start)
            return Response(json.dumps(data, ensure_ascii=False).encode(), status_code=200, media_type="application/json")
        return _error(502, f"no decode upstream succeeded ({last})", "upstream_error")

    async def _decode_stream(
        self,
        request: Request,
        route: str,
        body: dict[str, Any],
        p_params: dict[str, Any] | None,
        headers: dict[str, str],
        start: float,
        ctx: tuple[Any, ...],
    ) -> Response | SseStream:
        assert self.client is not None
        t = self.config.timeouts
        last = "no decode upstream available"
        for member in self._attempts(self.decode, None):
            member.outstanding += 1
            t0 = time.perf_counter()
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.connect, sock_read=t.decode_idle)
            payload = json.dumps(protocol.d_request(body, p_params), separators=(",", ":")).encode()
            resp: aiohttp.ClientResponse | None = None
            try:
                resp = await self._race_disconnect(
                    request,
                    asyncio.wait_for(
                        self.client.post(
                            member.url + route, data=payload, headers=dict(headers, **{"content-type": "application/json"}), timeout=timeout
                        ),
                        t.decode_first_byte,
                    ),
                )
                if resp.status != 200:
                    buffered = Buffered(resp.status, resp.headers.get("content-type", "application/json"), await resp.read())
                    resp.release()
                    if resp.status >= 500:
                        raise UpstreamFailed(resp.status, f"HTTP {resp.status}")
                    member.outstanding -= 1
                    return self._passthrough_error(buffered)
                # Hold the response until D's first body bytes: until then a failing D can be swapped for another.
                chunks = resp.content.iter_any()
                first = await self._race_disconnect(request, asyncio.wait_for(chunks.__anext__(), t.decode_first_byte))
            except ClientGone:
                if resp is not None:
                    resp.close()
                member.outstanding -= 1
                raise
            except (*UPSTREAM_ERRORS, StopAsyncIteration, UpstreamFailed) as exc:
                kind = f"http_{exc.status}" if isinstance(exc, UpstreamFailed) else type(exc).__name__
                if resp is not None:
                    resp.close()
                member.outstanding -= 1
                last = self._failed(self.decode, member, kind)
                continue
            self.decode.success(member)
            self.metrics.upstream.labels("decode").observe(time.perf_counter() - t0)
            return SseStream(
                self._relay(resp, chunks, first, member, route, start, ctx), resp.headers.get("content-type", "text/event-stream")
            )
        return _error(502, f"no decode upstream succeeded ({last})", "upstream_error")

    async def _relay(
        self,
        resp: aiohttp.ClientResponse,
        chunks: AsyncIterator[bytes],
        first_chunk: bytes,
        member: Upstream,
        route: str,
        start: float,
        ctx: tuple[Any, ...],
    ) -> AsyncIterator[bytes]:
        capture = protocol.StreamCapture()
        chat = route == CHAT
        completed = False
        first = True
        try:
            out = capture.feed(first_chunk, chat)
            if out:
                self.metrics.ttft.observe(time.perf_counter() - start)
                first = False
                yield out
            async for chunk in chunks:
                out = capture.feed(chunk, chat)
                if out:
                    if first:
                        self.metrics.ttft.observe(time.perf_counter() - start)
                        first = False
                    yield out
            rest = capture.flush()
            if rest:
                yield rest
            completed = True
        except UPSTREAM_ERRORS as exc:
            # Mid-stream failure: the client already has bytes, so no retry; end the stream with an error event.
            self.metrics.upstream_errors.labels("decode", member.name, type(exc).__name__).inc()
            self.decode.failure(member, type(exc).__name__)
            err = {"error": {"message": f"decode {member.name} failed mid-stream: {type(exc).__name__}", "type": "upstream_error"}}
            yield b"data: " + json.dumps(err).encode() + b"\n\n"
        finally:
            member.outstanding -= 1
            if completed:
                resp.release()  # keep the connection for the next request
            else:
                resp.close()  # client gone or D failed: drop the connection, which cancels D's request
            self.metrics.requests.labels(route, "200" if completed else "499").inc()
            self.metrics.in_flight.dec()
        if completed:
            reply = capture.assistant_message() if chat else {"role": "assistant", "content": "".join(capture.text)}
            await self._after_decode(ctx, reply, capture.finish_reason, capture.params, member)
