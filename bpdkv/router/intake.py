"""Request intake: reading a client's body (size, time), parsing it strictly, checking what the router relies on, and
sanitising it (client kv_transfer_params and session fields never reach vLLM). Everything a client can get wrong is a
`BadRequest` (4xx, one line) here, before any upstream sees the request.

Strict JSON: the fast parser (orjson) takes standard JSON only; what it refuses is re-read by the standard library only
to say exactly what is wrong — a non-standard number (NaN, Infinity), a number beyond a double (1e400), invalid Unicode
(a lone surrogate escape in a value or a key, at any depth, with its path), nesting past the limit — and always refused.
orjson reads an integer beyond 64 bits as a float (-9223372036854775809 → -9.223372036854776e+18): a body with a run of
19 digits or more (the only way to write one) is read by the standard library instead, so every integer is the exact
one the client sent — the range checks below judge it, and what the router forwards is what was sent. An integer of
more than 40 digits is refused at any depth (with its path) without being converted. The integer fields vLLM reads
(`INT_FIELDS`, top-level integers in general) must fit int64, `n` must be positive, and token ids (`prompt`,
`stop_token_ids`, `allowed_token_ids`) must be from 0 to 2^63-1: else 400 naming the field.

Slow clients: the body must arrive within `client_timeouts.body` seconds (408, connection closed); the header within
`client_timeouts.header` seconds of the connection (or of the previous response), enforced by `http_protocol()` — the
uvicorn httptools protocol with that one timer added (uvicorn itself bounds only the idle keep-alive wait, which any
byte ends: a client sending half a header was held forever). The same protocol bounds the request head's size
(`max_header_bytes`): a larger head gets 431 and the connection is closed, having held at most the limit plus one read
of it (httptools itself buffers a header of any size). It also refuses what RFC 9112 refuses in a head — HTTP/0.9's
simple request line, a version other than 1.0/1.1, an HTTP/1.1 request without Host — with one log line each
(docs/router.md, "HTTP versions").
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from typing import Any

import orjson
from starlette.requests import Request

from bpdkv import contracts

log = logging.getLogger("bpdkv.router")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_SURROGATE = re.compile("[\ud800-\udfff]")
# The integer fields vLLM reads from a request (its protocol's ints: the seed is an int64 by declaration, the others
# end in int64 tensors or Python ints compared against lengths); vLLM itself judges their meaning (max_tokens ≥ 1 …).
INT_FIELDS = frozenset(
    {
        "seed",
        "n",
        "best_of",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "top_k",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "priority",
        "truncate_prompt_tokens",
    }
)
TOKEN_ID_LISTS = ("stop_token_ids", "allowed_token_ids")  # besides `prompt`
MAX_INT_DIGITS = 40  # longer integer literals are refused without being converted (int() of thousands of digits costs)
PATH_PART_MAX = 40  # characters of one key shown in a path
# A bytes → bytes table that keeps digits and turns everything else into a space: a 19-digit run is then a substring.
# orjson is exact on integers from -2^63 to 2^64-1; beyond, it returns a float. Any integer it cannot hold is written with
# at least 19 digits (-9223372036854775809): a body without a run of 19 digits (in a number or not) needs no second look.
_DIGITS_ONLY = bytes(0x30 if 0x30 <= c <= 0x39 else 0x20 for c in range(256))
_LONG_RUN = b"0" * 19


class ClientGone(Exception):
    pass


class BadRequest(Exception):
    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason


# ---- strict JSON ------------------------------------------------------------------------------------------------
class _NonStandard(ValueError):
    pass


class _HugeInt:
    """An integer literal of more than MAX_INT_DIGITS digits, kept unconverted until its path is reported."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _constant(name: str) -> Any:
    raise _NonStandard(f"request body has the non-standard number {name} (JSON numbers are finite)")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonStandard(f"request body has the number {text[:40]}, beyond a double's range")
    return value


def _int(text: str) -> int | _HugeInt:
    return int(text) if len(text) <= MAX_INT_DIGITS else _HugeInt(len(text.lstrip("-")))


def _shown(part: str) -> str:
    """One key as a path shows it: ASCII-safe (a lone surrogate as its escape), at most PATH_PART_MAX characters."""
    if len(part) > PATH_PART_MAX:
        part = part[:PATH_PART_MAX] + f"...({len(part)} characters)"
    if part.isascii() and part.isprintable():
        return part
    return part.encode("ascii", "backslashreplace").decode("ascii")


def _path(parts: list[str | int]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{_shown(part)}" if out else _shown(part))
    return out or "(body)"


def bad_value(value: Any) -> str | None:
    """What is wrong with the first bad string, key or integer of a parsed body, with its path; None if nothing
    (iterative: bounded by the body, not the stack)."""
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return f"{_path(where)}: invalid Unicode (a lone surrogate escape); send UTF-8 text"
        elif isinstance(item, dict):
            for k, v in item.items():
                if _SURROGATE.search(k):
                    return f"{_path([*where, k])} (a key): invalid Unicode (a lone surrogate escape); send UTF-8 text"
                stack.append((v, [*where, k]))
        elif isinstance(item, list):
            stack.extend((v, [*where, i]) for i, v in enumerate(item))
        elif isinstance(item, _HugeInt):
            return f"{_path(where)}: an integer of {item.digits} digits is out of range (integers must fit in 64 bits)"
    return None


def invalid_unicode_path(value: Any) -> str | None:
    """The path of the first string (or key) holding a lone surrogate, or None."""
    problem = bad_value(value)
    return None if problem is None or "invalid Unicode" not in problem else problem.split(": invalid Unicode")[0]


def _exact_loads(raw: bytes) -> Any:
    """The standard library's reading of a body: integers exact, non-standard numbers refused."""
    return json.loads(raw, parse_constant=_constant, parse_float=_float, parse_int=_int)


def strict_loads(raw: bytes, max_depth: int) -> Any:
    """Standard JSON only, every integer exact; anything else is a BadRequest naming what is wrong."""
    accepted = False
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass  # orjson refused it: read it again below only to say why (nothing orjson refuses is accepted)
    else:
        if _LONG_RUN not in raw.translate(_DIGITS_ONLY):
            return value  # no integer beyond orjson's exact range can be in it: the fast path
        accepted = True
    try:
        value = _exact_loads(raw)
    except _NonStandard as exc:
        raise BadRequest(400, str(exc), "nonstandard_number") from None
    except RecursionError:
        raise BadRequest(400, f"request body nests deeper than {max_depth} levels", "too_deep") from None
    except ValueError:  # UnicodeDecodeError included: bytes that are not UTF-8
        raise BadRequest(400, "request body is not valid JSON", "invalid_json") from None
    problem = bad_value(value)
    if problem is not None:
        reason = "invalid_unicode" if "invalid Unicode" in problem else "out_of_range"
        raise BadRequest(400, problem, reason)
    if json_depth_exceeds(value, max_depth):
        raise BadRequest(400, f"request body nests deeper than {max_depth} levels", "too_deep")
    if accepted:
        return value
    raise BadRequest(400, "request body is not valid JSON", "invalid_json")


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
        # Exact integers (strict_loads): the value checked is the one the client sent. A float where vLLM reads an
        # integer is vLLM's to judge, unless no 64-bit integer could be it.
        if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
            return f"'{_path([key])}' is out of range (integers must fit in 64 bits)"
        if type(value) is float and key in INT_FIELDS and not INT64_MIN <= value <= INT64_MAX:
            return f"'{key}' is out of range (integers must fit in 64 bits)"
    for key in TOKEN_ID_LISTS:
        ids = body.get(key)
        if isinstance(ids, list) and not all(0 <= t <= INT64_MAX for t in ids if type(t) is int):
            return f"'{key}' token ids must be integers from 0 to 2^63-1"
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


# ---- slow, large and non-HTTP/1.x heads ------------------------------------------------------------------------
HEAD_LINGER_S = 1.0  # after a refused head: how long the rest of it is read and dropped before the connection closes
SPOKEN = ("1.0", "1.1")  # the HTTP versions the router speaks (docs/router.md, "HTTP versions")
_VERSION = re.compile(rb"HTTP/([0-9])\.([0-9])")
BAD_REQUEST, VERSION_NOT_SUPPORTED = "400 Bad Request", "505 HTTP Version Not Supported"


def request_line_problem(line: bytes) -> tuple[str, str] | None:
    """What is wrong with a request line's HTTP version, as (status, message); None if nothing the router judges.

    No version at all (`GET /`) is HTTP/0.9's simple request: 400 (its answer would be a bare body, which no client
    of the router expects). A major version other than 1 (`HTTP/2.0`, `HTTP/0.9`, `HTTP/3.0`): 505, the status for a
    major version the server does not speak (RFC 9110 §15.6.6). `HTTP/1.2` and up: 400, as httptools' parser says (no
    such version exists). Another protocol's name (`RTSP/1.0`, which that parser reads as HTTP/1.0): 400. Any other
    malformed line is left to that parser (400)."""
    parts = line.removesuffix(b"\r").split(b" ")
    if len(parts) == 2:
        return BAD_REQUEST, "HTTP/0.9 requests are not served (a request line needs a version: HTTP/1.1 or HTTP/1.0)"
    if len(parts) != 3:
        return None
    if parts[2][:5] != b"HTTP/" and b"/" in parts[2]:
        name = parts[2].split(b"/")[0][:20].decode("ascii", "backslashreplace")
        return BAD_REQUEST, f"{name} is not HTTP: the router speaks HTTP/1.1 and HTTP/1.0"
    match = _VERSION.fullmatch(parts[2])
    if match is None:
        return None
    major, minor = match.groups()
    if major != b"1":
        return VERSION_NOT_SUPPORTED, f"HTTP/{major.decode()}.{minor.decode()} is not supported: the router speaks HTTP/1.1 and HTTP/1.0"
    if minor not in (b"0", b"1"):
        return BAD_REQUEST, f"HTTP/1.{minor.decode()} is not an HTTP version: the router speaks HTTP/1.1 and HTTP/1.0"
    return None


def head_problem(version: str, headers: list[tuple[bytes, bytes]]) -> tuple[str, str] | None:
    """What RFC 9112 refuses in a parsed head (version, lowercased header names), as (status, message); or None.

    A version other than 1.0/1.1 reaching here came in a pipelined head, after another request in the same read (the
    first line of a head at the start of a read is judged by request_line_problem): httptools reports a simple request
    as 0.9. Host (§3.2): an HTTP/1.1 request without one, or any request with more than one, gets 400."""
    if version not in SPOKEN:
        if version.startswith("1.") or version == "0.9":
            return BAD_REQUEST, f"HTTP/{version} requests are not served: the router speaks HTTP/1.1 and HTTP/1.0"
        return VERSION_NOT_SUPPORTED, f"HTTP/{version} is not supported: the router speaks HTTP/1.1 and HTTP/1.0"
    hosts = sum(1 for name, _ in headers if name == b"host")
    if hosts == 0 and version == "1.1":
        return BAD_REQUEST, "an HTTP/1.1 request needs a Host header (RFC 9112 §3.2)"
    if hosts > 1:
        return BAD_REQUEST, f"a request has one Host header, not {hosts} (RFC 9112 §3.2)"
    return None


def _refusal(status: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": int(status[:3])}}).encode()
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


class _AfterRefusal:
    """httptools' parser, quiet once its protocol refused a head: the parser goes on with the rest of the read in which
    a head was refused (from its callback), and may fail on it — uvicorn would log that and write a second answer to a
    connection already answered and half closed."""

    __slots__ = ("parser", "protocol")

    def __init__(self, parser: Any, protocol: Any) -> None:
        self.parser, self.protocol = parser, protocol

    def feed_data(self, data: bytes) -> None:
        import httptools

        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if not self.protocol._refused:
                raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)


def http_protocol(header_timeout: float, max_header_bytes: int = contracts.ROUTER_DEFAULTS["max_header_bytes"]) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a header-read timeout, a head size limit and RFC 9112's version and Host rules.

    Timeout: a connection whose request head is not complete within header_timeout seconds of the connection (or of the
    first byte after a response) gets 408 and is closed.

    Size: httptools buffers a header line of any length before uvicorn sees it, so the head is measured here, by the
    reads that carry it: a head still incomplete after more than max_header_bytes, or complete and larger (the request
    line and header lines as parsed), gets 431 and the connection is closed — at most the limit plus one read held.
    The refusal goes out with a half close, then what the client still sends is read and dropped for up to
    HEAD_LINGER_S (closing with unread bytes would reset the connection, and the client could lose the 431).

    Versions and Host: a request line without a version (HTTP/0.9) is refused (400) as soon as its line ends — httptools
    would wait for headers a 0.9 client never sends; a version other than 1.0/1.1 (505 or 400) or a missing or doubled
    Host (400) once the head is parsed (request_line_problem, head_problem). The same half close and linger; one log
    line each."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    timed_out = _refusal("408 Request Timeout", f"request header not received within {header_timeout:g} s")
    too_large = _refusal("431 Request Header Fields Too Large", f"request header is over the router's limit of {max_header_bytes} bytes")

    class HeaderLimitsProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _head_open = True  # the current (or next) request head is not complete yet
        _head_seen = 0  # bytes read while it was incomplete, the read that completes it excepted
        _read = 0  # length of the read being parsed
        _restarted = False  # a message ended within the read being parsed (the next head began inside it)
        _refused = False
        _line: bytes | None = b""  # the current head's request line so far, while it is not judged yet (None: judged)
        _begun = False  # a message began and has not completed

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
                self.transport.write(timed_out)
                self.transport.close()

        def _refuse_head(self, response: bytes = too_large) -> None:
            self._refused = True
            self._disarm()
            transport = self.transport
            if transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                transport.close()  # a pipelined head behind a response being written: no room for a refusal
                return
            transport.write(response)
            if transport.can_write_eof():
                transport.write_eof()
                self.loop.call_later(HEAD_LINGER_S, transport.close)
            else:
                transport.close()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.parser = _AfterRefusal(self.parser, self)  # type: ignore[assignment]  # a stand-in for it

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def _refuse_version(self, problem: tuple[str, str]) -> None:
            status, message = problem
            peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            log.warning("request from %s refused (%s): %s", peer, status[:3], message)
            self._refuse_head(_refusal(status, message))

        def _judge_line(self, data: bytes) -> tuple[str, str] | None:
            """The request line's problem once it is complete (empty lines before it skipped, RFC 9112 §2.2)."""
            line = (self._line or b"") + data
            line = line.lstrip(b"\r\n")
            end = line.find(b"\n")
            if end < 0:
                self._line = line if len(line) <= max_header_bytes else None  # a longer line gets 431 anyway
                return None
            self._line = None
            return request_line_problem(line[:end])

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # the rest of a refused head: dropped until the linger ends
            if self._line is not None:
                problem = self._judge_line(data)
                if problem is not None:
                    self._refuse_version(problem)
                    return
            self._read, self._restarted = len(data), False
            super().data_received(data)
            if self._restarted and not self._begun and not self._refused:
                self._line = b""  # the read ended with a message: the next one's head starts the next read
            if self._head_open and not self._refused:
                if not self._restarted:  # a read that ended a message and began the next head is not counted
                    self._head_seen += len(data)
                if self._head_seen > max_header_bytes:
                    self._refuse_head()

        def on_message_begin(self) -> None:
            if self._refused:
                return
            self._begun = True
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            if self._refused:
                return
            self._disarm()
            seen, self._head_open, self._head_seen = self._head_seen + self._read, False, 0
            if seen > max_header_bytes:  # the reads could hold a head over the limit: measure the parsed one
                size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
                if size > max_header_bytes:
                    self._refuse_head()
                    return
            problem = head_problem(self.parser.get_http_version(), self.headers)
            if problem is not None:
                self._refuse_version(problem)
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:  # a refused head's body has no request cycle to go to (on_url/on_header are harmless)
                super().on_body(body)

        def on_message_complete(self) -> None:
            self._head_open, self._restarted, self._begun, self._line = True, True, False, None
            if not self._refused:
                super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderLimitsProtocol
