"""The Anthropic Messages surface (`POST /v1/messages`): parse and validate → a chat turn → the one turn pipeline → the
answer rendered as an Anthropic message (or its event stream).

The conversion is the one vLLM's own /v1/messages makes inside one server (vllm/entrypoints/anthropic): the system
prompt (a string, or its text blocks concatenated) as the first system message; text blocks as the content (one
block: a string); tool_use blocks as the assistant's tool_calls with `json.dumps(input)` arguments; each tool_result
of a user message as a `tool` message placed before the user's other content (its text blocks joined by newlines);
thinking blocks as the assistant's `reasoning` (which vLLM's chat templates see as it does); redacted_thinking
dropped; max_tokens, stop_sequences, temperature, top_p, top_k, tools (input_schema as parameters) and tool_choice
(auto, any → required, none, tool → named) mapped one to one. So a conversation gets the same prompt, and with greedy
decoding the same answer, through the router as from one vLLM server's /v1/messages.

Stricter than vLLM (which answers 200 to a tool_result naming no tool_use): a tool_result must name a tool_use of the
assistant message just before it, a tool_use id is unique in the conversation and every tool_use before a user
message is answered there; block types, roles and field types are checked. Every refusal is Anthropic's error shape,
`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.responses import JSONResponse

from bpdkv.router.surface import (
    API_MESSAGES,
    ChatTurn,
    is_int,
    is_number,
    need,
    optional,
    sse_event,
    strings,
    text_tool_args,
    vllm_extensions,
)

ROUTE = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
ROLES = ("user", "assistant", "system")  # vLLM also takes inline system messages
USER_BLOCKS = frozenset({"text", "image", "tool_result"})
ASSISTANT_BLOCKS = frozenset({"text", "thinking", "redacted_thinking", "tool_use"})
TOOL_RESULT_BLOCKS = frozenset({"text", "image"})
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "client_closed_request",
    503: "overloaded_error",
    529: "overloaded_error",
}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


class MessagesSurface:
    route = ROUTE
    api = API_MESSAGES

    def error(self, status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
        if not message.isascii():
            message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        return JSONResponse({"type": "error", "error": {"type": error_type(status), "message": message}}, status_code=status)

    async def parse(self, body: dict[str, Any], headers: dict[str, str], tenant: str) -> ChatTurn:
        return ChatTurn(to_chat(body), body.get("stream") is True)

    async def render(self, turn: ChatTurn, answer: dict[str, Any]) -> dict[str, Any]:
        return render_message(answer, turn.body.get("model"))

    def translator(self, turn: ChatTurn) -> MessageStream:
        return MessageStream(turn.body.get("model"))


# ---- request → chat ------------------------------------------------------------------------------------------------
def _text_blocks(value: Any, where: str) -> str:
    """A system prompt or a system message: a string, or text blocks (concatenated, as vLLM does)."""
    if isinstance(value, str):
        return value
    need(isinstance(value, list), f"{where} must be a string or an array of text blocks", where)
    parts = []
    for i, block in enumerate(value):
        need(isinstance(block, dict) and block.get("type") == "text", f"{where}[{i}] must be a text block", where)
        need(isinstance(block.get("text"), str), f"{where}[{i}].text must be a string", where)
        if block["text"] and not block["text"].startswith("x-anthropic-billing-header"):
            parts.append(block["text"])
    return "".join(parts)


def _tool_result_text(block: dict[str, Any], where: str) -> tuple[str, list[str]]:
    """A tool_result's text (its text blocks joined by newlines) and its image URLs."""
    content = block.get("content")
    if content is None or isinstance(content, str):
        return content or "", []
    need(isinstance(content, list), f"{where}.content must be a string or an array of text or image blocks", where)
    texts, images = [], []
    for j, part in enumerate(content):
        need(isinstance(part, dict) and isinstance(part.get("type"), str), f"{where}.content[{j}] must be a content block", where)
        kind = part["type"]
        need(kind in TOOL_RESULT_BLOCKS, f"{where}.content[{j}]: a tool_result holds text or image blocks, not '{kind}'", where)
        if kind == "text":
            need(isinstance(part.get("text"), str), f"{where}.content[{j}].text must be a string", where)
            texts.append(part["text"])
        else:
            images.append(_image_url(part, f"{where}.content[{j}]"))
    return "\n".join(texts), images


def _image_url(block: dict[str, Any], where: str) -> str:
    source: Any = block.get("source")
    need(isinstance(source, dict), f"{where}.source must be an object", where)
    if source.get("type") == "url":
        need(isinstance(source.get("url"), str), f"{where}.source.url must be a string", where)
        return str(source["url"])
    need(source.get("type") == "base64", f"{where}.source.type must be 'base64' or 'url'", where)
    need(
        isinstance(source.get("data"), str) and isinstance(source.get("media_type", "image/jpeg"), str),
        f"{where}.source needs data and media_type strings",
        where,
    )
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source['data']}"


def _convert_message(i: int, msg: Any, out: list[dict[str, Any]], pending: set[str], seen: set[str]) -> set[str]:
    """Append message i's chat messages to out; returns the tool_use ids it opens (answered by the next message)."""
    where = f"messages[{i}]"
    need(isinstance(msg, dict), f"{where} must be an object with 'role' and 'content'", "messages")
    role = msg.get("role")
    need(role in ROLES, f"{where}.role must be 'user' or 'assistant'", "messages")
    content = msg.get("content")
    if role == "system":
        text = _text_blocks(content, f"{where}.content")
        if text:
            out.append({"role": "system", "content": text})
        return set()
    if isinstance(content, str):
        need(role != "user" or not pending, f"{where}: tool_use ids {sorted(pending)} have no tool_result in this message", "messages")
        out.append({"role": role, "content": content})
        return set()
    need(isinstance(content, list), f"{where}.content must be a string or an array of content blocks", "messages")
    allowed = USER_BLOCKS if role == "user" else ASSISTANT_BLOCKS
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    opened: set[str] = set()
    answered: set[str] = set()
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        need(isinstance(block, dict) and isinstance(block.get("type"), str), f"{at} must be a content block with a 'type'", "messages")
        kind = block["type"]
        need(kind in allowed, f"{at}: a {role} message cannot hold a '{kind}' block", "messages")
        if kind == "text":
            need(isinstance(block.get("text"), str), f"{at}.text must be a string", "messages")
            if block["text"]:
                parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, at)}})
        elif kind == "thinking":
            need(isinstance(block.get("thinking"), str), f"{at}.thinking must be a string", "messages")
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            need(isinstance(block.get("data"), str), f"{at}.data must be a string", "messages")
        elif kind == "tool_use":
            call_id, name = block.get("id"), block.get("name")
            need(isinstance(call_id, str) and bool(call_id), f"{at}.id must be a non-empty string", "messages")
            need(isinstance(name, str) and bool(name), f"{at}.name must be a non-empty string", "messages")
            need(isinstance(block.get("input", {}), dict), f"{at}.input must be an object", "messages")
            need(call_id not in seen, f"{at}: tool_use id '{call_id}' is used twice in this conversation", "messages")
            seen.add(call_id)
            opened.add(call_id)
            arguments = json.dumps(block.get("input") or {})
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        else:  # tool_result
            use_id = block.get("tool_use_id")
            need(isinstance(use_id, str) and bool(use_id), f"{at}.tool_use_id must be a non-empty string", "messages")
            need(
                use_id in pending,
                f"{at}: tool_result names tool_use id '{use_id}', which is not a tool_use of the previous assistant message",
                "messages",
            )
            need(use_id not in answered, f"{at}: tool_use id '{use_id}' has two tool_results", "messages")
            need(block.get("is_error") is None or isinstance(block.get("is_error"), bool), f"{at}.is_error must be a boolean", "messages")
            answered.add(use_id)
            text, images = _tool_result_text(block, at)
            out.append({"role": "tool", "tool_call_id": use_id, "content": text})
            if images:
                out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    if role == "user":
        missing = pending - answered
        need(not missing, f"{where}: tool_use ids {sorted(missing)} have no tool_result in this message", "messages")
    chat: dict[str, Any] = {"role": role}
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if parts:
        chat["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    if role == "assistant" or "content" in chat:  # a user message of tool results only is its tool messages
        out.append(chat)
    return opened


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    need(isinstance(tools, list), "'tools' must be an array of tool definitions", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        need(isinstance(tool, dict), f"{where} must be an object", "tools")
        kind = tool.get("type")
        need(
            kind in (None, "custom"),
            f"{where}: server tools ('{kind}') are not supported by this server; define the tool with a name and an input_schema",
            "tools",
        )
        name = tool.get("name")
        need(isinstance(name, str) and 0 < len(name) <= 128, f"{where}.name must be a string of 1 to 128 characters", "tools")
        need(name not in names, f"{where}: tool name '{name}' is defined twice", "tools")
        names.add(name)
        need(isinstance(tool.get("input_schema"), dict), f"{where}.input_schema must be a JSON Schema object", "tools")
        need(tool.get("description") is None or isinstance(tool.get("description"), str), f"{where}.description must be a string", "tools")
        function: dict[str, Any] = {"name": name, "description": tool.get("description"), "parameters": tool["input_schema"]}
        if tool.get("strict") is not None:
            need(isinstance(tool["strict"], bool), f"{where}.strict must be a boolean", "tools")
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(body: dict[str, Any], chat: dict[str, Any], names: set[str]) -> None:
    choice: Any = body.get("tool_choice")
    if choice is None:
        if chat.get("tools"):
            chat["tool_choice"] = "auto"
        return
    need(isinstance(choice, dict), "'tool_choice' must be an object with a 'type'", "tool_choice")
    kind = choice.get("type")
    need(kind in ("auto", "any", "none", "tool"), "tool_choice.type must be one of auto, any, none, tool", "tool_choice")
    need(kind == "none" or bool(names), f"tool_choice '{kind}' needs 'tools'", "tool_choice")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None:
        need(isinstance(parallel, bool), "tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
        chat["parallel_tool_calls"] = not parallel
    if kind == "tool":
        name = choice.get("name")
        need(isinstance(name, str) and name in names, "tool_choice.name must name one of 'tools'", "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]


def to_chat(body: dict[str, Any], counting: bool = False) -> dict[str, Any]:
    """The Chat Completions body vLLM's /v1/messages would run for this request (400 for what it must not run).
    counting: a count_tokens request (no max_tokens)."""
    model: Any = body.get("model")
    need(isinstance(model, str) and bool(model), "'model' must be a non-empty string", "model")
    max_tokens: Any = body.get("max_tokens", 1 if counting else None)
    need(is_int(max_tokens) and max_tokens >= 1, "'max_tokens' must be an integer of at least 1", "max_tokens")
    need(body.get("stream") is None or isinstance(body.get("stream"), bool), "'stream' must be true or false", "stream")
    messages: Any = body.get("messages")
    need(isinstance(messages, list) and bool(messages), "'messages' must be a non-empty array of messages", "messages")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    pending: set[str] = set()
    seen: set[str] = set()
    for i, msg in enumerate(messages):
        opened = _convert_message(i, msg, out, pending, seen)
        role = msg.get("role")
        if role == "user":
            pending = set()
        if role == "assistant":
            pending = opened
    chat: dict[str, Any] = {"model": model, "messages": out, "max_tokens": max_tokens}
    stop = optional(body, "stop_sequences", strings, "an array of strings")
    if stop:
        chat["stop"] = stop
    for key in ("temperature", "top_p"):
        value = optional(body, key, lambda v: is_number(v) and v >= 0, "a number of at least 0")
        if value is not None:
            chat[key] = value
    top_k = optional(body, "top_k", lambda v: is_int(v) and v >= -1, "an integer")
    if top_k is not None:
        chat["top_k"] = top_k
    tools = _tools(body)
    if tools is not None:
        chat["tools"] = tools
    _tool_choice(body, chat, {t["function"]["name"] for t in tools or []})
    thinking = optional(body, "thinking", lambda v: isinstance(v, dict), "an object")
    if thinking is not None:
        kind = thinking.get("type")
        need(kind in ("enabled", "disabled", "adaptive"), "thinking.type must be enabled, disabled or adaptive", "thinking")
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            need(is_int(budget) and budget >= 1, "thinking.budget_tokens must be a positive integer", "thinking")
            chat["thinking_token_budget"] = budget
    output = optional(body, "output_config", lambda v: isinstance(v, dict), "an object")
    if output is not None:  # as vLLM maps it: a JSON schema format → response_format, effort → reasoning_effort
        fmt = output.get("format")
        schema = fmt.get("schema", fmt.get("json_schema")) if isinstance(fmt, dict) else None
        if fmt is not None:
            need(isinstance(schema, dict), "output_config.format needs a JSON Schema object ('schema')", "output_config")
            chat["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": str(fmt.get("type") or "json_schema"), "schema": schema},
            }
        effort = output.get("effort")
        if effort is not None:
            need(isinstance(effort, str), "output_config.effort must be a string", "output_config")
            chat["reasoning_effort"] = effort
    optional(body, "metadata", lambda v: isinstance(v, dict), "an object")
    vllm_extensions(body, chat)
    return chat


# ---- chat answer → Anthropic message ------------------------------------------------------------------------------------
def stop_reason(finish: str | None, matched: Any, tool_used: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for vLLM's finish reason (and the stop string it matched, if any)."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls" or tool_used:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def usage_of(usage: Any) -> dict[str, int]:
    usage = usage if isinstance(usage, dict) else {}
    prompt, output = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return {"input_tokens": prompt if is_int(prompt) else 0, "output_tokens": output if is_int(output) else 0}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def render_message(answer: dict[str, Any], model: Any) -> dict[str, Any]:
    choices: Any = answer.get("choices") if isinstance(answer.get("choices"), list) else []
    choice: Any = choices[0] if choices and isinstance(choices[0], dict) else {}
    message: Any = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if isinstance(message.get("content"), str) and message["content"]:
        content.append({"type": "text", "text": message["content"]})
    calls = [c for c in message.get("tool_calls") or () if isinstance(c, dict)]
    for call in calls:
        fn: Any = call.get("function") if isinstance(call.get("function"), dict) else {}
        content.append(
            {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"), "input": text_tool_args(str(fn.get("arguments") or "{}"))}
        )
    if not content:
        content.append({"type": "text", "text": ""})
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), bool(calls))
    return {
        "id": message_id(),
        "type": "message",
        "role": "assistant",
        "model": answer.get("model") or model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_of(answer.get("usage")),
    }


class MessageStream:
    """D's chat chunks → Anthropic's events: message_start; per block content_block_start, its deltas (text_delta,
    thinking_delta then a signature_delta, input_json_delta), content_block_stop; message_delta with the stop reason
    and usage; message_stop."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.started = False
        self.index = -1  # the open block's index (-1: none yet)
        self.open: str | None = None  # the open block's type
        self.call_ids: dict[int, str] = {}  # chat tool-call index → tool_use id
        self.open_call: str | None = None
        self.finish_reason: str | None = None
        self.matched: Any = None
        self.tool_used = False
        self.usage: Any = None
        self.done = False

    def _start(self, chunk: dict[str, Any]) -> bytes:
        self.started = True
        message = {
            "id": message_id(),
            "type": "message",
            "role": "assistant",
            "model": chunk.get("model") or self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return sse_event("message_start", {"type": "message_start", "message": message})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        out = b""
        if self.open == "thinking":
            delta = {"type": "signature_delta", "signature": ""}
            out += sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
        out += sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.open, self.open_call = None, None
        return out

    def _open(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + sse_event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, chunks: list[dict[str, Any]]) -> bytes:
        out = b""
        for chunk in chunks:
            if not self.started:
                out += self._start(chunk)
            if isinstance(chunk.get("usage"), dict):
                self.usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                    continue
                if choice.get("finish_reason"):
                    self.finish_reason, self.matched = choice["finish_reason"], choice.get("stop_reason")
                delta: Any = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
                out += self._feed_delta(delta)
        return out

    def _feed_delta(self, delta: dict[str, Any]) -> bytes:
        out = b""
        thought = delta.get("reasoning") or delta.get("reasoning_content")
        if isinstance(thought, str) and thought:
            if self.open != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            out += self._delta({"type": "thinking_delta", "thinking": thought})
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self.open != "text":
                out += self._open({"type": "text", "text": ""})
            out += self._delta({"type": "text_delta", "text": text})
        for call in delta.get("tool_calls") or ():
            if not isinstance(call, dict):
                continue
            index = call.get("index", 0)
            fn: Any = call.get("function") if isinstance(call.get("function"), dict) else {}
            if isinstance(call.get("id"), str) and call["id"] not in self.call_ids.values():
                self.call_ids[index] = call["id"]
                self.tool_used = True
                out += self._open({"type": "tool_use", "id": call["id"], "name": fn.get("name") or "", "input": {}})
                self.open_call = call["id"]
            args = fn.get("arguments")
            if isinstance(args, str) and args and self.call_ids.get(index) == self.open_call:
                out += self._delta({"type": "input_json_delta", "partial_json": args})
        return out

    async def finish(self) -> bytes:
        if self.done:
            return b""
        self.done = True
        out = b"" if self.started else self._start({})
        out += self._close()
        reason, sequence = stop_reason(self.finish_reason, self.matched, self.tool_used)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage_of(self.usage)}
        return out + sse_event("message_delta", delta) + sse_event("message_stop", {"type": "message_stop"})

    def failed(self, message: str) -> bytes:
        self.done = True
        return sse_event("error", {"type": "error", "error": {"type": "api_error", "message": message}})
