"""Drive vLLM's P/D protocol directly (no router): P (one token, no stream) then D, bidirectional reuse."""

from __future__ import annotations

from typing import Any

import httpx

from bpdkv import contracts
from bpdkv.prometheus_text import metric_value
from bpdkv.sse import Reply, sse_events
from bpdkv.turn_client import TurnClient

TEMPLATE = contracts.prefill_template()


def sse(resp: httpx.Response) -> tuple[str, dict[str, Any] | None, list[dict[str, Any]]]:
    events = list(sse_events(resp.iter_lines()))
    reply = Reply()
    for event in events:
        reply.add_event(event)
    return reply.text, reply.params, events


def turn(
    p_url: str,
    d_url: str,
    route: str,
    body: dict[str, Any],
    d_params: dict[str, Any] | None,
    stream: bool = False,
    timeout: float = 120,
    p_extra: dict[str, Any] | None = None,
) -> tuple[str, dict[str, Any] | None]:
    """One turn: returns (D's text, D's returned kv_transfer_params). p_extra: fields for P only (e.g. cache_salt)."""
    reply = TurnClient(p_url, d_url, timeout).turn(route, body, d_params, stream, p_extra)
    return reply.text, reply.params


def reference(url: str, route: str, body: dict[str, Any], timeout: float = 120) -> str:
    data = httpx.post(url + route, json=dict(body, stream=False), timeout=timeout).json()
    choice = data["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def metric(url: str, name: str, **labels: str) -> float:
    return metric_value(httpx.get(url + "/metrics", timeout=30).text, name, labels)


QUESTIONS = [
    "the router plans the cache transfer for the next turn of the agent, explain the history",
    "now the decode engine streams the answer, what does the prefill node pull?",
    "summarise the key value blocks and the tokens of the system in detail",
    "what happens when the tool call result comes back slow?",
]


def chat_conversation(
    p_url: str, d_url: str, ref_url: str, turns: int = 4, stream: bool = False, max_tokens: int = 24
) -> list[dict[str, Any]]:
    """Per turn: D's text, the reference text, P's external tokens before/after."""
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant for model cache questions."}]
    d_params = None
    out = []
    for i in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        before = metric(p_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        text, d_params = turn(p_url, d_url, "/v1/chat/completions", body, d_params, stream=stream)
        after = metric(p_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        ref = reference(ref_url, "/v1/chat/completions", body)
        out.append({"text": text, "reference": ref, "pulled": after - before, "params": d_params})
        messages.append({"role": "assistant", "content": text})
    return out
