"""One P→D turn of vLLM's disaggregated protocol (NixlConnector, pull mode, bidirectional) as requests, and the
synchronous standard-library client that drives P and D directly with them.

The router (bpdkv.router.turn: pools, one retry policy, leases) builds its requests with the same steps; everything
else that talks to P and D directly — calibrate, the EFA probe, the demo, the GPU and e2e tests — uses `TurnClient`.
Standard library, bpdkv.contracts and bpdkv.sse only: the deploy side and the router may both import it.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from bpdkv import contracts
from bpdkv.sse import Reply, sse_events


# ---- the protocol steps --------------------------------------------------------------------------------------------
def prefill_body(body: dict[str, Any], d_params: dict[str, Any] | None, fresh_salt: str | None = None) -> dict[str, Any]:
    """The prefill request: same prompt, one token, no stream, and where to pull history from (if any)."""
    req = dict(body)
    if fresh_salt:
        req["cache_salt"] = fresh_salt
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req["stream"] = False
    req.pop("stream_options", None)
    req["n"] = 1
    # A copy of the top level suffices: the request is serialised at once and nothing edits nested values.
    req[contracts.KV_TRANSFER_PARAMS] = dict(d_params) if d_params else contracts.prefill_template()
    return req


def decode_body(body: dict[str, Any], p_params: dict[str, Any] | None, hold: bool = True) -> dict[str, Any]:
    """The decode request; hold=False tells D (bpdkv plugin) that nobody will offer this turn's KV again."""
    req = dict(body)
    if p_params:
        req[contracts.KV_TRANSFER_PARAMS] = p_params if hold else dict(p_params, **{contracts.HOLD: False})
    return req


def params_of(data: Any) -> dict[str, Any] | None:
    params = data.get(contracts.KV_TRANSFER_PARAMS) if isinstance(data, dict) else None
    return params if isinstance(params, dict) else None


# ---- the client's turn -----------------------------------------------------------------------------------------------
class TurnError(Exception):
    pass


def post_json(url: str, body: dict[str, Any], timeout: float, headers: dict[str, str] | None = None) -> tuple[dict[str, Any], float]:
    """POST JSON, return (JSON answer, seconds). Any failure is a TurnError naming the URL."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json", **(headers or {})})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            data = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise TurnError(f"{url}: HTTP {exc.code}: {exc.read()[:200]!r}") from None
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as exc:
        raise TurnError(f"{url}: {exc}") from None
    return data, time.perf_counter() - start


@dataclass(frozen=True)
class StreamResult:
    reply: Reply
    ttft_s: float  # to the first content (or tool-call) delta
    seconds: float


def stream(url: str, body: dict[str, Any], timeout: float, headers: dict[str, str] | None = None) -> StreamResult:
    """POST a streaming completion and read its events (through the one SSE parser)."""
    request = urllib.request.Request(
        url, data=json.dumps(dict(body, stream=True)).encode(), headers={"content-type": "application/json", **(headers or {})}
    )
    start = time.perf_counter()
    ttft: float | None = None
    reply = Reply()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            for raw in resp:
                for event in sse_events([raw]):
                    reply.add_event(event)
                if ttft is None and (reply.text or reply.tool_calls):
                    ttft = time.perf_counter() - start
    except urllib.error.HTTPError as exc:
        raise TurnError(f"{url}: HTTP {exc.code}: {exc.read()[:200]!r}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise TurnError(f"{url}: {exc}") from None
    total = time.perf_counter() - start
    return StreamResult(reply, ttft if ttft is not None else total, total)


class TurnClient:
    """Drive P and D directly, as the router does (no pools): one turn returns D's reply (with D's params)."""

    def __init__(self, prefill: str, decode: str, timeout: float = 120.0) -> None:
        self.prefill_url = prefill.rstrip("/")
        self.decode_url = decode.rstrip("/")
        self.timeout = timeout

    def prefill(
        self, route: str, body: dict[str, Any], d_params: dict[str, Any] | None, p_extra: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], float]:
        """P's params for D, and P's seconds. p_extra: fields for P only (e.g. cache_salt)."""
        data, seconds = post_json(self.prefill_url + route, dict(prefill_body(body, d_params), **(p_extra or {})), self.timeout)
        params = params_of(data)
        if params is None:
            raise TurnError(f"{self.prefill_url}: no kv_transfer_params in P's answer (is it a kv_producer with bidirectional transfer?)")
        return params, seconds

    def decode(self, route: str, body: dict[str, Any], p_params: dict[str, Any], stream_: bool = False) -> tuple[Reply, dict[str, Any]]:
        """D's reply (params included) and, for a whole answer, its JSON."""
        if stream_:
            return stream(self.decode_url + route, decode_body(body, p_params), self.timeout).reply, {}
        data, _ = post_json(self.decode_url + route, dict(decode_body(body, p_params), stream=False), self.timeout)
        return Reply.of(data), data

    def turn(
        self,
        route: str,
        body: dict[str, Any],
        d_params: dict[str, Any] | None,
        stream_: bool = False,
        p_extra: dict[str, Any] | None = None,
    ) -> Reply:
        p_params, _ = self.prefill(route, body, d_params, p_extra)
        reply, _ = self.decode(route, body, p_params, stream_)
        return reply
