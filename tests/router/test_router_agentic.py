"""Agentic traffic through the router (emulated P/D test doubles): tool-call turns keep reuse, failures of reuse never
reach the client, session ids cannot be taken over, reasoning traces dropped by the client count as partial hits."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

from bpdkv import contracts
from bpdkv.router.relay import Reply
from bpdkv.router.sessions import Reuse, identify, settle, to_store
from bpdkv.testing.vllm_emulator import FABRIC, hermes_block, literal_regex
from tests.router.helpers import SYSTEM, chat, conversation

CHAT = "/v1/chat/completions"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


def force_calls(*calls: tuple[str, str]) -> dict[str, Any]:
    """Make the emulated model write these Hermes tool calls (a literal structured-outputs regex)."""
    return {"structured_outputs": {"regex": literal_regex("\n".join(hermes_block(name, args) for name, args in calls))}}


def ask(url: str, messages: list[dict[str, Any]], stream: bool, **extra: Any) -> Reply:
    body = {"model": "emulated", "messages": messages, "max_tokens": 200, "stream": stream, "tools": TOOLS, **extra}
    if not stream:
        resp = httpx.post(url + CHAT, json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        return Reply.of(resp.json())
    with httpx.stream("POST", url + CHAT, json=body, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        return Reply.of(list(resp.iter_lines()))


def agent(url: str, stream: bool) -> list[str]:
    """Two tool rounds (the first with parallel calls), then an answer; returns what the client saw each turn."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris, and the time?"}]
    seen = []
    rounds = [[("get_weather", '{"city": "Paris"}'), ("get_time", "{}")], [("get_weather", '{"city": "Lyon"}')], []]
    for calls in rounds:
        reply = ask(url, messages, stream, **(force_calls(*calls) if calls else {}))
        message = reply.message()
        seen.append(json.dumps([message["content"], [c["function"] for c in message.get("tool_calls", [])]]))
        messages.append(message)
        if calls:
            assert reply.finish_reason == "tool_calls"
            for i, call in enumerate(message["tool_calls"]):
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"result {i} of {call['function']['name']}"})
    return seen


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_turns_reuse_decode_kv(fleet_factory, reference, stream: bool) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(p_settings={"prefix_caching": False})
    got = agent(fleet.url, stream)
    assert got == agent(reference, stream)
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 2  # both tool-result turns pulled D's KV
    p = fleet.prefill[0]
    assert p.counters["prompt_tokens:external_kv_transfer"] > 0
    assert p.counters.get("emulator_wrong_kv_tokens", 0) == 0


def test_pull_failure_is_retried_without_d_params(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    """D lost its blocks (restart): P fails the pull with 500; the client still gets the right answer."""
    fleet = fleet_factory(p_settings={"prefix_caching": False})
    d = fleet.decode[0]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    text, _ = chat(fleet.url, messages)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "second question"}]
    # D restarts: a new engine, nothing held. The router does not know yet.
    FABRIC.pop(d.engine_id, None)
    d.engine_id = uuid.uuid4().hex
    FABRIC[d.engine_id] = d
    d.held.clear()
    text2, resp = chat(fleet.url, messages)
    ref, _ = chat(reference, messages)
    assert text2 == ref, resp
    assert fleet.metric("bpdkv_router_reuse_fallbacks_total", reason="http_500") == 1
    assert fleet.metric("bpdkv_router_upstream_errors_total", role="prefill", upstream="prefill-0", kind="http_500") == 0  # not P's fault
    # The next turn reuses again (D's new engine is learnt from its answer).
    messages += [{"role": "assistant", "content": text2}, {"role": "user", "content": "third"}]
    text3, _ = chat(fleet.url, messages)
    assert text3 == chat(reference, messages)[0]
    # The failed pull's turn got no reuse and is counted so (refused), the next one a hit.
    assert fleet.metric("bpdkv_router_reuse_total", outcome="refused") == 1
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 1


def test_sessions_of_an_unhealthy_decode_are_refused(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(n_decode=2)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    text, _ = chat(fleet.url, messages)
    holder = next(d for d in fleet.decode if d.held)
    holder.healthy = False
    fleet._groups[0].call(fleet.routers[0].check_health_now())  # the routers' server loop
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "second question"}]
    text2, _ = chat(fleet.url, messages)
    assert text2 == chat(reference, messages)[0]
    assert fleet.metric("bpdkv_router_reuse_total", outcome="refused") == 1
    assert fleet.prefill[0].counters.get("nixl_num_kv_expired_reqs", 0) == 0  # never offered to P


def test_a_slow_health_check_keeps_the_decodes_sessions(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    # A D that is only slow to answer /health did not restart: its sessions stay usable. Unhealthy (no new requests)
    # after failures_to_eject slow checks in a row, like failed requests; healthy again on its next answer.
    fleet = fleet_factory(n_decode=2)
    router = fleet.routers[0]
    check = lambda: fleet._groups[0].call(router.check_health_now())  # noqa: E731 - the routers' server loop
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    text, _ = chat(fleet.url, messages)
    index = next(i for i, d in enumerate(fleet.decode) if d.held)
    holder, member = fleet.decode[index], router.decode.members[index]
    holder.health_delay = 3.0  # over check_health_now's 2 s
    check()
    assert member.healthy and member.slow_checks == 1
    holder.health_delay = 0.0
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "second question"}]
    text, _ = chat(fleet.url, messages)
    assert text == chat(reference, messages)[0]
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 1

    holder.health_delay = 3.0
    for _ in range(router.config.health.failures_to_eject):
        check()
    assert not member.healthy  # no answer three times in a row: no new requests go there
    holder.health_delay = 0.0
    check()
    assert member.healthy
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "third question"}]
    text, _ = chat(fleet.url, messages)
    assert text == chat(reference, messages)[0]
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 2  # it never went down: its blocks are there
    assert fleet.metric("bpdkv_router_reuse_total", outcome="refused") == 0

    holder = next(d for d in fleet.decode if d.held)  # the third turn's blocks (the pulled ones were let go)
    holder.healthy = False  # an error answer: down, maybe restarting — its sessions are forgotten when it is back
    check()
    holder.healthy = True
    check()
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "fourth question"}]
    assert chat(fleet.url, messages)[0] == chat(reference, messages)[0]
    assert fleet.metric("bpdkv_router_reuse_total", outcome="refused") == 1


def test_session_id_takeover_refused(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(p_settings={"prefix_caching": False})
    sid = {"X-Session-Id": "conversation-A"}
    mine = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "my question"}]
    text, _ = chat(fleet.url, mine, headers=sid)
    mine += [{"role": "assistant", "content": text}, {"role": "user", "content": "my follow-up"}]
    # Someone else names the same session id with another history: nothing of A's is consumed or overwritten.
    theirs = [{"role": "user", "content": "unrelated"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    chat(fleet.url, theirs, headers=sid)
    assert fleet.metric("bpdkv_router_reuse_total", outcome="mismatch") == 1
    assert fleet.metric("bpdkv_router_sessions_not_stored_total") == 1
    chat(fleet.url, mine, headers=sid)
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 1
    assert fleet.prefill[0].counters.get("emulator_wrong_kv_tokens", 0) == 0


def test_concurrent_branches_of_one_history_each_answer_right(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    from concurrent.futures import ThreadPoolExecutor

    fleet = fleet_factory(p_settings={"prefix_caching": False})
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "root question"}]
    text, _ = chat(fleet.url, base)
    branches = [base + [{"role": "assistant", "content": text}, {"role": "user", "content": f"branch {i}"}] for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda m: chat(fleet.url, m)[0], branches))
    assert got == [chat(reference, m)[0] for m in branches]
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 1  # single use: one branch pulls, the others compute
    assert fleet.prefill[0].counters.get("emulator_wrong_kv_tokens", 0) == 0


@pytest.mark.parametrize(
    ("predicted", "pulled", "fell_back", "settled"),
    [
        (Reuse.HIT, "verified", False, Reuse.HIT),
        (Reuse.HIT, "cut", False, Reuse.HIT),  # P cuts at most turns' tail too: a cut alone is no partial
        (Reuse.PARTIAL, "cut", False, Reuse.PARTIAL),
        (Reuse.HIT, "released", False, Reuse.REFUSED),  # D's read fence: the hold was released
        (Reuse.HIT, "pin_lapsed", False, Reuse.EXPIRED),
        (Reuse.HIT, "expiring", False, Reuse.EXPIRED),
        (Reuse.HIT, "mismatch", False, Reuse.MISMATCH),
        (Reuse.HIT, None, True, Reuse.REFUSED),  # P failed with D's params and ran without them
        (Reuse.HIT, None, False, Reuse.HIT),  # a P without the bpdkv plugin says nothing: the prediction stands
        (Reuse.MISS, "cut", False, Reuse.MISS),  # nothing was offered: P's word cannot make it a reuse
    ],
)
def test_reuse_outcome_settles_on_what_p_did(predicted: Reuse, pulled: str | None, fell_back: bool, settled: Reuse) -> None:
    assert settle(predicted, pulled, fell_back) is settled


@pytest.mark.parametrize(
    ("predicted", "outcome", "read", "settled"),
    [
        (Reuse.HIT, "verified", 128, Reuse.HIT),
        (Reuse.HIT, "cut", 64, Reuse.HIT),  # read part of D's blocks: P cuts at most turns' tail
        (Reuse.PARTIAL, "cut", 64, Reuse.PARTIAL),
        (Reuse.HIT, "cut", 0, Reuse.MISS),  # a cut that read nothing (P's own cache covered it, or under the threshold)
        (Reuse.HIT, "verified", 0, Reuse.MISS),  # P's own prefix cache covered everything D offered
        (Reuse.PARTIAL, "cut", 0, Reuse.MISS),
        (Reuse.HIT, "released", 0, Reuse.REFUSED),  # the fence's word stays more specific than the count
        (Reuse.HIT, "none", None, Reuse.MISS),  # P saw no D location at all
        (Reuse.MISS, "verified", 128, Reuse.MISS),
    ],
)
def test_a_hit_needs_p_to_have_read_d_blocks(predicted: Reuse, outcome: str, read: int | None, settled: Reuse) -> None:
    assert settle(predicted, outcome, False, read) is settled


@pytest.mark.parametrize(("p_cache", "counted"), [(True, "miss"), (False, "hit")])
def test_reuse_counts_what_p_read_not_what_was_offered(fleet_factory, reference, p_cache: bool, counted: str) -> None:  # type: ignore[no-untyped-def]
    """P's own prefix cache holds turn 1's prompt; what D adds (the short answer) is under the recompute threshold, so
    P reads nothing from D: that turn is a miss, not a hit. Without P's cache, P reads the history from D: a hit."""
    # What P read is counted here, not the cost model (its first contact with an unmeasured link computes, issue 34).
    threshold = contracts.PULL_DECISION_THRESHOLD
    fleet = fleet_factory(
        p_settings={"prefill_plugin": True, "report_pulled_tokens": True, "prefix_caching": p_cache, "pull_decision": threshold}
    )
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    text, _ = chat(fleet.url, messages)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "and the second?"}]
    external = fleet.prefill[0].counters.get("prompt_tokens:external_kv_transfer", 0)
    assert chat(fleet.url, messages)[0] == chat(reference, messages)[0]
    read = fleet.prefill[0].counters.get("prompt_tokens:external_kv_transfer", 0) - external
    assert (read > 0) is (counted == "hit")
    assert fleet.metric("bpdkv_router_reuse_total", outcome=counted) == 1
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == (1 if counted == "hit" else 0)


def test_dropped_reasoning_is_a_partial_hit() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    ident = identify(CHAT, "t", body, None, "auto")
    assert ident is not None
    reply = {"role": "assistant", "content": "a", "reasoning_content": "thinking..."}
    key, entry, _ = to_store(ident, body, reply, {"p": 1}, "decode-0", 0.0) or ("", None, False)
    assert entry is not None and entry.reasoning
    dropped = {"messages": [*body["messages"], {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}], "model": "m"}
    kept = {"messages": [*body["messages"], reply, {"role": "user", "content": "q2"}], "model": "m"}
    for follow, outcome in ((dropped, Reuse.PARTIAL), (kept, Reuse.HIT)):
        nxt = identify(CHAT, "t", follow, None, "auto")
        assert nxt is not None and key in nxt.lookup_keys and nxt.covers(entry)
        assert nxt.outcome_of(entry) is outcome
    # A whitespace change of the system prompt is another history: no key in common.
    spaced = identify(
        CHAT,
        "t",
        {"model": "m", "messages": [{"role": "user", "content": "q "}, dropped["messages"][1], dropped["messages"][2]]},
        None,
        "auto",
    )
    assert spaced is not None and key not in spaced.lookup_keys


def test_conversation_still_hits_after_all_this(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory()
    assert conversation(fleet.url, turns=3, stream=True) == conversation(reference, turns=3)
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 2


def test_blocks_decode_let_go_are_never_offered(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    """D's hold budget: D announces (in any later answer) the held blocks it released; the router never offers them."""
    from bpdkv import contracts

    fleet = fleet_factory(p_settings={"prefix_caching": False})
    d = fleet.decode[0]
    mine = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    text, _ = chat(fleet.url, mine)
    (released,) = list(d.held)
    original = d._hold_for_next_turn

    def announcing(*args: Any, **kwargs: Any) -> dict[str, Any]:
        params = original(*args, **kwargs)
        params[contracts.RELEASED_REQUEST_IDS] = [released]
        return params

    d._hold_for_next_turn = announcing  # type: ignore[method-assign]
    chat(fleet.url, [{"role": "user", "content": "another conversation"}])
    d._hold_for_next_turn = original  # type: ignore[method-assign]
    assert fleet.metric("bpdkv_router_released_holds_total") == 1
    mine += [{"role": "assistant", "content": text}, {"role": "user", "content": "second"}]
    chat(fleet.url, mine)
    assert fleet.metric("bpdkv_router_reuse_total", outcome="refused") == 1
    assert fleet.prefill[0].requests[-1]["kv_transfer_params"]["remote_block_ids"] is None


def test_turns_nobody_will_reuse_tell_decode_not_to_hold(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    from bpdkv import contracts

    fleet = fleet_factory()
    chat(fleet.url, [{"role": "user", "content": "x"}], headers={"X-Bpdkv-Reuse": "off"})
    assert fleet.decode[0].requests[-1]["kv_transfer_params"][contracts.HOLD] is False
    chat(fleet.url, [{"role": "user", "content": "y"}])
    assert contracts.HOLD not in fleet.decode[0].requests[-1]["kv_transfer_params"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_last_turn_reuses_but_leaves_nothing_held_or_stored(fleet_factory, reference, stream: bool) -> None:  # type: ignore[no-untyped-def]
    """X-Bpdkv-Last-Turn: the turn still pulls the previous turn's KV; D holds nothing for it, the router stores nothing."""
    from bpdkv import contracts

    fleet = fleet_factory(p_settings={"prefix_caching": False})
    d = fleet.decode[0]
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    text, _ = chat(fleet.url, messages, stream)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "last question"}]
    held_before = set(d.held)
    last, _ = chat(fleet.url, messages, stream, headers={"X-Bpdkv-Last-Turn": "true"})
    assert last == chat(reference, messages, stream)[0]
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 1  # it pulled turn 1's KV
    assert d.requests[-1]["kv_transfer_params"][contracts.HOLD] is False  # D was told not to hold this turn
    assert not set(d.held) - held_before
    assert fleet.metric("bpdkv_router_last_turns_total") == 1
    # A client that goes on after all finds nothing stored for the last turn: a miss, computed, still right.
    messages += [{"role": "assistant", "content": last}, {"role": "user", "content": "one more"}]
    more, _ = chat(fleet.url, messages, stream)
    assert more == chat(reference, messages, stream)[0]
    assert fleet.metric("bpdkv_router_reuse_total", outcome="miss") == 2
