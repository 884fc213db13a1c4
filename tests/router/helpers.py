from __future__ import annotations

import json
from typing import Any

import httpx

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
    text = []
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(event)
            for choice in event.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text), events


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
        parts = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    assert "kv_transfer_params" not in event
                    parts += [c.get("text", "") for c in event.get("choices", [])]
        text = "".join(parts)
    return text, list(text.encode())
