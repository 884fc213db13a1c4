"""Drive vLLM's P/D protocol directly (no router): P (one token, no stream) then D, bidirectional reuse."""

from __future__ import annotations

import json
from typing import Any

import httpx

from bpdkv.bench.runner import metric_value
from bpdkv.router.protocol import P_TEMPLATE as TEMPLATE


def sse(resp: httpx.Response) -> tuple[str, dict[str, Any] | None, list[dict[str, Any]]]:
    text, params, events = [], None, []
    for line in resp.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        events.append(event)
        if "kv_transfer_params" in event:
            params = event["kv_transfer_params"]
        for choice in event.get("choices", []):
            text.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return "".join(text), params, events


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
    p_body = dict(body, max_tokens=1, stream=False, kv_transfer_params=d_params or dict(TEMPLATE), **(p_extra or {}))
    p = httpx.post(p_url + route, json=p_body, timeout=timeout)
    p.raise_for_status()
    p_params = p.json()["kv_transfer_params"]
    d_body = dict(body, stream=stream, kv_transfer_params=p_params)
    if not stream:
        d = httpx.post(d_url + route, json=d_body, timeout=timeout)
        d.raise_for_status()
        data = d.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return text, data.get("kv_transfer_params")
    with httpx.stream("POST", d_url + route, json=d_body, timeout=timeout) as resp:
        resp.raise_for_status()
        text, params, _ = sse(resp)
    return text, params


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
