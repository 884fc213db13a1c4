"""The router in front of real vLLM-CPU P and D (bpdkv node plugin, NIXL over UCX/TCP on loopback), next to a
single reference server: a tool-calling conversation (Hermes tool template, vLLM's `hermes` parser) reuses D's KV
on the tool-result turns and answers as the reference does; a reasoning turn whose thought the
client drops from the history it sends back is counted `partial`, and P pulls only the tokens D's KV shares with the
new prompt (the connector cuts) and answers as the reference does; D killed and restarted between turns, with P's own
cache bypassed, and the next turn still succeeds (P's failed pull retried without D's params) and equals the
reference. Three servers, shared by the module; ~3 min on 2 cores."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bpdkv import contracts
from bpdkv.bench.runner import metric_value
from bpdkv.router.app import Router
from bpdkv.router.config import HealthSettings, PathSettings, RouterConfig, Timeouts, UpstreamSpec
from bpdkv.sse import read_stream
from bpdkv.testing.record_vllm import (
    ONE_CALL,
    SYSTEM,
    TOOL_CHAT_TEMPLATE,
    TOOL_MAX_TOKENS,
    TOOLS,
    TWO_CALLS,
    VllmCpuServer,
    forced_reasoning,
    forced_tool_calls,
)
from bpdkv.testing.vllm_emulator import ServerGroup

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CHAT = "/v1/chat/completions"
EXTERNAL = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})
BLOCK = 32  # the servers' --block-size: P pulls whole blocks
REASONING = ("reasoning", "reasoning_content")
FENCE_REFUSALS = ("released", "pin_unanswered")  # P's pull outcomes when the D whose hold it pins is not there


class Fleet:
    def __init__(self, p: VllmCpuServer, d: VllmCpuServer, ref: VllmCpuServer, router_url: str, paths_url: str = "") -> None:
        self.p, self.d, self.ref, self.url = p, d, ref, router_url
        self.paths_url = paths_url  # a second router on the same servers with per-turn paths on (decode_local)

    def server_metric(self, url: str, name: str, **labels: str) -> float:
        return metric_value(httpx.get(url + "/metrics", timeout=30).text, name, labels)

    def pulled(self) -> float:
        """Tokens P has read from D's blocks so far."""
        return metric_value(httpx.get(self.p.url + "/metrics", timeout=30).text, EXTERNAL[0], EXTERNAL[1])

    def decisions(self) -> list[str]:
        """P's pull decisions so far (outcome and reason, with counts): why a pull was shorter than asserted."""
        text = httpx.get(self.p.url + "/metrics", timeout=30).text
        return [line for line in text.splitlines() if line.startswith("vllm:bpdkv_pull_decisions_total{")]

    def router_metric(self, name: str, **labels: str) -> float:
        """Sum of a router counter's samples, over those with these labels."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        want = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if (line.startswith(name + "{") or line.startswith(name + " ")) and all(w in line for w in want)
        )


@pytest.fixture(scope="module")
def fleet(tiny_model: Path) -> Iterator[Fleet]:
    with tempfile.TemporaryDirectory(prefix="bpdkv-router-e2e-") as tmp:
        logs = Path(tmp)
        template = logs / "tool_chat_template.jinja"
        template.write_text(TOOL_CHAT_TEMPLATE)
        # The token-count rule alone on P: these tests are about what is pulled (cuts, restarts, paths), and on this
        # machine the tiny model computes about as fast as loopback moves its KV, so the cost model would pull, probe or
        # recompute by a coin toss (CI saw a one-block probe where the cut was asserted); tests/e2e/test_slow_link.py
        # tests the cost model on a link where it decides something.
        p = VllmCpuServer(
            "prefill",
            logs,
            "kv_producer",
            template,
            reasoning=True,
            extra={contracts.EXTRA_PULL_DECISION: contracts.PULL_DECISION_THRESHOLD},
        )
        d = VllmCpuServer("decode", logs, "kv_consumer", template, reasoning=True)
        ref = VllmCpuServer("reference", logs, None, template, reasoning=True)
        group: ServerGroup | None = None
        try:
            for server in (p, d, ref):
                server.start()
            for server in (p, d, ref):
                server.wait()
            # No active health checks: the router must not learn of D's restart before P fails a pull.
            # The pull path (every turn through P) for the tests that are about it; a second router with per-turn paths on.
            config = RouterConfig(
                prefill=(UpstreamSpec("prefill-0", p.url),),
                decode=(UpstreamSpec("decode-0", d.url),),
                timeouts=Timeouts(connect=5, prefill=120, decode_first_byte=120, decode_idle=120),
                health=HealthSettings(interval=0, failures_to_eject=3, backoff_max=5),
                paths=PathSettings(local_max_tokens=0),
            )
            router = Router(config)
            paths_router = Router(dataclasses.replace(config, paths=PathSettings(local_max_tokens=64, load_interval=0.5)))
            group = ServerGroup([router.app, paths_router.app])
            url, paths_url = group.start()
            yield Fleet(p, d, ref, url, paths_url)
        finally:
            if group is not None:
                group.stop()
            for server in (p, d, ref):
                server.stop()


def ask(url: str, messages: list[dict[str, Any]], stream: bool, headers: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    """The assistant message and finish reason, from a JSON answer or assembled from a stream's deltas."""
    body = {"model": "tiny", "messages": messages, "temperature": 0, "stream": stream, **extra}
    body.setdefault("max_tokens", 16)
    if not stream:
        resp = httpx.post(url + CHAT, json=body, headers=headers, timeout=180)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert not resp.json().get(contracts.KV_TRANSFER_PARAMS)  # the router never hands D's blocks to a client
        # Token ids only when asked for (`return_token_ids`, sent to the reference server).
        ids = {"prompt_ids": resp.json().get("prompt_token_ids"), "output_ids": choice.get("token_ids")}
        return {"message": _message(choice["message"]), "finish": choice["finish_reason"], **ids}
    content, reasoning, calls, finish = "", "", {}, None
    with httpx.stream("POST", url + CHAT, json=body, headers=headers, timeout=180) as resp:
        assert resp.status_code == 200, resp.read()
        for event in read_stream(resp.iter_lines()).events:
            assert not event.get(contracts.KV_TRANSFER_PARAMS)
            for choice in event.get("choices", []):
                delta = choice.get("delta") or {}
                content += delta.get("content") or ""
                reasoning += "".join(delta.get(k) or "" for k in REASONING)
                for tc in delta.get("tool_calls") or []:
                    call = calls.setdefault(tc["index"], {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                    call["id"] = tc.get("id") or call["id"]
                    call["function"]["name"] += (tc.get("function") or {}).get("name") or ""
                    call["function"]["arguments"] += (tc.get("function") or {}).get("arguments") or ""
                finish = choice.get("finish_reason") or finish
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"message": message, "finish": finish}


def _message(m: dict[str, Any]) -> dict[str, Any]:
    out = {"role": "assistant", "content": m.get("content")}
    if any(m.get(k) for k in REASONING):
        out["reasoning"] = next(m[k] for k in REASONING if m.get(k))
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function", "function": c["function"]} for c in m["tool_calls"]]
    return out


def seen(answer: dict[str, Any]) -> tuple[Any, ...]:
    """What must equal the reference: text, called tools with their arguments, finish reason, thought."""
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer["message"].get("tool_calls", [])]
    return answer["message"]["content"], calls, answer["finish"], answer["message"].get("reasoning")


def tool_results(messages: list[dict[str, Any]], message: dict[str, Any]) -> None:
    messages.append(message)
    for call in message.get("tool_calls", []):
        result = {"get_weather": "sunny, 21 degrees", "get_time": "14:05"}[call["function"]["name"]]
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})


def test_tool_calling_conversation_reuses_decode_kv_and_equals_reference(fleet: Fleet) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather in Paris, and the time in CET?"},
    ]
    # (stream, forced calls or None for a free answer): parallel calls, a tool-result turn, one call streamed, another
    # tool-result turn.
    plan = [(False, TWO_CALLS), (True, None), (True, ONE_CALL), (False, None)]
    pulled_on_tool_results = []
    # Forced calls come out a character per token, which the next prompt re-encodes in fewer tokens: D's blocks match
    # the next prompt up to the call. P's own cache is bypassed so that the pull of that prefix shows.
    headers = {contracts.P_CACHE_HEADER: contracts.SWITCH_OFF}
    for i, (stream, calls) in enumerate(plan):
        extra = {**forced_tool_calls(calls), "max_tokens": TOOL_MAX_TOKENS * len(calls) // 2} if calls else {"tools": TOOLS}
        before = fleet.pulled()
        got = ask(fleet.url, messages, stream, headers=headers, **extra)
        after = fleet.pulled()
        want = ask(fleet.ref.url, messages, False, **extra)
        assert seen(got) == seen(want), f"turn {i}: {got} != reference {want}"
        if calls:
            assert got["finish"] == "tool_calls" and len(got["message"]["tool_calls"]) == len(calls)
            tool_results(messages, got["message"])
        else:
            pulled_on_tool_results.append(after - before)
            messages.append(got["message"])
            messages.append({"role": "user", "content": "Thanks. And in Rome?"})
    # The turns that carry tool results were prefilled from D's KV (the router kept D's params after tool_calls).
    assert all(n >= 512 for n in pulled_on_tool_results), pulled_on_tool_results


def common_blocks(a: list[int], b: list[int]) -> int:
    """Tokens in the whole blocks that two token sequences share from their start."""
    n = len(os.path.commonprefix([a, b]))  # works on any sequences, token lists too
    return n - n % BLOCK


def test_reasoning_dropped_by_the_client_is_a_partial_hit_cut_by_the_connector(fleet: Fleet) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Think it through first: which node holds the cache blocks after a turn, and for how long?"},
    ]
    thought = forced_reasoning("D keeps its blocks for the ttl, so P can pull them next turn.", "The decode node holds them.")
    headers = {contracts.P_CACHE_HEADER: contracts.SWITCH_OFF}  # P's own cache bypassed: what P pulls shows
    # Answers after a thought are not forced: wrong KV would show in them (token for token).
    free = {"chat_template_kwargs": thought["chat_template_kwargs"], "max_tokens": 24, "return_token_ids": True}
    # First the client drops the thought from the history it sends back, as most clients do; then one keeps it, which
    # this template (like most) does not render for past turns: either way the next prompt lacks the thought D's KV holds.
    for keep in (False, True):
        # A streamed turn: the model thinks, then answers (both forced, so D's reply has a real reasoning part).
        first = ask(fleet.url, messages, True, headers=headers, max_tokens=120, **thought)
        want = ask(fleet.ref.url, messages, False, max_tokens=120, return_token_ids=True, **thought)
        assert seen(first) == seen(want) and first["message"].get("reasoning"), first
        # D's KV holds that prompt and everything the model wrote, the thought included (all but the last token).
        d_tokens = (want["prompt_ids"] + want["output_ids"])[:-1]
        sent_back = first["message"] if keep else {"role": "assistant", "content": first["message"]["content"]}
        messages += [sent_back, {"role": "user", "content": "and after the ttl?"}]

        outcomes = {o: fleet.router_metric("bpdkv_router_reuse_total", outcome=o) for o in ("hit", "partial")}
        cuts = fleet.router_metric("bpdkv_router_pull_outcomes_total", outcome="cut")
        before = fleet.pulled()
        got = ask(fleet.url, messages, False, headers=headers, **free)
        pulled = fleet.pulled() - before
        want = ask(fleet.ref.url, messages, False, **free)
        assert seen(got) == seen(want) and got["output_ids"] == want["output_ids"], f"keep={keep}: {got} != reference {want}"
        # P pulled the blocks its prompt shares with D's KV, and nothing after them: the thought D holds was not read.
        prompt = want["prompt_ids"]
        shared = common_blocks(prompt[: len(prompt) - 1], d_tokens)
        assert 0 < shared < len(d_tokens) - len(d_tokens) % BLOCK, (keep, shared, len(d_tokens))
        assert pulled == shared, (keep, pulled, shared, len(d_tokens), fleet.decisions())
        assert fleet.router_metric("bpdkv_router_pull_outcomes_total", outcome="cut") == cuts + 1
        hits = fleet.router_metric("bpdkv_router_reuse_total", outcome="hit") - outcomes["hit"]
        partials = fleet.router_metric("bpdkv_router_reuse_total", outcome="partial") - outcomes["partial"]
        if not keep:
            assert (hits, partials) == (0, 1), "a dropped thought is a partial hit, never a hit"
        else:
            # The router cannot see whether the template renders a kept thought: it predicts a hit (sessions.py), and
            # P's "cut" cannot settle it (P cuts at most turns' tail too); what P really did is in the pull outcome.
            assert (hits, partials) == (1, 0)
        messages += [got["message"], {"role": "user", "content": "Think again: and the prefill node?"}]


def test_a_turn_p_reads_nothing_for_is_a_miss_not_a_hit(fleet: Fleet) -> None:
    """P's own prefix cache covers every whole block D offers (turn 1 answered in one token, so D's KV is the prompt P
    has just computed): P reads nothing of D's, says so (`bpdkv_pulled_tokens` 0), and the router counts a miss — a hit
    only when P really read D's blocks (before the count it took the lookup's prediction, a hit)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "In one word: which node decodes?"},
    ]
    first = ask(fleet.url, messages, False, max_tokens=1)  # P's cache on: it keeps the prompt's blocks
    messages += [first["message"], {"role": "user", "content": "and which one prefills?"}]
    outcomes = ("hit", "partial", "miss")
    before = {o: fleet.router_metric("bpdkv_router_reuse_total", outcome=o) for o in outcomes}
    pulled = fleet.pulled()
    got = ask(fleet.url, messages, False, return_token_ids=True)
    want = ask(fleet.ref.url, messages, False, return_token_ids=True)
    assert seen(got) == seen(want) and got["output_ids"] == want["output_ids"], (got, want)
    assert fleet.pulled() == pulled, "P read D's blocks: its own cache should have covered them"
    delta = {o: fleet.router_metric("bpdkv_router_reuse_total", outcome=o) - before[o] for o in outcomes}
    assert delta == {"hit": 0, "partial": 0, "miss": 1}, (delta, fleet.decisions())


def test_decode_restart_between_turns_is_invisible_to_the_client(fleet: Fleet) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "explain the decode node in detail"},
    ]
    first = ask(fleet.url, messages, False, max_tokens=24)
    messages += [first["message"], {"role": "user", "content": "and what does the prefill node pull from it?"}]
    fallbacks = fleet.router_metric("bpdkv_router_reuse_fallbacks_total")
    fenced = {o: fleet.router_metric("bpdkv_router_pull_outcomes_total", outcome=o) for o in FENCE_REFUSALS}
    # D restarts on its port: a new engine; the blocks the router knows of are gone, and no health check told it.
    fleet.d.stop()
    fleet.d.start().wait()
    headers = {contracts.P_CACHE_HEADER: contracts.SWITCH_OFF}  # P's own cache bypassed: P must pull or compute
    got = ask(fleet.url, messages, True, headers=headers, max_tokens=24)
    want = ask(fleet.ref.url, messages, False, max_tokens=24)
    assert seen(got)[:2] == seen(want)[:2]
    # Either P's read fence found D's hold gone and P computed locally, or (a plugin without the fence) P failed the
    # pull and the router served the turn again without D's params: exactly one of them, once.
    refused = sum(fleet.router_metric("bpdkv_router_pull_outcomes_total", outcome=o) - n for o, n in fenced.items())
    fell_back = fleet.router_metric("bpdkv_router_reuse_fallbacks_total") - fallbacks
    assert (refused, fell_back) in ((1, 0), (0, 1)), f"fence refusals {refused}, retries without D's params {fell_back}"
    # And reuse works again with the new D.
    messages += [got["message"], {"role": "user", "content": "summarise it"}]
    before = fleet.pulled()
    again = ask(fleet.url, messages, False, headers=headers, max_tokens=24)
    assert seen(again)[:2] == seen(ask(fleet.ref.url, messages, False, max_tokens=24))[:2]
    assert fleet.pulled() - before >= 32


def test_short_turns_continue_on_d_and_a_long_one_pulls_through_p(fleet: Fleet) -> None:
    """Per-turn paths (router/paths.py) on real vLLM: a turn carrying a long tool result goes through P, which pulls the
    history from D; the short turn after it goes straight to D, which computes only the new tokens on top of its own
    prefix cache — P receives nothing for it — and every answer equals the reference, token for token (JSON) and
    streamed. A short turn right after a local one continues on D only if D's plugin held that turn again."""
    url = fleet.paths_url
    computed_on_d = ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"})
    hits_on_d = ("vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"})

    def router(name: str, **labels: str) -> float:
        return metric_value(httpx.get(url + "/metrics", timeout=10).text, name, labels)

    def on_p() -> float:
        return fleet.server_metric(fleet.p.url, "vllm:prompt_tokens_total")

    free = {"tools": TOOLS, "max_tokens": 16, "return_token_ids": True}
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris, please."}]
    first = ask(url, messages, False, **forced_tool_calls(ONE_CALL), max_tokens=TOOL_MAX_TOKENS)
    assert seen(first) == seen(ask(fleet.ref.url, messages, False, **forced_tool_calls(ONE_CALL), max_tokens=TOOL_MAX_TOKENS))
    messages.append(first["message"])
    # "Long" at this scale: over the router's 64 (bytes / 3 + 8 per message + one 32-token block); the tiny model's
    # context (1024) holds the tools, the forced call and every turn.
    long_turns = [
        {
            "role": "tool",
            "tool_call_id": first["message"]["tool_calls"][0]["id"],
            "content": "Paris: sunny, 21 degrees, light wind from the west, no rain expected today.",
        },
        {"role": "user", "content": "Here is the Rome forecast: sunny, 19 degrees, light wind from the north, no rain."},
    ]
    for round_, (long_turn, question, stream) in enumerate(
        zip(long_turns, ("Thanks. And in Rome?", "And tomorrow?"), (False, True), strict=True)
    ):
        messages.append(long_turn)
        pulled, local = fleet.pulled(), router("bpdkv_router_paths_total", path="decode_local")
        # P's own cache bypassed (as in the tool test above): what P takes from D shows as a pull.
        got = ask(url, messages, False, headers={contracts.P_CACHE_HEADER: contracts.SWITCH_OFF}, **free)
        want = ask(fleet.ref.url, messages, False, **free)
        assert seen(got) == seen(want) and got["output_ids"] == want["output_ids"], (round_, got, want)
        assert router("bpdkv_router_paths_total", path="decode_local") == local, "a long turn went to D"
        if round_ == 0:  # D held the previous (P/D) turn: P pulled the history from it
            assert router("bpdkv_router_paths_total", path="prefill_pull") == 1 and fleet.pulled() > pulled
        messages += [got["message"], {"role": "user", "content": question}]
        p_before, local = on_p(), router("bpdkv_router_paths_total", path="decode_local")
        d_computed = fleet.server_metric(fleet.d.url, computed_on_d[0], **computed_on_d[1])
        d_hits = fleet.server_metric(fleet.d.url, hits_on_d[0], **hits_on_d[1])
        missing = router("bpdkv_router_d_params_missing_total")
        got = ask(url, messages, stream, **(free if not stream else {"tools": TOOLS, "max_tokens": 16}))
        want = ask(fleet.ref.url, messages, False, **free)
        assert seen(got) == seen(want), (round_, got, want)
        if not stream:
            assert got["output_ids"] == want["output_ids"], (round_, got, want)
        assert router("bpdkv_router_paths_total", path="decode_local") == local + 1, round_
        assert on_p() == p_before, "P received a turn that continued on D"
        computed = fleet.server_metric(fleet.d.url, computed_on_d[0], **computed_on_d[1]) - d_computed
        hits = fleet.server_metric(fleet.d.url, hits_on_d[0], **hits_on_d[1]) - d_hits
        prompt = len(want["prompt_ids"])
        assert hits >= prompt - 3 * BLOCK and computed <= 3 * BLOCK, (round_, prompt, hits, computed)  # D's cache had it
        messages.append(got["message"])
        held_again = router("bpdkv_router_d_params_missing_total") == missing  # D returned where it holds that turn
    # One more short turn right after the local one: D continues it only if its plugin held the local turn again.
    messages.append({"role": "user", "content": "Thanks!"})
    local = router("bpdkv_router_paths_total", path="decode_local")
    got = ask(url, messages, False, **free)
    assert got["output_ids"] == ask(fleet.ref.url, messages, False, **free)["output_ids"]
    print(f"\nafter a local turn D held again: {held_again}")
    assert router("bpdkv_router_paths_total", path="decode_local") == local + (1 if held_again else 0)
