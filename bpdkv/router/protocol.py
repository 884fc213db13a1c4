"""kv_transfer_params in and out (vLLM NixlConnector, pull mode, bidirectional), and request sanitising."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any

from bpdkv import contracts as c
from bpdkv.contracts import P_CACHE_HEADER, REUSE_HEADER, SESSION_FIELDS, SESSION_HEADER

__all__ = ["P_CACHE_HEADER", "P_TEMPLATE", "REUSE_HEADER", "SESSION_FIELDS", "SESSION_HEADER"]

P_TEMPLATE: dict[str, Any] = c.prefill_template()  # turn 1 → P: prefill and keep the blocks for a remote decode


def p_request(body: dict[str, Any], d_params: dict[str, Any] | None, fresh_salt: str | None = None) -> dict[str, Any]:
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
    req[c.KV_TRANSFER_PARAMS] = copy.deepcopy(d_params) if d_params else c.prefill_template()
    return req


def d_request(body: dict[str, Any], p_params: dict[str, Any] | None) -> dict[str, Any]:
    req = dict(body)
    if p_params:
        req["kv_transfer_params"] = p_params
    return req


def sanitize(body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """Drop client-supplied kv_transfer_params (a client must never steer NIXL) and explicit session fields."""
    clean = dict(body)
    clean.pop("kv_transfer_params", None)
    session = None
    for key in SESSION_FIELDS:
        value = clean.pop(key, None)
        if session is None and isinstance(value, (str, int)) and str(value):
            session = str(value)
    return clean, session


def usable_d_params(params: Any) -> bool:
    """D's returned params are reusable only if they point at blocks P can pull."""
    return (
        isinstance(params, dict)
        and params.get(c.DO_REMOTE_DECODE) is True
        and bool(params.get(c.REMOTE_BLOCK_IDS))
        and params.get(c.REMOTE_ENGINE_ID) is not None
    )


# Fast path for the common SSE event (one choice, a text delta, not the last one): pull the text out without
# parsing the whole event. Anything unusual (params, finish, tool calls, escapes we can't take) takes the full path.
_TEXT_RE = re.compile(rb'"(?:content|text)":"((?:[^"\\]|\\.)*)"')
_PLAIN_NULL_FINISH = (b'"finish_reason":null', b'"finish_reason": null')


@dataclass
class StreamCapture:
    """What the router learns from D's SSE stream while passing it through."""

    params: dict[str, Any] | None = None
    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    first_byte: bool = False
    buffer: bytes = b""

    def feed(self, chunk: bytes, chat: bool) -> bytes:
        """Consume raw bytes; return the bytes to send to the client (kv_transfer_params removed)."""
        self.buffer += chunk
        out = []
        while True:
            cut = self.buffer.find(b"\n\n")
            if cut < 0:
                break
            event, self.buffer = self.buffer[: cut + 2], self.buffer[cut + 2 :]
            out.append(self._event(event, chat))
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self.buffer = self.buffer, b""
        return rest

    def _event(self, event: bytes, chat: bool) -> bytes:
        if not event.startswith(b"data: ") or event.startswith(b"data: [DONE]"):
            return event
        if (
            b"kv_transfer_params" not in event
            and b"tool_calls" not in event
            and (_PLAIN_NULL_FINISH[0] in event or _PLAIN_NULL_FINISH[1] in event)
            and event.count(b'"index"') == 1
        ):
            match = _TEXT_RE.search(event)
            if match is not None:
                piece = match.group(1)
                self.text.append(piece.decode() if b"\\" not in piece else json.loads(b'"' + piece + b'"'))
                return event
            if b'"content"' not in event and b'"text"' not in event:
                return event
        try:
            data = json.loads(event[6:])
        except ValueError:
            return event
        if not isinstance(data, dict):
            return event
        changed = False
        if "kv_transfer_params" in data:
            params = data.pop("kv_transfer_params")
            if isinstance(params, dict):
                self.params = params
            changed = True
        for choice in data.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            if "kv_transfer_params" in choice:  # tolerate servers that attach it per choice
                params = choice.pop("kv_transfer_params")
                if isinstance(params, dict):
                    self.params = params
                changed = True
            if chat:
                delta = choice.get("delta") or {}
                if isinstance(delta.get("content"), str):
                    self.text.append(delta["content"])
                for call in delta.get("tool_calls") or ():
                    self._tool_delta(call)
            elif isinstance(choice.get("text"), str):
                self.text.append(choice["text"])
        if not changed:
            return event
        if not data.get("choices") and set(data) - {"choices"} <= {"id", "object", "created", "model"}:
            return b""  # a chunk that only carried the params: the client never sees it
        return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

    def _tool_delta(self, call: dict[str, Any]) -> None:
        index = int(call.get("index", 0))
        slot = self.tool_calls.setdefault(index, {"id": None, "name": "", "arguments": ""})
        if call.get("id"):
            slot["id"] = call["id"]
        fn = call.get("function") or {}
        if fn.get("name"):
            slot["name"] += fn["name"]
        if fn.get("arguments"):
            slot["arguments"] += fn["arguments"]

    def assistant_message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.text)}
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for _, c in sorted(self.tool_calls.items())
            ]
        return msg


def assistant_from_body(body: dict[str, Any], chat: bool) -> tuple[dict[str, Any] | None, str | None]:
    """The assistant reply and finish reason of a non-stream response (first choice)."""
    choices = body.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return None, None
    choice = choices[0]
    if chat:
        message = choice.get("message") or {}
        reply = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            reply["tool_calls"] = message["tool_calls"]
        return reply, choice.get("finish_reason")
    return {"role": "assistant", "content": choice.get("text") or ""}, choice.get("finish_reason")
