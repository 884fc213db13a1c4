"""The router with an emulated reasoning model — the emulator speaking vLLM's recorded reasoning shape (`reasoning_*`
fixtures, test_contract.py) — as a fast twin of the real-vLLM test (tests/e2e/test_router_real_vllm.py): a thought the
client drops from the history it sends back makes the next turn a `partial` reuse, P's connector pulls only the
blocks the new prompt shares with D's KV, and the answer is the reference's."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from bpdkv import contracts
from bpdkv.testing.vllm_emulator import THOUGHT_END, THOUGHT_START, EmulatorSettings, ServerGroup, VllmEmulator, literal_regex
from tests.router.helpers import SYSTEM, chat

BLOCK = 16  # the emulator's default block size
THINKING = {"enable_thinking": True}


@pytest.fixture
def thinking_reference() -> Iterator[str]:
    emu = VllmEmulator(EmulatorSettings(role="both", reasoning_parser=True))
    group = ServerGroup([emu.app])
    (url,) = group.start()
    yield url
    group.stop()


def answer(url: str, messages: list[dict[str, Any]], stream: bool, **extra: Any) -> dict[str, Any]:
    """The assistant message (thought apart) from a JSON answer or a stream's deltas; P's own cache bypassed, so what P
    pulls from D shows whole."""
    headers = {contracts.P_CACHE_HEADER: contracts.SWITCH_OFF}
    _, data = chat(url, messages, stream=stream, headers=headers, chat_template_kwargs=THINKING, **extra)
    if not stream:
        message = data["choices"][0]["message"]
        return {"content": message.get("content"), "reasoning": message.get("reasoning")}
    deltas = [ch.get("delta") or {} for event in data for ch in event.get("choices", [])]
    return {
        "content": "".join(d.get("content") or "" for d in deltas) or None,
        "reasoning": "".join(d.get("reasoning") or "" for d in deltas) or None,
    }


def test_dropped_thought_is_a_partial_hit_and_the_pull_is_cut(fleet_factory, thinking_reference: str) -> None:  # type: ignore[no-untyped-def]
    # The digest cut alone (no cost model: its first contact with D would be a one-block probe, issue 34).
    p_settings = {"prefill_plugin": True, "reasoning_parser": True, "pull_decision": contracts.PULL_DECISION_THRESHOLD}
    fleet = fleet_factory(p_settings=p_settings, d_settings={"reasoning_parser": True})
    prefill = fleet.prefill[0]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Think first: who holds the blocks?"},
    ]
    forced = {"structured_outputs": {"regex": literal_regex(f"{THOUGHT_START}D keeps them for the ttl.{THOUGHT_END}The decode node.")}}
    first = answer(fleet.url, messages, True, max_tokens=200, **forced)
    assert first == {"content": "The decode node.", "reasoning": "D keeps them for the ttl."}
    # D's KV: the prompt and everything the model wrote, the thought included.
    d_tokens = VllmEmulator.chat_tokens(messages) + list(f"{THOUGHT_START}D keeps them for the ttl.{THOUGHT_END}The decode node.".encode())

    messages += [{"role": "assistant", "content": first["content"]}, {"role": "user", "content": "and after the ttl?"}]
    external = prefill.counters.get("prompt_tokens:external_kv_transfer", 0)
    got = answer(fleet.url, messages, False)
    assert got == answer(thinking_reference, messages, False)
    assert fleet.metric("bpdkv_router_reuse_total", outcome="partial") == 1
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 0
    assert fleet.metric("bpdkv_router_pull_outcomes_total", outcome="cut") == 1
    prompt = VllmEmulator.chat_tokens(messages)
    n = len(os.path.commonprefix([prompt[: len(prompt) - 1], d_tokens]))
    shared = n - n % BLOCK
    assert 0 < shared < len(d_tokens) - BLOCK
    assert prefill.counters.get("prompt_tokens:external_kv_transfer", 0) - external == shared
    assert prefill.counters.get("emulator_wrong_kv_tokens", 0) == 0
