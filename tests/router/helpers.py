from __future__ import annotations

from typing import Any

import httpx

from bpdkv.sse import Reply, sse_events

SYSTEM = "You are a helpful assistant. " * 8


def chat(
    url: str, messages: list[dict[str, Any]], stream: bool = False, headers: dict[str, str] | None = None, **extra: Any
) -> tuple[str, Any]:
    body = {"model": "emulated", "messages": messages, "max_tokens": 40, "stream": stream, **extra}
    if not stream:
        resp = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        data = resp.json()
        if resp.status_code != 200:
            return "", resp
        return data["choices"][0]["message"]["content"], data
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        events = list(sse_events(resp.iter_lines()))
    reply = Reply()
    for event in events:
        reply.add_event(event)
    return reply.text, events


def conversation(url: str, turns: int = 4, stream: bool = False, headers: dict[str, str] | None = None, **extra: Any) -> list[str]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    answers = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: tell me about topic {turn * 7} in detail please."})
        text, _ = chat(url, messages, stream=stream, headers=headers, **extra)
        answers.append(text)
        messages.append({"role": "assistant", "content": text})
    return answers


def complete_tokens(url: str, prompt: list[int], stream: bool = False, max_tokens: int = 30) -> tuple[str, list[int]]:
    body = {"model": "emulated", "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}
    if not stream:
        data = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
        text = data["choices"][0]["text"]
    else:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
            events = list(sse_events(resp.iter_lines()))
        assert events and all("kv_transfer_params" not in e for e in events)
        reply = Reply()
        for event in events:
            reply.add_event(event)
        text = reply.text
    return text, list(text.encode())
