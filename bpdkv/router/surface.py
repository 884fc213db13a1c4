"""What every client API surface of the router shares: the chat-shaped turn an adapter hands to the one turn pipeline,
the errors an adapter raises, and the stream translator it renders D's answer with.

The router speaks Chat Completions to P and D whatever API the client spoke — as vLLM's own /v1/messages and
/v1/responses do inside one server (they convert to a chat request, render it with the same chat template and
convert the answer back). So the P→D turn, reuse (identity, stored D locations, digests, the fence, decode_local)
and vLLM's kv_transfer_params in streams (the bpdkv plugin's final chat chunk) are written once, and each surface
is a thin adapter (messages.py, responses.py): parse and validate the client's body into a chat body, render D's
chat answer (whole, or its stream event by event) in the client's wire shape, and answer every error in that API's
own error shape.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.responses import JSONResponse

from bpdkv.sse import sse_events

# The metric label of each surface (bpdkv_router_api_turns{api}).
API_CHAT, API_COMPLETIONS, API_MESSAGES, API_RESPONSES = "chat_completions", "completions", "messages", "responses"


class SurfaceError(Exception):
    """A request the surface refuses: status (4xx, or 503 when the router's store is away), a one-line message, the
    metric reason, and the field at fault where there is one."""

    def __init__(self, status: int, message: str, reason: str = "shape", param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.reason, self.param, self.code = status, message, reason, param, code


@dataclass
class ChatTurn:
    """One client request as the turn pipeline runs it: the Chat Completions body for P and D, and what the surface
    needs to render the answer (its own request fields, a chain to store)."""

    body: dict[str, Any]
    stream: bool
    session_id: str | None = None
    context: dict[str, Any] = field(default_factory=dict)


class StreamTranslator(Protocol):
    """D's chat stream → the client's events. feed() gets D's chat chunks (params already taken out) as they come;
    finish() the closing events once D's stream ended normally (it may store what a later request continues from
    before the client can see the end); failed() the event that ends a stream D broke off."""

    def feed(self, chunks: list[dict[str, Any]]) -> bytes: ...

    async def finish(self) -> bytes: ...

    def failed(self, message: str) -> bytes: ...


class Surface(Protocol):
    route: str
    api: str

    def error(self, status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse: ...

    async def parse(self, body: dict[str, Any], headers: dict[str, str], tenant: str) -> ChatTurn: ...

    async def render(self, turn: ChatTurn, answer: dict[str, Any]) -> dict[str, Any]: ...

    def translator(self, turn: ChatTurn) -> StreamTranslator: ...


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """One named server-sent event (`event:` line, then the JSON object on one `data:` line)."""
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def chat_chunks(block: bytes) -> list[dict[str, Any]]:
    """D's chat chunks in a block of whole SSE events ([DONE] and anything not a JSON object left out)."""
    return list(sse_events(block))


def upstream_message(content: bytes) -> str:
    """The message of vLLM's error answer (`{"error": {"message"}}`, or FastAPI's `{"detail"}`), for the client's
    own error shape; the raw text (bounded) when it is neither."""
    try:
        data = json.loads(content)
    except ValueError:
        return content[:500].decode("utf-8", "replace") or "upstream error"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(data.get("message"), str):
            return str(data["message"])
        if data.get("detail") is not None:
            return str(data["detail"])[:500]
    return content[:500].decode("utf-8", "replace")


# ---- small checks every adapter uses (each returns the problem, or raises it) -----------------------------------
def need(ok: bool, message: str, param: str | None = None) -> None:
    if not ok:
        raise SurfaceError(400, message, "shape", param)


def is_int(value: Any) -> bool:
    return type(value) is int


def is_number(value: Any) -> bool:
    return type(value) in (int, float)


def optional(body: dict[str, Any], key: str, check: Callable[[Any], bool], what: str) -> Any:
    """body[key] if present and not null (checked: 400 naming the field and what it must be), else None."""
    value = body.get(key)
    if value is None:
        return None
    need(check(value), f"'{key}' must be {what}", key)
    return value


def vllm_extensions(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """vLLM's own extensions of a request, as both adapters pass them to the chat turn: the prompt's template
    arguments, guided decoding (vLLM's Responses API takes it; its 0.32 /v1/messages ignores it), the cache isolation
    salt; and a streamed answer with its usage."""
    kwargs = optional(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object")
    if kwargs is not None:
        chat["chat_template_kwargs"] = kwargs
    constraint = optional(body, "structured_outputs", lambda v: isinstance(v, dict), "an object")
    if constraint is not None:
        chat["structured_outputs"] = constraint
    salt = optional(body, "cache_salt", lambda v: isinstance(v, str) and bool(v), "a non-empty string")
    if salt is not None:
        chat["cache_salt"] = salt
    if body.get("stream") is True:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}


def strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def text_tool_args(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's tool_use.input holds; vLLM's tool parser writes JSON (an
    object that does not parse is kept whole under `_raw`, so no answer is lost)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"_raw": arguments}


RecordWriter = Callable[[str, dict[str, Any]], Awaitable[None]]
