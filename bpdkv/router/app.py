"""The router's ASGI app: routes, auth, request limits, admin API, and the glue of one request — identity and stored
D location (sessions), the P→D turn (turn), the stream to the client (relay)."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import ipaddress
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from bpdkv import contracts
from bpdkv.router import jsonbytes, security, sessions
from bpdkv.router.config import RouterConfig
from bpdkv.router.metrics import RouterMetrics
from bpdkv.router.relay import RelayOutcome, Reply, SseRelay
from bpdkv.router.sessions import Reuse, Verdict
from bpdkv.router.turn import (
    REUSABLE_FINISH,
    UPSTREAM_ERRORS,
    DecodedWhole,
    DecodeStream,
    NoUpstream,
    Passthrough,
    PdTurn,
    Prefilled,
    usable_d_params,
)
from bpdkv.router.upstream_http import UpstreamClient
from bpdkv.router.upstreams import Pool, Upstream, check_all, check_member, health_loop

log = logging.getLogger("bpdkv.router")
T = TypeVar("T")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})
# Keys of D's answer that are news for the router, not part of where the blocks are.
ANNOUNCEMENT_KEYS = frozenset({contracts.RELEASED_REQUEST_IDS, contracts.PULL_OUTCOME})
GAUGE_REFRESH_S = 1.0  # how stale a worker's upstream gauges may be in a multi-worker scrape


def _release_key(decode: str, request_id: Any) -> str:
    return f"{decode}:{request_id}"


class ClientGone(Exception):
    pass


class DisconnectWatch:
    """One watcher per request, from the end of its body to the end of its response: a client that goes away
    cancels the request's task — the upstream exchange in progress is dropped with it (cancelling D's request)."""

    __slots__ = ("receive", "account", "task", "watcher", "gone")

    def __init__(self, receive: Receive, account: RequestAccount) -> None:
        self.receive, self.account = receive, account
        self.task: asyncio.Task[Any] | None = None
        self.watcher: asyncio.Task[None] | None = None
        self.gone = False

    def start(self) -> None:
        self.task = asyncio.current_task()
        self.watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                # After the response is counted, a disconnect is the connection's normal end, not this request's.
                if not self.account.done and self.task is not None:
                    self.gone = True
                    self.task.cancel()
                return

    def client_gone(self) -> bool:
        """Whether the watcher cancelled the request; the cancellation is then ours, not the server's."""
        if self.gone and self.task is not None and hasattr(self.task, "uncancel"):
            self.task.uncancel()
        return self.gone

    def stop(self) -> None:
        # Dropped before the cancel: the cancelled task keeps its CancelledError, whose traceback holds _watch's
        # frame and so this object; were the task still referenced from here, that would be a reference cycle per
        # request (with its frames, the request task and uvicorn's request cycle) that only the cyclic GC frees —
        # measured: most of what its collections walked, and their pauses were the TTFT tail.
        watcher, self.watcher = self.watcher, None
        if watcher is not None:
            watcher.cancel()


class BadRequest(Exception):
    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason


def _error(status: int, message: str, kind: str = "router_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _passthrough(answer: Any) -> Response:
    """vLLM's own error answer, unchanged — except that kv_transfer_params never reach a client."""
    content = answer.content
    if contracts.KV_TRANSFER_PARAMS.encode() in content:
        try:
            data = json.loads(content)
            if isinstance(data, dict):
                data.pop(contracts.KV_TRANSFER_PARAMS, None)
                content = json.dumps(data).encode()
        except ValueError:
            pass
    return Response(content, status_code=answer.status, media_type=answer.content_type)


class RequestAccount:
    """One client request in the in-flight gauge and the requests counter; finish() counts it exactly once."""

    __slots__ = ("metrics", "route", "done")

    def __init__(self, metrics: RouterMetrics, route: str) -> None:
        self.metrics, self.route, self.done = metrics, route, False
        metrics.in_flight.inc()

    def finish(self, status: int) -> None:
        if not self.done:
            self.done = True
            self.metrics.in_flight.dec()
            self.metrics.child(self.metrics.requests, self.route, str(status)).inc()


# ---- bad input ---------------------------------------------------------------------------------------------------
def json_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether value nests deeper than limit (iterative: a hostile body cannot exhaust the stack)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, (dict, list)))
    return False


def shape_problem(route: str, body: dict[str, Any]) -> str | None:
    """What the router itself relies on, checked before any upstream sees the request (one line, or None)."""
    if "stream" in body and not isinstance(body["stream"], bool):
        return "'stream' must be true or false"
    n = body.get("n")
    if n is not None and (type(n) is not int or n < 1):
        return "'n' must be a positive integer"
    if route == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty array of message objects"
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict):
                return f"messages[{i}] must be an object with 'role' and 'content'"
            role = msg.get("role")
            if not isinstance(role, str) or role not in ROLES:
                return f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}"
            content = msg.get("content")
            if content is not None and not isinstance(content, (str, list)):
                return f"messages[{i}].content must be a string, an array of content parts or null"
            if isinstance(content, list) and not all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content):
                return f"messages[{i}].content parts must be objects with a 'type'"
            calls = msg.get("tool_calls")
            if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
                return f"messages[{i}].tool_calls must be an array of objects"
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list) and prompt:
        if all(type(t) is int for t in prompt) or all(isinstance(t, str) for t in prompt):
            return None
        if all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompt):
            return None
    return "'prompt' must be a string, an array of strings, an array of token ids or an array of token-id arrays"


def sanitize(body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """Drop client-supplied kv_transfer_params (a client must never steer NIXL) and explicit session fields."""
    clean = dict(body)
    clean.pop(contracts.KV_TRANSFER_PARAMS, None)
    session = None
    for key in contracts.SESSION_FIELDS:
        value = clean.pop(key, None)
        if session is None and isinstance(value, (str, int)) and not isinstance(value, bool) and str(value):
            session = str(value)
    return clean, session


def _is_loopback(scope: Scope) -> bool:
    client = scope.get("client")
    if not client:
        return False
    try:
        return ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


class Router:
    def __init__(
        self,
        config: RouterConfig,
        store: sessions.SessionStore | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.clock = clock
        self.store = store or sessions.make_store(
            config.state, clock, security.redis_options(config.state_password_file, config.state_ca_file)
        )
        self.metrics = RouterMetrics()
        self.api_keys = security.KeyRing.load(config.api_keys_file)  # digests only: no key is held in memory
        self.admin_key = security.load_admin_key(config.admin_key_file)
        h = config.health
        self.prefill = Pool("prefill", [Upstream(u.name, u.url, "prefill") for u in config.prefill], h.failures_to_eject, h.backoff_max)
        self.decode = Pool("decode", [Upstream(u.name, u.url, "decode") for u in config.decode], h.failures_to_eject, h.backoff_max)
        self.client: UpstreamClient | None = None
        self.turn = PdTurn(self.prefill, self.decode, self.metrics, config.timeouts, self._session, clock)
        self._stop = asyncio.Event()
        self._health_task: asyncio.Task[None] | None = None
        self._gauge_task: asyncio.Task[None] | None = None
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
                Route("/admin/upstreams", self.admin_list, methods=["GET"]),
                Route("/admin/upstreams/{name}/{action}", self.admin_action, methods=["POST"]),
            ],
            lifespan=self._lifespan,
        )

    def _session(self) -> UpstreamClient:
        assert self.client is not None, "router not started"
        return self.client

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
        account = RequestAccount(self.metrics, route)
        start = time.perf_counter()
        watch = DisconnectWatch(receive, account)
        response: Response | SseRelay
        try:
            try:
                response = await self._flow(request, route, start, account, watch)
            except ClientGone:
                self.metrics.disconnects.inc()
                account.finish(499)
                return
            except asyncio.CancelledError:
                if not watch.client_gone():
                    raise
                self.metrics.disconnects.inc()
                account.finish(499)
                return
            except Exception:  # noqa: BLE001 - a bug must cost one request a 500, never the process
                log.exception("router error on %s", route)
                response = _error(500, "internal router error")
            if isinstance(response, SseRelay):
                try:
                    await response.send_to(send)
                except asyncio.CancelledError:
                    if not watch.client_gone():
                        raise
                finally:
                    await response.close(False)  # no-op when send_to closed it; else the response never started
                return
            account.finish(response.status_code)
            await response(scope, receive, send)
        finally:
            watch.stop()

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
        # Not httpx (its pool scanned every connection per request: 84% of router CPU at 64 streams) nor aiohttp
        # (a task wake-up per streamed token): see upstream_http.
        self.client = UpstreamClient(self.config.timeouts.connect)
        self._stop.clear()
        if self.config.health.interval > 0:
            self._health_task = asyncio.create_task(
                health_loop(
                    [self.prefill, self.decode], self.client, self.config.health.interval, self.config.health.check_timeout, self._stop
                )
            )
        if self.metrics.multiprocess_dir is not None:
            self._gauge_task = asyncio.create_task(self._upstream_gauge_loop())

    async def stop(self) -> None:
        self._stop.set()
        for task in (self._health_task, self._gauge_task):
            if task:
                task.cancel()
                try:
                    await task
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
        if self._tenant(request) is None:
            return _error(401, "invalid or missing API key", "authentication_error")
        for member in self.decode.candidates(set()) + self.prefill.candidates(set()):
            try:
                got = await self.turn.call(
                    member.url + "/v1/models", None, self._upstream_headers(request), self.config.timeouts.connect, "GET"
                )
                return Response(got.content, status_code=got.status, media_type="application/json")
            except UPSTREAM_ERRORS:
                continue
        if self.config.model:
            return JSONResponse({"object": "list", "data": [{"id": self.config.model, "object": "model", "owned_by": "bpdkv"}]})
        return _error(503, "no upstream answered /v1/models")

    def _set_upstream_gauges(self) -> None:
        now = time.monotonic()
        for pool in (self.prefill, self.decode):
            for m in pool.members:
                self.metrics.backend_healthy.labels(pool.role, m.name).set(1 if m.available(now) else 0)
                self.metrics.outstanding.labels(pool.role, m.name).set(m.outstanding)

    async def _upstream_gauge_loop(self) -> None:
        """Multiprocess mode: a scrape reaches one worker, so every worker writes its upstream gauges each second."""
        while not self._stop.is_set():
            self._set_upstream_gauges()
            try:
                await asyncio.wait_for(self._stop.wait(), GAUGE_REFRESH_S)
            except asyncio.TimeoutError:
                pass

    async def metrics_endpoint(self, request: Request) -> Response:
        self._set_upstream_gauges()
        try:
            self.metrics.active_sessions.set(await self.store.count())
        except sessions.StoreUnavailable:
            self.metrics.store_errors.inc()
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def check_health_now(self) -> None:
        await check_all([self.prefill, self.decode], self._session(), timeout=2.0)

    # ---- admin (rolling deploys) -----------------------------------------------------------------------------
    def _admin_denied(self, request: Request) -> Response | None:
        """With an admin key file: its key only (401 without, 403 wrong). Without one: loopback clients only.
        Client API keys never open admin routes."""
        if self.admin_key:
            presented = self._bearer(request)
            if presented is None:
                return _error(401, "admin key required (Authorization: Bearer)", "authentication_error")
            if self.admin_key.tenant(presented) is None:
                return _error(403, "wrong admin key", "permission_error")
            return None
        if not _is_loopback(request.scope):
            return _error(403, "admin API answers loopback clients only (no admin_key_file configured)", "permission_error")
        return None

    def _members(self) -> list[Upstream]:
        return self.prefill.members + self.decode.members

    async def admin_list(self, request: Request) -> Response:
        denied = self._admin_denied(request)
        if denied is not None:
            return denied
        now = time.monotonic()
        return JSONResponse({"upstreams": [m.describe(now) for m in self._members()]})

    async def admin_action(self, request: Request) -> Response:
        denied = self._admin_denied(request)
        if denied is not None:
            return denied
        name, action = request.path_params["name"], request.path_params["action"]
        if action not in ("drain", "undrain"):
            return _error(404, f"unknown admin action {action!r} (drain, undrain)", "not_found_error")
        member = next((m for m in self._members() if m.name == name), None)
        if member is None:
            return _error(404, f"no upstream named {name!r}", "not_found_error")
        if action == "drain":
            member.drained = True
        elif member.drained:
            member.drained = False
            # A drain usually brackets a restart: blocks D held before it are gone, the new engine is unknown yet.
            member.restarted_at = self.clock()
            member.ejected_until = 0.0
            # A health check that ran while it restarted marked it unhealthy: check now, so that it serves as soon
            # as it is undrained (not up to one health interval later) and the answer says its real state.
            pool = self.prefill if member in self.prefill.members else self.decode
            await check_member(pool, member, self._session(), timeout=self.config.health.check_timeout)
        log.info("admin: %s %s (%s %s)", action, name, member.role, member.url)
        return JSONResponse(member.describe(time.monotonic()))

    # ---- auth ------------------------------------------------------------------------------------------------
    @staticmethod
    def _bearer(request: Request) -> str | None:
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            return auth[7:].strip() or None
        return None

    def _tenant(self, request: Request) -> str | None:
        """None = rejected. With keys: the key's tenant name. Without: a digest of whatever key came (sessions never
        cross keys, keys never reach logs)."""
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
        rid = request.headers.get(contracts.REQUEST_ID_HEADER)
        if rid:
            headers[contracts.REQUEST_ID_HEADER] = rid
        return headers

    # ---- request body ----------------------------------------------------------------------------------------
    async def _read_body(self, request: Request) -> dict[str, Any]:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(413, f"request body of {declared} bytes is over the router's limit of {limit} bytes", "too_large")
        parts: list[bytes] = []
        size = 0
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BadRequest(413, f"request body is over the router's limit of {limit} bytes", "too_large")
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        raw = b"".join(parts)
        try:
            body = jsonbytes.loads(raw)
        except RecursionError:
            raise BadRequest(400, f"request body nests deeper than {self.config.max_json_depth} levels", "too_deep") from None
        except ValueError:
            raise BadRequest(400, "request body is not valid JSON", "invalid_json") from None
        if not isinstance(body, dict):
            raise BadRequest(400, "request body must be a JSON object", "not_object")
        # Nesting needs an opening bracket per level: a body with few of them cannot be too deep (no walk needed).
        limit_depth = self.config.max_json_depth
        if raw.count(b"{") + raw.count(b"[") > limit_depth and json_depth_exceeds(body, limit_depth):
            raise BadRequest(400, f"request body nests deeper than {limit_depth} levels", "too_deep")
        return body

    # ---- sessions --------------------------------------------------------------------------------------------
    async def lookup(self, ident: sessions.Identity | None) -> tuple[sessions.SessionEntry | None, Reuse]:
        if not self.config.reuse or ident is None:
            return None, Reuse.SKIPPED
        if not ident.lookup_keys:
            return None, Reuse.MISS  # first turn: nothing could have been stored yet
        now = self.clock()
        seen: list[Reuse] = []

        def judge(entry: sessions.SessionEntry) -> Verdict:
            if entry.expires_at <= now:
                seen.append(Reuse.EXPIRED)
                return Verdict.DROP
            if not ident.covers(entry):
                seen.append(Reuse.MISMATCH)
                return Verdict.LEAVE  # another conversation's: neither consumed nor touched
            holder = self.decode.member(entry.decode)
            if holder is None or not holder.holds(entry.params.get(contracts.REMOTE_ENGINE_ID), entry.stored_at):
                seen.append(Reuse.REFUSED)
                return Verdict.DROP
            return Verdict.TAKE

        try:
            entry, _ = await self.store.take(list(ident.lookup_keys), judge)
        except sessions.StoreUnavailable:
            self.metrics.store_errors.inc()
            return None, Reuse.UNAVAILABLE
        if entry is not None:
            try:
                if await self.store.is_released(_release_key(entry.decode, entry.params.get(contracts.REMOTE_REQUEST_ID))):
                    return None, Reuse.REFUSED  # D gave those blocks up (hold budget): they may hold others' KV now
            except sessions.StoreUnavailable:
                self.metrics.store_errors.inc()
                return None, Reuse.UNAVAILABLE  # cannot tell: never risk another conversation's KV
            return entry, ident.outcome_of(entry)
        for outcome in (Reuse.REFUSED, Reuse.EXPIRED, Reuse.MISMATCH):
            if outcome in seen:
                return None, outcome
        return None, Reuse.MISS

    async def remember(self, ident: sessions.Identity, body: dict[str, Any], reply: Reply, decode: str) -> None:
        params = {k: v for k, v in (reply.params or {}).items() if k not in ANNOUNCEMENT_KEYS}
        ttl = self.config.session_ttl
        # A patched D (bpdkv node plugin) says how long its blocks live in relative seconds, which needs no clock sync.
        expires_in = params.get(contracts.REMOTE_BLOCKS_EXPIRES_IN)
        if isinstance(expires_in, (int, float)):
            ttl = min(ttl, float(expires_in) - self.config.expiry_margin)
        if ttl <= 0:
            return
        now = self.clock()
        target = sessions.to_store(ident, body, reply.message(), params, decode, now)
        if target is None:
            return
        key, entry, only_if_absent = target
        entry.expires_at = now + ttl
        try:
            if await self.store.put(key, entry, ttl, only_if_absent):
                self.metrics.stored.inc()
            else:
                self.metrics.store_refused.inc()
        except sessions.StoreUnavailable:
            self.metrics.store_errors.inc()

    async def _after_decode(self, ident: sessions.Identity | None, body: dict[str, Any], reply: Reply, member: Upstream) -> None:
        self.turn.observe_decode(member, reply.params)
        await self._note_released(member, reply.params)
        if not self.config.reuse or ident is None:
            return
        if reply.params is None:
            if reply.finish_reason in REUSABLE_FINISH:
                self._d_params_missing(member)
            return
        if reply.finish_reason in REUSABLE_FINISH and usable_d_params(reply.params):
            await self.remember(ident, body, reply, member.name)

    async def _note_released(self, member: Upstream, params: dict[str, Any] | None) -> None:
        """D (bpdkv plugin, hold budget) names held blocks it let go since its previous answer; whichever router
        worker hears it, every worker must refuse entries pointing at them (the store shares the marks)."""
        ids = params.get(contracts.RELEASED_REQUEST_IDS) if params else None
        if not isinstance(ids, list) or not ids:
            return
        keys = [_release_key(member.name, rid) for rid in ids if isinstance(rid, str)]
        self.metrics.released.inc(len(keys))
        try:
            await self.store.mark_released(keys, self.config.session_ttl + self.config.expiry_margin)
        except sessions.StoreUnavailable:
            self.metrics.store_errors.inc()

    def _d_params_missing(self, member: Upstream) -> None:
        self.metrics.d_params_missing.inc()
        if not self._warned_missing:
            self._warned_missing = True
            log.warning(
                "decode %s returned no kv_transfer_params; reuse needs the bpdkv node plugin (vLLM streams carry none)", member.name
            )

    # ---- the P/D flow ----------------------------------------------------------------------------------------
    async def _flow(
        self, request: Request, route: str, start: float, account: RequestAccount, watch: DisconnectWatch
    ) -> Response | SseRelay:
        tenant = self._tenant(request)
        if tenant is None:
            self.metrics.rejected.labels("auth").inc()
            return _error(401, "invalid or missing API key", "authentication_error")
        try:
            raw_body = await self._read_body(request)
            problem = shape_problem(route, raw_body)
            if problem is not None:
                raise BadRequest(400, problem, "shape")
        except BadRequest as bad:
            self.metrics.rejected.labels(bad.reason).inc()
            return _error(bad.status, bad.message, "invalid_request_error")
        watch.start()  # the body is in: from here on, a disconnect cancels this request (and its upstream exchange)
        body, field_id = sanitize(raw_body)
        header_id = request.headers.get(contracts.SESSION_HEADER) or None
        mode = self.config.session_identity
        session_id = header_id if mode == "header" else field_id if mode == "field" else (header_id or field_id)
        ident = None
        if request.headers.get(contracts.REUSE_HEADER, "").lower() != contracts.SWITCH_OFF:  # benchmark A/B on one fleet
            ident = sessions.identify(route, tenant, body, session_id, mode)
        entry, outcome = await self.lookup(ident)
        headers = self._upstream_headers(request)
        salt = uuid.uuid4().hex if request.headers.get(contracts.P_CACHE_HEADER, "").lower() == contracts.SWITCH_OFF else None
        prefilled = await self.turn.prefill(
            route,
            body,
            entry.params if entry else None,
            entry.decode if entry else None,
            ident.affinity if ident else None,
            headers,
            salt,
        )
        if isinstance(prefilled, Prefilled):  # P's answer says what reuse this request really got
            pulled = prefilled.params.get(contracts.PULL_OUTCOME) if prefilled.params else None
            outcome = sessions.settle(outcome, pulled, prefilled.fell_back)
        self.metrics.child(self.metrics.reuse, outcome.value).inc()
        if isinstance(prefilled, NoUpstream):
            return _error(502, prefilled.message, "upstream_error")
        if isinstance(prefilled, Passthrough):
            return _passthrough(prefilled.answer)
        stream = bool(body.get("stream"))
        if ident is not None and request.headers.get(contracts.LAST_TURN_HEADER, "").lower() in contracts.LAST_TURN_VALUES:
            self.metrics.last_turns.inc()
            ident = None  # the client says no turn follows: nothing to store, nothing for D to hold
        hold = self.config.reuse and ident is not None  # else D need not keep this turn's blocks
        decoded = await self.turn.decode(route, body, prefilled.params, headers, stream, hold)
        if isinstance(decoded, NoUpstream):
            return _error(502, decoded.message, "upstream_error")
        if isinstance(decoded, Passthrough):
            return _passthrough(decoded.answer)
        if isinstance(decoded, DecodedWhole):
            return await self._whole(decoded, route, body, ident, start)
        return self._relay(decoded, body, ident, start, account)

    async def _whole(
        self, decoded: DecodedWhole, route: str, body: dict[str, Any], ident: sessions.Identity | None, start: float
    ) -> Response:
        answer = decoded.answer
        try:
            data = jsonbytes.loads(answer.content)
        except ValueError:
            return Response(answer.content, status_code=answer.status, media_type=answer.content_type)
        if not isinstance(data, dict):
            return Response(answer.content, status_code=answer.status, media_type=answer.content_type)
        reply = Reply.of(data)
        data.pop(contracts.KV_TRANSFER_PARAMS, None)
        await self._after_decode(ident, body, reply, decoded.member)
        self.metrics.ttft.observe(time.perf_counter() - start)
        return Response(jsonbytes.dumps(data), status_code=200, media_type="application/json")

    def _relay(
        self, decoded: DecodeStream, body: dict[str, Any], ident: sessions.Identity | None, start: float, account: RequestAccount
    ) -> SseRelay:
        keep = self.config.reuse and ident is not None
        member = decoded.member

        async def on_close(outcome: RelayOutcome) -> None:
            if outcome.error is not None and not outcome.error.startswith("client"):
                self.metrics.upstream_errors.labels("decode", member.name, outcome.error).inc()
                self.decode.failure(member, outcome.error)
            upstream_failed = outcome.error is not None and not outcome.error.startswith("client")
            account.finish(200 if outcome.completed else 502 if upstream_failed else 499)
            if not outcome.completed:
                return
            if keep:
                reply = Reply.of(outcome.kept)
                reply.params = outcome.params
                await self._after_decode(ident, body, reply, member)
            else:
                self.turn.observe_decode(member, outcome.params)
                await self._note_released(member, outcome.params)

        return SseRelay(decoded, on_close, lambda: self.metrics.ttft.observe(time.perf_counter() - start), keep)
