"""The OpenAI Responses surface (`POST /v1/responses`, `GET /v1/responses/{id}`): parse and validate → a chat turn →
the one turn pipeline → the answer rendered as a Response object (or its event stream).

Input becomes chat messages as vLLM's own /v1/responses makes them (vllm/entrypoints/openai/responses/utils.py):
`instructions` as the system message; a string input as one user message; message items as messages (text parts
joined by newlines); function_call items as tool calls of the assistant message before them (or of a new one);
function_call_output items as `tool` messages; reasoning items as the assistant's `reasoning`. Function tools become
chat tools, max_output_tokens max_tokens. D's chat answer becomes the output items vLLM makes: a reasoning item, a
message with one output_text, one function_call per tool call (call_id = the tool call's id).

`previous_response_id`: vLLM keeps stored responses in the memory of the server that made them, which a P/D fleet
cannot honour (P and D are different servers, and a fleet has many). The router keeps the chain itself, in its
session store — Redis when configured, so any worker, replica or a restarted router continues it: a stored response
(`store`, true by default) is kept with the conversation it ends (its input after the instructions, then its output
as an assistant message), and a request naming it gets that conversation before its own input — the instructions of
earlier responses do not carry over, as OpenAI specifies. Unlike vLLM (whose chain drops earlier function_call
items), a chained request gets exactly the prompt a stateless client sending the whole input would. An unknown or
expired id (or another tenant's) is a 400 in OpenAI's shape, code `previous_response_not_found`.

Stricter than vLLM (which answers 200 to a function_call_output naming no call): every function_call_output must
name a function_call earlier in the conversation; item types, roles and field types are checked. Every refusal is
OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse

from bpdkv.router import sessions
from bpdkv.router.surface import (
    API_RESPONSES,
    ChatTurn,
    SurfaceError,
    is_int,
    is_number,
    need,
    optional,
    sse_event,
    vllm_extensions,
)

ROUTE = "/v1/responses"
RESPONSE_TTL_S = 24 * 3600.0  # how long a stored response can be continued (previous_response_id) or read back
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
UNSUPPORTED = {
    "background": "background responses are not supported by this server",
    "conversation": "'conversation' is not supported by this server; use previous_response_id or send the whole input",
    "prompt": "prompt templates ('prompt') are not supported by this server",
}


class ResponsesSurface:
    route = ROUTE
    api = API_RESPONSES

    def __init__(self, store: Callable[[], sessions.SessionStore], clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self.clock = clock

    def error(self, status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
        if not message.isascii():
            message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        kind = "invalid_request_error" if status < 500 else "server_error"
        if status == 401:
            kind = "authentication_error"
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)

    @staticmethod
    def record_prefix(tenant: str) -> str:
        """Where a tenant's responses are kept: its hash (also the Redis Cluster hash tag: a chain is in one slot)."""
        return "resp:{" + hashlib.blake2b(tenant.encode(), digest_size=12).hexdigest() + "}:"

    async def parse(self, body: dict[str, Any], headers: dict[str, str], tenant: str) -> ChatTurn:
        chat, history, context = to_chat(body)
        previous = body.get("previous_response_id")
        earlier: list[dict[str, Any]] = []
        if previous is not None:
            need(isinstance(previous, str) and bool(previous), "'previous_response_id' must be a non-empty string", "previous_response_id")
            chain = await self._chain(tenant, previous)
            if chain is None:
                raise SurfaceError(
                    400,
                    f"Previous response with id '{previous}' not found.",
                    "previous_response_not_found",
                    "previous_response_id",
                    "previous_response_not_found",
                )
            for record in reversed(chain):
                earlier += record["messages"]
        _check_calls(earlier + history)
        system = [{"role": "system", "content": context["instructions"]}] if context.get("instructions") else []
        chat["messages"] = system + earlier + history
        need(bool(chat["messages"]), "'input' must not be empty", "input")
        context.update(tenant=tenant, own=history, previous_response_id=previous)
        return ChatTurn(chat, body.get("stream") is True, None, context)

    async def _chain(self, tenant: str, response_id: str) -> list[dict[str, Any]] | None:
        """The stored records of a chain ending in response_id, newest first; None when any of it is gone."""
        try:
            values, complete = await self._store().get_chain(self.record_prefix(tenant), response_id, RESPONSE_TTL_S)
        except sessions.StoreUnavailable:
            raise SurfaceError(
                503, "the router's response store is unavailable; send the whole input instead", "store_unavailable"
            ) from None
        if not complete or not values:
            return None
        records = []
        for value in values:
            try:
                record = json.loads(value)
            except ValueError:
                return None
            if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
                return None
            records.append(record)
        return records

    async def stored(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        """GET /v1/responses/{id}: the response as it was answered (a stored one, of this tenant)."""
        try:
            raw = await self._store().get_record(self.record_prefix(tenant) + response_id)
        except sessions.StoreUnavailable:
            raise SurfaceError(503, "the router's response store is unavailable", "store_unavailable") from None
        try:
            record = json.loads(raw) if raw is not None else None
        except ValueError:
            return None
        response = record.get("response") if isinstance(record, dict) else None
        return response if isinstance(response, dict) else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        """DELETE /v1/responses/{id}: whether this tenant's stored response was there. A chain through it ends there."""
        try:
            return await self._store().delete_record(self.record_prefix(tenant) + response_id)
        except sessions.StoreUnavailable:
            raise SurfaceError(503, "the router's response store is unavailable", "store_unavailable") from None

    async def _keep(self, turn: ChatTurn, response: dict[str, Any]) -> None:
        """A stored response, for previous_response_id (before the client sees it): its parent's id and the messages it
        adds to the conversation (its own input after the instructions, its output as an assistant message) — a chain
        is its records' messages in order, so each turn stores only what it adds."""
        if not turn.context.get("store", True):
            return
        messages = list(turn.context["own"]) + items_to_messages(response["output"], [])
        record = {"parent": turn.context.get("previous_response_id"), "messages": messages, "response": response}
        try:
            await self._store().put_record(
                self.record_prefix(turn.context["tenant"]) + response["id"], json.dumps(record, ensure_ascii=False).encode(), RESPONSE_TTL_S
            )
        except sessions.StoreUnavailable:
            pass  # answered anyway; continuing from this id will say it is not found (the client may send the input)

    async def render(self, turn: ChatTurn, answer: dict[str, Any]) -> dict[str, Any]:
        choices: Any = answer.get("choices") if isinstance(answer.get("choices"), list) else []
        choice: Any = choices[0] if choices and isinstance(choices[0], dict) else {}
        message: Any = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        output = output_items(message)
        response = response_object(turn, self.clock(), output, choice.get("finish_reason"), answer.get("usage"))
        await self._keep(turn, response)
        return response

    def translator(self, turn: ChatTurn) -> ResponseStream:
        return ResponseStream(self, turn)


# ---- request → chat ----------------------------------------------------------------------------------------------------
def _text_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message item's content as a chat message's: a string, text parts joined by newlines (as vLLM's string
    content format does), or parts with images."""
    if isinstance(content, str):
        return content
    need(isinstance(content, list), f"{where}.content must be a string or an array of content parts", "input")
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        need(isinstance(part, dict) and isinstance(part.get("type"), str), f"{at} must be a content part with a 'type'", "input")
        kind = part["type"]
        if kind in TEXT_PARTS:
            need(isinstance(part.get("text"), str), f"{at}.text must be a string", "input")
            texts.append(part["text"])
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            url = part.get("image_url")
            need(isinstance(url, str) and bool(url), f"{at}.image_url must be a URL string (file ids are not supported)", "input")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "refusal":
            need(isinstance(part.get("refusal"), str), f"{at}.refusal must be a string", "input")
            texts.append(part["refusal"])
            parts.append({"type": "text", "text": part["refusal"]})
        else:
            raise SurfaceError(400, f"{at}: content part type '{kind}' is not supported by this server", "shape", "input")
    if len(parts) == len(texts):
        return "\n".join(texts)
    return parts


def items_to_messages(items: list[Any], out: list[dict[str, Any]], where: str = "input") -> list[dict[str, Any]]:
    """Responses items (input, or a response's output) → chat messages, appended to out."""
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        need(isinstance(item, dict), f"{at} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        prev = out[-1] if out and out[-1].get("role") == "assistant" else None
        if kind == "message":
            role = item.get("role")
            need(role in MESSAGE_ROLES, f"{at}.role must be one of {', '.join(MESSAGE_ROLES)}", "input")
            content = _text_of(item.get("content"), at)
            if role == "assistant":
                text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
                if prev is not None and prev.get("content") is None:
                    prev["content"] = text
                else:
                    out.append({"role": "assistant", "content": text})
            else:
                out.append({"role": role, "content": content})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            need(isinstance(call_id, str) and bool(call_id), f"{at}.call_id must be a non-empty string", "input")
            need(isinstance(name, str) and bool(name), f"{at}.name must be a non-empty string", "input")
            need(isinstance(arguments, str), f"{at}.arguments must be a string (JSON)", "input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if prev is not None:
                prev.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            need(isinstance(call_id, str) and bool(call_id), f"{at}.call_id must be a non-empty string", "input")
            if isinstance(output, list):
                output = _text_of(output, at)
                need(isinstance(output, str), f"{at}.output must be a string or text parts", "input")
            need(isinstance(output, str), f"{at}.output must be a string", "input")
            out.append({"role": "tool", "content": output, "tool_call_id": call_id})
        elif kind == "reasoning":
            need(not item.get("encrypted_content"), f"{at}: encrypted reasoning is not supported by this server", "input")
            texts = [p.get("text") for p in item.get("content") or () if isinstance(p, dict)]
            summary = [p.get("text") for p in item.get("summary") or () if isinstance(p, dict)]
            need(all(isinstance(t, str) for t in texts + summary), f"{at}: reasoning content and summary hold text parts", "input")
            reasoning = str((texts or summary or [""])[0])
            if prev is not None and prev.get("reasoning") is None:
                prev["reasoning"] = reasoning
            else:
                out.append({"role": "assistant", "reasoning": reasoning})
        else:
            raise SurfaceError(400, f"{at}: input item type '{kind}' is not supported by this server", "shape", "input")
    return out


def _check_calls(messages: list[dict[str, Any]]) -> None:
    """Every tool result names a tool call made earlier in the conversation (vLLM does not check; a model fed an
    orphaned result answers nonsense)."""
    calls: set[str] = set()
    for msg in messages:
        for call in msg.get("tool_calls") or ():
            calls.add(call["id"])
        if msg.get("role") == "tool":
            need(
                msg["tool_call_id"] in calls,
                f"No tool call found for function call output with call_id {msg['tool_call_id']}.",
                "input",
            )


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    need(isinstance(tools, list), "'tools' must be an array of tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        need(isinstance(tool, dict), f"tools[{i}] must be an object", "tools")
        kind = tool.get("type")
        need(kind == "function", f"tools[{i}]: tool type '{kind}' is not supported by this server (function tools only)", "tools")
        name = tool.get("name")
        need(isinstance(name, str) and 0 < len(name) <= 128, f"tools[{i}].name must be a string of 1 to 128 characters", "tools")
        params = tool.get("parameters")
        need(params is None or isinstance(params, dict), f"tools[{i}].parameters must be a JSON Schema object", "tools")
        need(
            tool.get("description") is None or isinstance(tool.get("description"), str), f"tools[{i}].description must be a string", "tools"
        )
        function: dict[str, Any] = {"name": name, "description": tool.get("description"), "parameters": params}
        if tool.get("strict") is not None:
            need(isinstance(tool["strict"], bool), f"tools[{i}].strict must be a boolean", "tools")
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def to_chat(body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """(the chat body without its messages, this request's own conversation, what rendering needs)."""
    for key, message in UNSUPPORTED.items():
        need(body.get(key) in (None, False), message, key)
    model: Any = body.get("model")
    need(isinstance(model, str) and bool(model), "'model' must be a non-empty string", "model")
    need(body.get("stream") is None or isinstance(body.get("stream"), bool), "'stream' must be true or false", "stream")
    need(body.get("store") is None or isinstance(body.get("store"), bool), "'store' must be true or false", "store")
    instructions = optional(body, "instructions", lambda v: isinstance(v, str), "a string")
    raw: Any = body.get("input")
    need(isinstance(raw, (str, list)), "'input' must be a string or an array of input items", "input")
    history = [{"role": "user", "content": raw}] if isinstance(raw, str) else items_to_messages(raw, [])
    chat: dict[str, Any] = {"model": model}
    max_out = optional(body, "max_output_tokens", lambda v: is_int(v) and v >= 1, "an integer of at least 1")
    if max_out is not None:
        chat["max_tokens"] = max_out
    for key in ("temperature", "top_p"):
        value = optional(body, key, lambda v: is_number(v) and v >= 0, "a number of at least 0")
        if value is not None:
            chat[key] = value
    tools = _tools(body)
    names = {t["function"]["name"] for t in tools or []}
    choice: Any = body.get("tool_choice")
    if tools:
        chat["tools"] = tools
    if choice is not None:
        if isinstance(choice, str):
            need(choice in ("auto", "none", "required"), "'tool_choice' must be auto, none, required or a function", "tool_choice")
            chat["tool_choice"] = choice
        else:
            need(
                isinstance(choice, dict) and choice.get("type") == "function",
                "'tool_choice' must be auto, none, required or a function",
                "tool_choice",
            )
            need(choice.get("name") in names, "tool_choice.name must name one of 'tools'", "tool_choice")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif tools:
        chat["tool_choice"] = "auto"
    parallel = optional(body, "parallel_tool_calls", lambda v: isinstance(v, bool), "true or false")
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    text = optional(body, "text", lambda v: isinstance(v, dict), "an object")
    fmt = text.get("format") if text else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        need(isinstance(fmt.get("schema"), dict), "text.format.schema must be a JSON Schema object", "text")
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name") or "response", "schema": fmt["schema"], "strict": fmt.get("strict")},
        }
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    optional(body, "metadata", lambda v: isinstance(v, dict), "an object")
    vllm_extensions(body, chat)
    context = {
        "instructions": instructions,
        "store": body.get("store") is not False,
        "request": {
            "model": model,
            "instructions": instructions,
            "max_output_tokens": max_out,
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "tools": [
                {
                    "type": "function",
                    "name": t["function"]["name"],
                    "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"],
                    "strict": t["function"].get("strict"),
                }
                for t in tools or []
            ],
            "tool_choice": choice if choice is not None else "auto",
            "parallel_tool_calls": parallel if parallel is not None else True,
            "metadata": body.get("metadata") or {},
            "store": body.get("store") is not False,
            "text": text or {"format": {"type": "text"}},
        },
    }
    return chat, history, context


# ---- chat answer → Response -------------------------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items vLLM makes of an assistant message: reasoning, the message, one function_call per call."""
    out: list[dict[str, Any]] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        out.append(reasoning_item(_id("rs"), reasoning))
    if isinstance(message.get("content"), str) and message["content"]:
        out.append(message_item(_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or ():
        if isinstance(call, dict):
            fn: Any = call.get("function") if isinstance(call.get("function"), dict) else {}
            out.append(
                call_item(
                    _id("fc"), str(call.get("id") or _id("call")), str(fn.get("name") or ""), str(fn.get("arguments") or ""), "completed"
                )
            )
    return out


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": None}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def usage_of(usage: Any) -> dict[str, Any]:
    usage = usage if isinstance(usage, dict) else {}
    prompt = usage.get("prompt_tokens") if is_int(usage.get("prompt_tokens")) else 0
    output = usage.get("completion_tokens") if is_int(usage.get("completion_tokens")) else 0
    details: Any = usage.get("completion_tokens_details") if isinstance(usage.get("completion_tokens_details"), dict) else {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") if isinstance(usage.get("prompt_tokens_details"), dict) else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached if is_int(cached) else 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens") if is_int(details.get("reasoning_tokens")) else 0},
        "total_tokens": prompt + output,
    }


def response_object(
    turn: ChatTurn,
    created: float,
    output: list[dict[str, Any]],
    finish: Any,
    usage: Any,
    status: str | None = None,
    response_id: str | None = None,
) -> dict[str, Any]:
    request = turn.context["request"]
    if status is None:
        status = "incomplete" if finish == "length" else "completed"
    return {
        "id": response_id or _id("resp"),
        "object": "response",
        "created_at": int(created),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request["instructions"],
        "max_output_tokens": request["max_output_tokens"],
        "model": request["model"],
        "output": output,
        "parallel_tool_calls": request["parallel_tool_calls"],
        "previous_response_id": turn.context.get("previous_response_id"),
        "reasoning": None,
        "store": request["store"],
        "temperature": request["temperature"],
        "text": request["text"],
        "tool_choice": request["tool_choice"],
        "tools": request["tools"],
        "top_p": request["top_p"],
        "truncation": "disabled",
        "usage": None if usage is None and status == "in_progress" else usage_of(usage),
        "user": None,
        "metadata": request["metadata"],
    }


class ResponseStream:
    """D's chat chunks → the Responses event stream: response.created, response.in_progress; per output item
    response.output_item.added, its deltas (response.reasoning_text.delta; response.content_part.added and
    response.output_text.delta; response.function_call_arguments.delta), their .done events and
    response.output_item.done; then response.completed (its status `incomplete` when max_output_tokens cut it). Each
    event carries its sequence_number. The response is stored (previous_response_id) before its last event goes out."""

    def __init__(self, surface: ResponsesSurface, turn: ChatTurn) -> None:
        self.surface, self.turn = surface, turn
        self.id = _id("resp")
        self.created = surface.clock()
        self.seq = 0
        self.started = False
        self.items: list[dict[str, Any]] = []  # finished output items
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text: list[str] = []
        self.call_ids: dict[int, str] = {}
        self.finish_reason: Any = None
        self.usage: Any = None
        self.done = False

    def _event(self, name: str, data: dict[str, Any]) -> bytes:
        data = {"type": name, **data, "sequence_number": self.seq}
        self.seq += 1
        return sse_event(name, data)

    def _snapshot(self, status: str) -> dict[str, Any]:
        return response_object(self.turn, self.created, list(self.items), self.finish_reason, self.usage, status, self.id)

    def _start(self) -> bytes:
        self.started = True
        snap = self._snapshot("in_progress")
        return self._event("response.created", {"response": snap}) + self._event("response.in_progress", {"response": snap})

    def _index(self) -> int:
        return len(self.items)

    def _close(self) -> bytes:
        item = self.open
        if item is None:
            return b""
        self.open = None
        text = "".join(self.text)
        self.text = []
        at = {"item_id": item["id"], "output_index": self._index()}
        out = b""
        if item["type"] == "message":
            item = message_item(item["id"], text, "completed")
            out += self._event("response.output_text.done", {**at, "content_index": 0, "text": text, "logprobs": []})
            out += self._event("response.content_part.done", {**at, "content_index": 0, "part": text_part(text)})
        elif item["type"] == "reasoning":
            item = reasoning_item(item["id"], text)
            out += self._event("response.reasoning_text.done", {**at, "content_index": 0, "text": text})
        else:
            item = call_item(item["id"], item["call_id"], item["name"], text, "completed")
            out += self._event("response.function_call_arguments.done", {**at, "arguments": text, "name": item["name"]})
        out += self._event("response.output_item.done", {"output_index": self._index(), "item": item})
        self.items.append(item)
        return out

    def _open(self, item: dict[str, Any]) -> bytes:
        out = self._close()
        self.open = item
        out += self._event("response.output_item.added", {"output_index": self._index(), "item": item})
        if item["type"] == "message":
            at = {"item_id": item["id"], "output_index": self._index(), "content_index": 0}
            out += self._event("response.content_part.added", {**at, "part": text_part("")})
        return out

    def feed(self, chunks: list[dict[str, Any]]) -> bytes:
        out = b"" if self.started else self._start()
        for chunk in chunks:
            if isinstance(chunk.get("usage"), dict):
                self.usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                    continue
                if choice.get("finish_reason"):
                    self.finish_reason = choice["finish_reason"]
                delta: Any = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
                out += self._feed_delta(delta)
        return out

    def _feed_delta(self, delta: dict[str, Any]) -> bytes:
        out = b""
        thought = delta.get("reasoning") or delta.get("reasoning_content")
        if isinstance(thought, str) and thought:
            if self.open is None or self.open["type"] != "reasoning":
                out += self._open({"id": _id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"})
            self.text.append(thought)
            at = {"item_id": self.open["id"] if self.open else "", "output_index": self._index(), "content_index": 0}
            out += self._event("response.reasoning_text.delta", {**at, "delta": thought})
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self.open is None or self.open["type"] != "message":
                out += self._open(message_item(_id("msg"), None, "in_progress"))
            self.text.append(text)
            at = {"item_id": self.open["id"] if self.open else "", "output_index": self._index(), "content_index": 0}
            out += self._event("response.output_text.delta", {**at, "delta": text, "logprobs": []})
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            index = call.get("index", 0)
            fn: Any = call.get("function") if isinstance(call.get("function"), dict) else {}
            if isinstance(call.get("id"), str) and call["id"] not in self.call_ids.values():
                self.call_ids[index] = call["id"]
                out += self._open(call_item(_id("fc"), call["id"], str(fn.get("name") or ""), "", "in_progress"))
            args = fn.get("arguments")
            open_call = self.open.get("call_id") if self.open else None
            if isinstance(args, str) and args and self.open is not None and self.call_ids.get(index) == open_call:
                self.text.append(args)
                out += self._event(
                    "response.function_call_arguments.delta", {"item_id": self.open["id"], "output_index": self._index(), "delta": args}
                )
        return out

    async def finish(self) -> bytes:
        if self.done:
            return b""
        self.done = True
        out = b"" if self.started else self._start()
        out += self._close()
        response = self._snapshot("incomplete" if self.finish_reason == "length" else "completed")
        await self.surface._keep(self.turn, response)
        # response.completed whatever the status (`incomplete` when max_output_tokens cut it, inside): what vLLM sends,
        # and the only end the openai SDK's stream helper accepts (get_final_response).
        return out + self._event("response.completed", {"response": response})

    def failed(self, message: str) -> bytes:
        self.done = True
        response = self._snapshot("failed")
        response["error"] = {"code": "server_error", "message": message}
        return self._event("error", {"code": "server_error", "message": message, "param": None}) + self._event(
            "response.failed", {"response": response}
        )
