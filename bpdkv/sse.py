"""Server-sent events of OpenAI-compatible answers: the one SSE parser and the reply a stream (or a whole answer)
describes. Shared by the router (relay, turn), the clients that drive P and D (bpdkv.turn_client, the bench), the
test doubles' recorders and the tests; standard library and bpdkv.contracts only, so any side may import it.

vLLM (and the router) send one JSON object per `data:` line, events separated by a blank line, and end a complete
stream with `data: [DONE]`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from bpdkv import contracts

DONE = "[DONE]"  # the payload of a complete stream's last event
_TEXT = re.compile(rb'"(?:content|text)": ?"([^"\\]*(?:\\.[^"\\]*)*)"')
_FINISH = re.compile(rb'"finish_reason": ?"([^"\\]+)"')


def sse_payloads(raw: bytes | str | Iterable[bytes | str]) -> Iterator[str]:
    """The payloads of `data:` lines as sent ([DONE] included; comments, other fields and empty data skipped), from
    a whole body (bytes or text) or from its lines."""
    lines: Iterable[bytes | str] = raw.split(b"\n") if isinstance(raw, bytes) else raw.split("\n") if isinstance(raw, str) else raw
    for line in lines:
        text = line.decode() if isinstance(line, bytes) else line
        text = text.strip()
        if not text.startswith("data:"):
            continue
        payload = text[5:].strip()
        if payload:
            yield payload


def sse_events(raw: bytes | str | Iterable[bytes | str]) -> Iterator[dict[str, Any]]:
    """The JSON objects of `data:` events; [DONE] and anything that is not a JSON object skipped (the router and the
    load generator read what an upstream sent without failing on it; `read_stream` is the strict reading)."""
    for payload in sse_payloads(raw):
        if payload == DONE:
            continue
        try:
            event = json.loads(payload)
        except ValueError:
            continue
        if isinstance(event, dict):
            yield event


@dataclass(frozen=True)
class SseStream:
    """A whole stream read strictly: its events in order, and whether it ended with [DONE]."""

    events: list[dict[str, Any]]
    done: bool


def read_stream(raw: bytes | str | Iterable[bytes | str]) -> SseStream:
    """A recorded or tested stream: every `data:` payload must be a JSON object or [DONE] (ValueError naming the
    payload otherwise); `done` only when [DONE] is the last event."""
    events: list[dict[str, Any]] = []
    done = False
    for payload in sse_payloads(raw):
        if payload == DONE:
            done = True
            continue
        event = json.loads(payload)
        if not isinstance(event, dict):
            raise ValueError(f"SSE data is not a JSON object: {payload[:80]!r}")
        events.append(event)
        done = False
    return SseStream(events, done)


@dataclass
class Reply:
    """What a stream (or a whole response) said: the assistant message, finish reason and D's params."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    params: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return "".join(self.content)

    def add_event(self, event: dict[str, Any]) -> None:
        params = event.get(contracts.KV_TRANSFER_PARAMS)
        if isinstance(params, dict):
            self.params = params
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            if isinstance(choice.get(contracts.KV_TRANSFER_PARAMS), dict):  # servers that attach it per choice
                self.params = choice[contracts.KV_TRANSFER_PARAMS]
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._add_message(delta, stream=True)
            elif isinstance(choice.get("message"), dict):
                self._add_message(choice["message"], stream=False)
            elif isinstance(choice.get("text"), str):
                self.content.append(choice["text"])

    def _add_message(self, msg: dict[str, Any], stream: bool) -> None:
        if isinstance(msg.get("content"), str):
            self.content.append(msg["content"])
        for key in ("reasoning_content", "reasoning"):
            if isinstance(msg.get(key), str):
                self.reasoning.append(msg[key])
                break
        for i, call in enumerate(msg.get("tool_calls") or ()):
            if not isinstance(call, dict):
                continue
            index = int(call.get("index", i)) if stream else i
            slot = self.tool_calls.setdefault(index, {"id": None, "type": "function", "name": "", "arguments": ""})
            if call.get("id"):
                slot["id"] = call["id"]
            if call.get("type"):
                slot["type"] = call["type"]
            fn = call.get("function") or {}
            if fn.get("name"):
                slot["name"] += fn["name"]
            if isinstance(fn.get("arguments"), str):
                slot["arguments"] += fn["arguments"]

    def message(self) -> dict[str, Any]:
        """The assistant message as a client sends it back next turn."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c["id"], "type": c["type"], "function": {"name": c["name"], "arguments": c["arguments"]}}
                for _, c in sorted(self.tool_calls.items())
            ]
        return msg

    @staticmethod
    def of(raw: bytes | Iterable[bytes | str] | dict[str, Any]) -> Reply:
        reply = Reply()
        if isinstance(raw, dict):
            reply.add_event(raw)
        elif isinstance(raw, bytes):
            reply._add_raw(raw)
        else:
            for event in sse_events(raw):
                reply.add_event(event)
        return reply

    def _add_raw(self, raw: bytes) -> None:
        """Events as D sent them. A plain text stream (no tool calls, no reasoning) gives its text to one regular
        expression scan of the whole buffer and its finish reason to a search from the end; anything else is parsed
        event by event."""
        if b"tool_calls" not in raw and b"reasoning" not in raw:
            pieces = _TEXT.findall(raw)
            joined = b"".join(pieces)
            # Each value is a whole JSON string body, so their concatenation is one: a single decode.
            self.content.append(joined.decode() if b"\\" not in joined else json.loads(b'"' + joined + b'"'))
            self.finish_reason = _last_finish(raw)
            return
        for event in sse_events(raw):
            self.add_event(event)


def _last_finish(raw: bytes) -> str | None:
    at = max(raw.rfind(b'"finish_reason":"'), raw.rfind(b'"finish_reason": "'))
    if at < 0:
        return None
    found = _FINISH.match(raw, at)
    return found.group(1).decode() if found else None
