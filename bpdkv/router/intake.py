"""Request intake: reading a client's body (size, time), parsing it strictly, checking what the router relies on, and
sanitising it (client kv_transfer_params and session fields never reach vLLM). Everything a client can get wrong is a
`BadRequest` (4xx, one line) here, before any upstream sees the request.

Strict JSON: the fast parser (orjson) takes standard JSON only; what it refuses is re-read by the standard library only
to say exactly what is wrong — a non-standard number (NaN, Infinity), a number beyond a double (1e400), invalid Unicode
(a lone surrogate escape, with the field's path), nesting past the limit — and always refused. Integers the router itself
packs (token ids) must fit vLLM's int64 and be non-negative; the top-level integer fields must fit int64.

Slow clients: the body must arrive within `client_timeouts.body` seconds (408, connection closed); the header within
`client_timeouts.header` seconds of the connection (or of the previous response), enforced by `http_protocol()` — the
uvicorn httptools protocol with that one timer added (uvicorn itself bounds only the idle keep-alive wait, which any
byte ends: a client sending half a header was held forever).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

import orjson
from starlette.requests import Request

from bpdkv import contracts

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


class ClientGone(Exception):
    pass


class BadRequest(Exception):
    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason


# ---- strict JSON ------------------------------------------------------------------------------------------------
class _NonStandard(ValueError):
    pass


def _constant(name: str) -> Any:
    raise _NonStandard(f"request body has the non-standard number {name} (JSON numbers are finite)")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonStandard(f"request body has the number {text[:40]}, beyond a double's range")
    return value


def _path(parts: list[str | int]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "(body)"


def invalid_unicode_path(value: Any) -> str | None:
    """The path of the first string (or key) holding a lone surrogate, or None (iterative: bounded by the body)."""
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return _path(where)
        elif isinstance(item, dict):
            for k, v in item.items():
                if _SURROGATE.search(k):
                    return _path([*where, k]) + " (key)"
                stack.append((v, [*where, k]))
        elif isinstance(item, list):
            stack.extend((v, [*where, i]) for i, v in enumerate(item))
    return None


def strict_loads(raw: bytes, max_depth: int) -> Any:
    """Standard JSON only; anything else is a BadRequest naming what is wrong."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    # orjson refused it: read it again only to say why (nothing orjson refuses is accepted).
    try:
        value = json.loads(raw, parse_constant=_constant, parse_float=_float)
    except _NonStandard as exc:
        raise BadRequest(400, str(exc), "nonstandard_number") from None
    except RecursionError:
        raise BadRequest(400, f"request body nests deeper than {max_depth} levels", "too_deep") from None
    except ValueError:  # UnicodeDecodeError included: bytes that are not UTF-8
        raise BadRequest(400, "request body is not valid JSON", "invalid_json") from None
    where = invalid_unicode_path(value)
    if where is not None:
        raise BadRequest(400, f"{where}: invalid Unicode (a lone surrogate escape); send UTF-8 text", "invalid_unicode")
    if json_depth_exceeds(value, max_depth):
        raise BadRequest(400, f"request body nests deeper than {max_depth} levels", "too_deep")
    raise BadRequest(400, "request body is not valid JSON", "invalid_json")  # e.g. integers orjson cannot hold


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


async def read_body(request: Request, max_bytes: int, max_depth: int, timeout: float) -> dict[str, Any]:
    """The client's JSON object: within max_bytes (413), within timeout seconds (408), strict JSON (400)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BadRequest(413, f"request body of {declared} bytes is over the router's limit of {max_bytes} bytes", "too_large")
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone()
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > max_bytes:
                    raise BadRequest(413, f"request body is over the router's limit of {max_bytes} bytes", "too_large")
                parts.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise BadRequest(408, f"request body not received within {timeout:g} s", "body_timeout") from None
    raw = b"".join(parts)
    body = strict_loads(raw, max_depth)
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object", "not_object")
    # Nesting needs an opening bracket per level: a body with few of them cannot be too deep (no walk needed).
    if raw.count(b"{") + raw.count(b"[") > max_depth and json_depth_exceeds(body, max_depth):
        raise BadRequest(400, f"request body nests deeper than {max_depth} levels", "too_deep")
    return body


# ---- what the router relies on ----------------------------------------------------------------------------------
def _token_ids(value: Any) -> bool:
    return all(type(t) is int and 0 <= t <= INT64_MAX for t in value)


def shape_problem(route: str, body: dict[str, Any]) -> str | None:
    """What the router itself relies on, checked before any upstream sees the request (one line, or None)."""
    if "stream" in body and not isinstance(body["stream"], bool):
        return "'stream' must be true or false"
    n = body.get("n")
    if n is not None and (type(n) is not int or n < 1):
        return "'n' must be a positive integer"
    for key, value in body.items():
        if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
            return f"'{key}' is out of range (integers must fit in 64 bits)"
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
    tokens_problem = "'prompt' token ids must be integers from 0 to 2^63-1"
    if isinstance(prompt, list) and prompt:
        if all(type(t) is int for t in prompt):
            return None if _token_ids(prompt) else tokens_problem
        if all(isinstance(t, str) for t in prompt):
            return None
        if all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompt):
            return None if all(_token_ids(p) for p in prompt) else tokens_problem
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


# ---- slow headers -----------------------------------------------------------------------------------------------
def http_protocol(header_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a header-read timeout: a connection whose request head is not complete within
    header_timeout seconds of the connection (or of the first byte after a response) gets 408 and is closed."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    response = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
    message = json.dumps(
        {"error": {"message": f"request header not received within {header_timeout:g} s", "type": "invalid_request_error", "code": 408}}
    ).encode()

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._header_expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_expired(self) -> None:
            self._header_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                self._arm()  # a pipelined head behind a response still being written: judged once that one is done
                return
            if not self.transport.is_closing():
                self.transport.write(response % (len(message), message))
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
