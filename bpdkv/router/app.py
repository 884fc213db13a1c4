"""The router's ASGI app: routes, auth, lifecycle, and the glue of one request — intake (read, validate, sanitise),
the reuse policy (identity and stored D location, beside sessions), the P→D turn (turn), the stream to the client
(relay). The admin API is in admin.py. Client APIs other than Chat Completions and Completions are surfaces
(surface.py): Anthropic Messages (messages.py) and OpenAI Responses (responses.py) turn their request into a chat
turn that runs the same pipeline, and render its answer in their own shape."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
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
from bpdkv.contracts import MissCause
from bpdkv.router import generations, jsonbytes, paths, security, sessions
from bpdkv.router.admin import AdminApi, bearer, error
from bpdkv.router.config import RouterConfig
from bpdkv.router.engines import STALE_AFTER, load_loop
from bpdkv.router.intake import CHAT, COMPLETIONS, BadRequest, ClientGone, read_body, sanitize, shape_problem
from bpdkv.router.messages import COUNT_TOKENS, MessagesSurface, to_chat
from bpdkv.router.metrics import RouterMetrics
from bpdkv.router.paths import PathDecision, PathReason, TurnPath
from bpdkv.router.relay import RelayOutcome, Reply, SseRelay
from bpdkv.router.reload import ConfigWatch, Loaded
from bpdkv.router.responses import ResponsesSurface
from bpdkv.router.returns import ReturnModel, stamp
from bpdkv.router.reuse import ReusePolicy
from bpdkv.router.sessions import Reuse
from bpdkv.router.surface import API_CHAT, API_COMPLETIONS, ChatTurn, Surface, SurfaceError, upstream_message
from bpdkv.router.turn import (
    UPSTREAM_ERRORS,
    DecodedWhole,
    DecodeStream,
    NoUpstream,
    Passthrough,
    PdTurn,
    Prefilled,
    local_params,
)
from bpdkv.router.upstream_http import UpstreamClient
from bpdkv.router.upstreams import Pool, Upstream, build_members, check_all, check_member, health_loop

log = logging.getLogger("bpdkv.router")
T = TypeVar("T")

GAUGE_REFRESH_S = 1.0  # how stale a worker's upstream gauges may be in a multi-worker scrape


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
        self.prefill = Pool("prefill", build_members(config.prefill, "prefill", config.generations), h.failures_to_eject, h.backoff_max)
        self.decode = Pool("decode", build_members(config.decode, "decode", config.generations), h.failures_to_eject, h.backoff_max)
        self.client: UpstreamClient | None = None
        self.turn = PdTurn(self.prefill, self.decode, self.metrics, config.timeouts, self._session, clock)
        self._stop = asyncio.Event()
        self._health_task: asyncio.Task[None] | None = None
        self._gauge_task: asyncio.Task[None] | None = None
        self._load_task: asyncio.Task[None] | None = None
        self.reuse = ReusePolicy(config, self.store, self.decode, self.metrics, clock, self.prefill)
        self.returns = ReturnModel(self.metrics, clock)  # how soon a conversation comes back: sent to D (returns.py)
        # The config file, watched: upstreams and generations apply without a restart (reload.py).
        self.watch = ConfigWatch(config, self.apply_upstreams, clock) if config.config_file else None
        self._unwatched = Loaded(None, clock())
        self._watch_task: asyncio.Task[None] | None = None
        self.admin = AdminApi(
            self.prefill, self.decode, self.admin_key, self._session, config.health.check_timeout, clock, self.loaded_config
        )
        key_env = config.backend_api_key_env
        self._backend_key = os.environ.get(key_env) if key_env else None
        self.responses = ResponsesSurface(lambda: self.store, clock)
        # The client APIs served as surfaces over the chat turn (surface.py), by route.
        self.surfaces: dict[str, Surface] = {MessagesSurface.route: MessagesSurface(), ResponsesSurface.route: self.responses}
        self.app = self  # the ASGI application (kept as an attribute for symmetry with Starlette apps)
        self._starlette = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route(ResponsesSurface.route + "/{response_id}", self.stored_response, methods=["GET", "DELETE"]),
                Route(COUNT_TOKENS, self.count_tokens, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/ready", self.ready, methods=["GET"]),
                Route("/metrics", self.metrics_endpoint, methods=["GET"]),
                *self.admin.routes(),
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
        if scope["type"] == "http" and scope.get("method") == "POST" and (path in (CHAT, COMPLETIONS) or path in self.surfaces):
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
                api = self.surfaces.get(route)
                response = api.error(500, "internal router error") if api is not None else error(500, "internal router error")
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
        if self.watch is not None:
            await self.watch.first()
            self._watch_task = asyncio.create_task(self.watch.run(self._stop))
        if self.config.health.interval > 0:
            self._health_task = asyncio.create_task(
                health_loop(
                    [self.prefill, self.decode],
                    self.client,
                    self.config.health.interval,
                    self.config.health.check_timeout,
                    self._stop,
                    self.publish_serving,
                )
            )
        interval = self.config.paths.load_interval
        if interval > 0:
            for member in self.prefill.members + self.decode.members:
                member.load_fresh_for = STALE_AFTER * interval
            self._load_task = asyncio.create_task(load_loop([self.prefill, self.decode], self.client, interval, self._stop))
        if self.metrics.multiprocess_dir is not None:
            self._gauge_task = asyncio.create_task(self._upstream_gauge_loop())

    async def stop(self) -> None:
        self._stop.set()
        for task in (self._health_task, self._gauge_task, self._load_task, self._watch_task):
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
            return error(401, "invalid or missing API key", "authentication_error")
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
        return error(503, "no upstream answered /v1/models")

    async def stored_response(self, request: Request) -> Response:
        """GET /v1/responses/{id}: a stored response of this tenant, as it was answered; DELETE: it is forgotten (a
        chain through it ends there). 404 in OpenAI's shape."""
        tenant = self._tenant(request)
        if tenant is None:
            return self.responses.error(401, "invalid or missing API key")
        response_id = request.path_params["response_id"]
        try:
            if request.method == "DELETE":
                if await self.responses.delete(tenant, response_id):
                    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
                found = None
            else:
                found = await self.responses.stored(tenant, response_id)
        except SurfaceError as refused:
            return self.responses.error(refused.status, refused.message, refused.param, refused.code)
        if found is None:
            return self.responses.error(404, f"Response with id '{response_id}' not found.", "response_id")
        return Response(jsonbytes.dumps(found), media_type="application/json")

    async def count_tokens(self, request: Request) -> Response:
        """POST /v1/messages/count_tokens: checked as a Messages request, then counted by an upstream (vLLM renders the
        prompt); no turn, nothing stored. Errors in Anthropic's shape."""
        api = self.surfaces[MessagesSurface.route]
        if self._tenant(request) is None:
            return api.error(401, "invalid or missing API key")
        c = self.config
        try:
            body = await read_body(request, c.max_body_bytes, c.max_json_depth, c.client_timeouts.body)
            to_chat(body, counting=True)
        except ClientGone:
            return Response(status_code=499)
        except (BadRequest, SurfaceError) as bad:
            self.metrics.rejected.labels(bad.reason).inc()
            return api.error(bad.status, bad.message)
        body.pop(contracts.KV_TRANSFER_PARAMS, None)
        for member in self.prefill.candidates(set()) + self.decode.candidates(set()):
            try:
                got = await self.turn.call(member.url + COUNT_TOKENS, body, self._upstream_headers(request), c.timeouts.prefill)
            except UPSTREAM_ERRORS:
                continue
            if got.status >= 500:
                continue
            if got.status != 200:
                return api.error(got.status, upstream_message(got.content))
            return Response(got.content, media_type="application/json")
        return api.error(503, "no upstream answered count_tokens")

    def publish_serving(self) -> None:
        generations.publish(self.prefill, self.decode, self.metrics)

    def _set_upstream_gauges(self) -> None:
        self.publish_serving()
        now = time.monotonic()
        for pool in (self.prefill, self.decode):
            for m in pool.members:
                self.metrics.backend_healthy.labels(pool.role, m.name).set(1 if m.available(now) else 0)
                self.metrics.outstanding.labels(pool.role, m.name).set(m.outstanding)
                engine = m.fresh_load(now)
                if engine is not None:
                    self.metrics.engine_running.labels(pool.role, m.name).set(engine.running)
                    self.metrics.engine_waiting.labels(pool.role, m.name).set(engine.waiting)
                    if engine.kv_usage is not None:
                        self.metrics.engine_kv_usage.labels(pool.role, m.name).set(engine.kv_usage)
                if pool is self.decode:
                    self._set_step_gauges(m, now)

    def _set_step_gauges(self, member: Upstream, now: float) -> None:
        """D's step time and the budget it gives a continued turn; no series while either is not measured."""
        step = member.steps.median(now, member.load_fresh_for)
        budget = paths.step_budget(step, paths.prefill_rate(self.prefill.members, now), self.config.paths.local_max_step_cost)
        for gauge, value in ((self.metrics.engine_step, step), (self.metrics.local_budget, budget)):
            if value is not None:
                gauge.labels("decode", member.name).set(value)
            else:
                try:
                    gauge.remove("decode", member.name)
                except KeyError:
                    pass

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

    # ---- the config, reloaded ------------------------------------------------------------------------------
    async def apply_upstreams(self, new: RouterConfig) -> None:
        """Apply a reloaded config's upstreams and generations in place (upstreams.Pool.reconcile); the members
        added or moved are checked at once, and serve once they answer as their generation says."""
        before = {(p.role, m.name) for p in (self.prefill, self.decode) for m in p.members}
        at = self.clock()
        check = [(self.prefill, m) for m in self.prefill.reconcile(new.prefill, new.generations, at)]
        check += [(self.decode, m) for m in self.decode.reconcile(new.decode, new.generations, at)]
        self.config = dataclasses.replace(self.config, prefill=new.prefill, decode=new.decode, generations=new.generations)
        interval = self.config.paths.load_interval
        for _, member in check:
            if interval > 0:
                member.load_fresh_for = STALE_AFTER * interval
        gone = before - {(p.role, m.name) for p in (self.prefill, self.decode) for m in p.members}
        for role, name in gone:  # no series of an upstream the router no longer has
            for gauge in (self.metrics.backend_healthy, self.metrics.outstanding, *self._engine_gauges()):
                try:
                    gauge.remove(role, name)
                except KeyError:
                    pass
        client = self._session()
        timeout = self.config.health.check_timeout
        await asyncio.gather(*(check_member(pool, m, client, timeout) for pool, m in check))
        self.publish_serving()
        log.info(
            "router config applied: prefill %s, decode %s, generations %s",
            [m.name for m in self.prefill.members],
            [m.name for m in self.decode.members],
            [g.id for g in self.config.generations] or "(none)",
        )

    def _engine_gauges(self) -> tuple[Any, ...]:
        m = self.metrics
        return (m.engine_running, m.engine_waiting, m.engine_kv_usage, m.engine_step, m.local_budget)

    def loaded_config(self) -> dict[str, Any]:
        """GET /admin/config: the file loaded (digest, when), the generations (oldest first) and the available P and D
        of each, as this router process sees them now."""
        loaded = self.watch.loaded if self.watch is not None else self._unwatched
        ids = [g.id for g in self.config.generations]
        members = (self.prefill.members, self.decode.members)
        return {
            "digest": loaded.digest,
            "loaded_at": loaded.loaded_at,
            "generations": ids,
            "serving": generations.serving_counts(*members, ids or [""], time.monotonic()),
            "pending_restart": list(loaded.pending_restart),
            "pid": os.getpid(),
        }

    # ---- auth ------------------------------------------------------------------------------------------------
    def _tenant(self, request: Request) -> str | None:
        """None = rejected. With keys: the key's tenant name. Without: a digest of whatever key came (sessions never
        cross keys, keys never reach logs)."""
        key = bearer(request)
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

    # ---- the P/D flow ----------------------------------------------------------------------------------------
    async def _flow(
        self, request: Request, route: str, start: float, account: RequestAccount, watch: DisconnectWatch
    ) -> Response | SseRelay:
        api = self.surfaces.get(route)  # None: Chat Completions or Completions, served as they are
        tenant = self._tenant(request)
        if tenant is None:
            self.metrics.rejected.labels("auth").inc()
            if api is not None:
                return api.error(401, "invalid or missing API key")
            return error(401, "invalid or missing API key", "authentication_error")
        turn: ChatTurn | None = None
        try:
            c = self.config
            raw_body = await read_body(request, c.max_body_bytes, c.max_json_depth, c.client_timeouts.body)
            if api is not None:
                turn = await api.parse(raw_body, dict(request.headers), tenant)
                raw_body = turn.body  # the chat turn the pipeline runs; kept to the chat intake's checks too
            problem = shape_problem(CHAT if api is not None else route, raw_body)
            if problem is not None:
                raise BadRequest(400, problem, "shape")
        except (BadRequest, SurfaceError) as bad:
            self.metrics.rejected.labels(bad.reason).inc()
            param, code = (bad.param, bad.code) if isinstance(bad, SurfaceError) else (None, None)
            if api is not None:
                log.info("%s refused (%d): %s", route, bad.status, bad.message[:300].encode("unicode_escape").decode("ascii"))
                refused = api.error(bad.status, bad.message, param, code)
            else:
                refused = error(bad.status, bad.message, "invalid_request_error")
            if bad.status in (408, 413):
                refused.headers["connection"] = "close"  # the rest of that body is not read: the connection ends
            return refused
        watch.start()  # the body is in: from here on, a disconnect cancels this request (and its upstream exchange)
        body, field_id = sanitize(raw_body)
        header_id = request.headers.get(contracts.SESSION_HEADER) or None
        mode = self.config.session_identity
        session_id = header_id if mode == "header" else field_id if mode == "field" else (header_id or field_id)
        surface_route = route
        if api is not None:
            route = CHAT  # what P and D are sent, whatever the client spoke
        ident = None
        if request.headers.get(contracts.REUSE_HEADER, "").lower() != contracts.SWITCH_OFF:  # benchmark A/B on one fleet
            ident = sessions.identify(route, tenant, body, session_id, mode, surface_route if api is not None else "")
        entry, outcome = await self.reuse.lookup(ident)
        headers = self._upstream_headers(request)
        stream = bool(body.get("stream"))
        last_turn = ident is not None and request.headers.get(contracts.LAST_TURN_HEADER, "").lower() in contracts.LAST_TURN_VALUES
        if last_turn:
            self.metrics.last_turns.inc()  # the client says no turn follows: nothing to store, nothing for D to hold
        hold = self.config.reuse and ident is not None and not last_turn  # else D need not keep this turn's blocks
        forecast = self.returns.turn(body, entry, hold)
        local_allowed = request.headers.get(contracts.PATHS_HEADER, "").lower() != contracts.PATHS_PULL_ONLY  # benchmark A/B
        decision = self.reuse.choose_path(ident, entry, body, outcome, local_allowed)
        if entry is not None and decision.path is TurnPath.DECODE_LOCAL:
            holder = self.decode.member(entry.decode)
            assert holder is not None  # the lookup took the entry only for a known, available D
            tokens = decision.new_tokens or 0
            params = stamp(local_params(entry.params, hold), forecast)
            local = await self.turn.decode_local(route, body, holder, params, headers, stream, tokens)
            if not isinstance(local, NoUpstream):
                self.metrics.child(self.metrics.paths, decision.path.value, decision.reason.value).inc()
                self._count_turn(surface_route, decision.path, outcome)
                return await self._answer(local, route, body, None if last_turn else ident, start, account, api, turn)
            # D failed before its first byte: the turn goes through P and computes (that D's blocks are not trusted).
            self.turn.distrust(entry.params, entry.decode)
            decision = PathDecision(TurnPath.PREFILL_FULL, PathReason.LOCAL_FAILED, decision.new_tokens)
            entry, outcome = None, Reuse.REFUSED
        self.metrics.child(self.metrics.paths, decision.path.value, decision.reason.value).inc()
        salt = uuid.uuid4().hex if request.headers.get(contracts.P_CACHE_HEADER, "").lower() == contracts.SWITCH_OFF else None
        affinity = ident.affinity if ident else None
        prefilled = await self.turn.prefill(
            route, body, entry.params if entry else None, entry.decode if entry else None, affinity, headers, salt
        )
        if isinstance(prefilled, Prefilled):  # P's answer says what reuse this request really got
            said = prefilled.params or {}
            outcome = sessions.settle(outcome, said.get(contracts.PULL_OUTCOME), prefilled.fell_back, said.get(contracts.PULLED_TOKENS))
            if prefilled.other_generation:
                outcome = Reuse.REFUSED
        if not isinstance(prefilled, Prefilled):
            self._count_turn(surface_route, decision.path, outcome)
            if isinstance(prefilled, NoUpstream):
                return api.error(502, prefilled.message) if api is not None else error(502, prefilled.message, "upstream_error")
            return self._upstream_refusal(prefilled.answer, api)
        if last_turn:
            ident = None
        decoded = await self.turn.decode(route, body, stamp(prefilled.params, forecast), headers, stream, hold)
        if isinstance(decoded, NoUpstream):
            # No D of the turn's generation could take it (drained, ejected or failed while P computed; nothing has
            # reached the client): the turn again on a generation that serves, from its prompt.
            rescued = await self.turn.rescue_decode(route, body, affinity, headers, stream, hold, salt)
            if rescued is not None:
                decoded = rescued
                if outcome in (Reuse.HIT, Reuse.PARTIAL):  # what P read is not what answers: computed elsewhere
                    self.metrics.miss(MissCause.OTHER_GENERATION)
                    outcome = Reuse.REFUSED
        self._count_turn(surface_route, decision.path, outcome)
        return await self._answer(decoded, route, body, ident, start, account, api, turn)

    def _count_turn(self, route: str, path: TurnPath, outcome: Reuse) -> None:
        self.metrics.child(self.metrics.reuse, outcome.value).inc()
        api = self.surfaces.get(route)
        label = api.api if api is not None else API_CHAT if route == CHAT else API_COMPLETIONS
        self.metrics.child(self.metrics.api_turns, label, path.value, outcome.value).inc()

    @staticmethod
    def _upstream_refusal(answer: Any, api: Surface | None) -> Response:
        """vLLM's 4xx (the client's request: too long, an unknown model …): as vLLM wrote it, or in the surface's shape."""
        if api is None:
            return _passthrough(answer)
        return api.error(answer.status, upstream_message(answer.content))

    async def _answer(
        self,
        decoded: DecodedWhole | DecodeStream | Passthrough | NoUpstream,
        route: str,
        body: dict[str, Any],
        ident: sessions.Identity | None,
        start: float,
        account: RequestAccount,
        api: Surface | None = None,
        turn: ChatTurn | None = None,
    ) -> Response | SseRelay:
        if isinstance(decoded, NoUpstream):
            return api.error(502, decoded.message) if api is not None else error(502, decoded.message, "upstream_error")
        if isinstance(decoded, Passthrough):
            return self._upstream_refusal(decoded.answer, api)
        if isinstance(decoded, DecodedWhole):
            return await self._whole(decoded, route, body, ident, start, api, turn)
        return self._relay(decoded, body, ident, start, account, api, turn)

    async def _whole(
        self,
        decoded: DecodedWhole,
        route: str,
        body: dict[str, Any],
        ident: sessions.Identity | None,
        start: float,
        api: Surface | None = None,
        turn: ChatTurn | None = None,
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
        if decoded.member.incarnation == decoded.incarnation:  # else a reload moved D: its answer is the old engine's
            await self.reuse.after_decode(ident, body, reply, decoded.member)
        if api is not None and turn is not None:
            data = await api.render(turn, data)
        self.metrics.ttft.observe(time.perf_counter() - start)
        return Response(jsonbytes.dumps(data), status_code=200, media_type="application/json")

    def _relay(
        self,
        decoded: DecodeStream,
        body: dict[str, Any],
        ident: sessions.Identity | None,
        start: float,
        account: RequestAccount,
        api: Surface | None = None,
        turn: ChatTurn | None = None,
    ) -> SseRelay:
        keep = self.config.reuse and ident is not None
        member = decoded.member
        incarnation = decoded.incarnation

        async def on_close(outcome: RelayOutcome) -> None:
            moved = member.incarnation != incarnation  # a reload moved D meanwhile: nothing of this engine is D's now
            if outcome.error is not None and not outcome.error.startswith("client"):
                self.metrics.upstream_errors.labels("decode", member.name, outcome.error).inc()
                if not moved:
                    self.decode.failure(member, outcome.error)
            upstream_failed = outcome.error is not None and not outcome.error.startswith("client")
            status = 200 if outcome.completed else 502 if upstream_failed else 499
            if status == 499 and not account.done:
                # The client went away mid-stream: its write failed ("client …"), or the watcher cancelled the
                # relay (no error). The disconnects before a response started are counted in _serve_completion.
                self.metrics.disconnects.inc()
            account.finish(status)
            if not outcome.completed or moved:
                return
            if keep:
                reply = Reply.of(outcome.kept)
                reply.params = outcome.params
                await self.reuse.after_decode(ident, body, reply, member)
            else:
                self.reuse.observe_decode(member, outcome.params)
                await self.reuse.note_released(member, outcome.params)

        translate = api.translator(turn) if api is not None and turn is not None else None
        return SseRelay(decoded, on_close, lambda: self.metrics.ttft.observe(time.perf_counter() - start), keep, translate)
