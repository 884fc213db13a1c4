"""The emulator's host-memory tier (opt-in, kv_host_tier_tokens): D over its hold budget demotes holds there instead of
releasing them, a pull of a demoted hold waits for D's reload, and only what the tier cannot keep is announced
released — so conversations past the HBM wall still reuse D's KV through the router, where HBM alone recomputes."""

from __future__ import annotations

from typing import Any

from bpdkv.testing.vllm_emulator import FABRIC
from tests.router.helpers import SYSTEM, chat

# D's KV: 2,000 tokens of 16-token blocks, a hold budget of 30 % (600 tokens): two ~250-token conversations fit.
D_HBM: dict[str, Any] = {"kv_capacity_tokens": 2000, "kv_hold_budget": 0.3}
CONVERSATIONS = 8


def two_turns(url: str, reference: str) -> None:
    """Every conversation's first turn, then every conversation's second: the early holds are over the budget by then."""
    histories = []
    for c in range(CONVERSATIONS):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"conversation {c}: first question"}]
        text, _ = chat(url, messages)
        histories.append([*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}])
    for messages in histories:
        assert chat(url, messages)[0] == chat(reference, messages)[0]


def test_hbm_only_releases_and_recomputes(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(p_settings={"prefix_caching": False}, d_settings=D_HBM)
    two_turns(fleet.url, reference)
    released = fleet.metric("bpdkv_router_reuse_misses_total", cause="released")
    assert released >= CONVERSATIONS - 3, released  # the budget keeps the last few holds only
    assert fleet.decode[0].counters.get("emulator_host_reloads", 0) == 0


def test_the_host_tier_keeps_them_reusable(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(p_settings={"prefix_caching": False}, d_settings={**D_HBM, "kv_host_tier_tokens": 100_000})
    two_turns(fleet.url, reference)
    d = fleet.decode[0]
    assert fleet.metric("bpdkv_router_reuse_misses_total", cause="released") == 0
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == CONVERSATIONS
    assert d.counters["emulator_holds_demoted"] >= CONVERSATIONS - 3
    assert d.counters["emulator_host_reloads"] >= CONVERSATIONS - 3  # the early holds came back from host memory
    assert d.counters["emulator_host_reload_tokens"] > 0
    assert d.held_blocks() <= 2000 // 16 * 0.3 + 1 + 40  # HBM stays near its budget (the newest hold is never demoted)


def test_a_full_tier_drops_the_oldest_and_says_so(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(p_settings={"prefix_caching": False}, d_settings={**D_HBM, "kv_host_tier_tokens": 600})
    two_turns(fleet.url, reference)
    d = fleet.decode[0]
    # one ~420-token hold fits the tier: the others are dropped, announced, and never offered to P again
    assert fleet.metric("bpdkv_router_reuse_misses_total", cause="released") == CONVERSATIONS
    assert sum(len(h.tokens) for h in d.host_tier.values()) <= 600
    assert fleet.prefill[0].counters.get("nixl_num_kv_expired_reqs", 0) == 0  # no P was handed a dropped hold
    assert d.engine_id in FABRIC
