"""The router's admin API (rolling deploys): list the upstreams, drain and undrain one, and what config is loaded
(its file's digest, the generations and how many P and D of each serve: router/reload.py). `bpdkv apply` calls it on
the router node itself; with an admin key file only that key opens it, without one only loopback clients."""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Scope

from bpdkv.router import security
from bpdkv.router.upstream_http import UpstreamClient
from bpdkv.router.upstreams import Pool, Upstream, check_member

log = logging.getLogger("bpdkv.router")


def error(status: int, message: str, kind: str = "router_error") -> JSONResponse:
    """The router's error answer. The message may quote what a client sent: whatever UTF-8 cannot encode (a lone
    surrogate) is written as its escape, so that building the answer never fails."""
    if not message.isascii():
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return None


def is_loopback(scope: Scope) -> bool:
    client = scope.get("client")
    if not client:
        return False
    try:
        return ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


class AdminApi:
    def __init__(
        self,
        prefill: Pool,
        decode: Pool,
        admin_key: security.KeyRing | None,
        client: Callable[[], UpstreamClient],
        check_timeout: float,
        clock: Callable[[], float] = time.time,
        loaded: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.prefill, self.decode = prefill, decode
        self.loaded = loaded  # what GET /admin/config answers (the router's: its file, generations, serving counts)
        self.admin_key = admin_key
        self.client = client
        self.check_timeout = check_timeout
        self.clock = clock

    def routes(self) -> list[Route]:
        return [
            Route("/admin/upstreams", self.list, methods=["GET"]),
            Route("/admin/config", self.config, methods=["GET"]),
            Route("/admin/upstreams/{name}/{action}", self.action, methods=["POST"]),
        ]

    def denied(self, request: Request) -> Response | None:
        """With an admin key file: its key only (401 without, 403 wrong). Without one: loopback clients only.
        Client API keys never open admin routes."""
        if self.admin_key:
            presented = bearer(request)
            if presented is None:
                return error(401, "admin key required (Authorization: Bearer)", "authentication_error")
            if self.admin_key.tenant(presented) is None:
                return error(403, "wrong admin key", "permission_error")
            return None
        if not is_loopback(request.scope):
            return error(403, "admin API answers loopback clients only (no admin_key_file configured)", "permission_error")
        return None

    def members(self) -> list[Upstream]:
        return self.prefill.members + self.decode.members

    async def list(self, request: Request) -> Response:
        denied = self.denied(request)
        if denied is not None:
            return denied
        now = time.monotonic()
        answer: dict[str, Any] = {"upstreams": [m.describe(now) for m in self.members()]}
        if self.loaded is not None:
            view = self.loaded()
            answer["config"] = {"digest": view["digest"], "loaded_at": view["loaded_at"]}
        return JSONResponse(answer)

    async def config(self, request: Request) -> Response:
        denied = self.denied(request)
        if denied is not None:
            return denied
        if self.loaded is None:
            return error(404, "this router has no config view", "not_found_error")
        return JSONResponse(self.loaded())

    async def action(self, request: Request) -> Response:
        denied = self.denied(request)
        if denied is not None:
            return denied
        name, action = request.path_params["name"], request.path_params["action"]
        if action not in ("drain", "undrain"):
            return error(404, f"unknown admin action {action!r} (drain, undrain)", "not_found_error")
        member = next((m for m in self.members() if m.name == name), None)
        if member is None:
            return error(404, f"no upstream named {name!r}", "not_found_error")
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
            await check_member(pool, member, self.client(), timeout=self.check_timeout)
        log.info("admin: %s %s (%s %s)", action, name, member.role, member.url)
        return JSONResponse(member.describe(time.monotonic()))
