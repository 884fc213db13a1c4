"""D's hold budget (bpdkv/vllm_plugin/hold.py): what D keeps for a pull and what it lets go, without vLLM."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bpdkv.vllm_plugin.hold import Hold, HoldLedger, PinGrant, ReleaseReason, budget_blocks


def h(rid: str, blocks: int, expires_at: float = 100.0) -> Hold:
    return Hold(rid, blocks, blocks * 32, expires_at)


def test_budget_is_a_share_of_the_cache() -> None:
    assert budget_blocks(0.5, 1001) == 500
    assert budget_blocks(0.0, 1000) == 0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="between 0 and 1"):
            budget_blocks(bad, 1000)


def test_over_budget_releases_oldest_first() -> None:
    ledger = HoldLedger(10)
    assert ledger.hold(h("a", 4)) == []
    assert ledger.hold(h("b", 4)) == []
    assert ledger.hold(h("c", 4)) == ["a"]  # 12 > 10: the oldest goes
    assert ledger.held_blocks == 8 and ledger.held_tokens == 256
    assert ledger.hold(h("d", 9)) == ["b", "c"]  # one big hold can push out several
    assert ledger.held_blocks == 9
    assert ledger.take_announcements() == ["a", "b", "c"]
    assert ledger.take_announcements() == []  # each release is announced once


def test_a_hold_larger_than_the_budget_is_not_kept() -> None:
    ledger = HoldLedger(3)
    assert ledger.hold(h("big", 5)) == ["big"]
    assert ledger.held_blocks == 0


def test_pressure_releases_oldest_until_the_need_is_covered() -> None:
    ledger = HoldLedger(100)
    for rid in "abcd":
        ledger.hold(h(rid, 3))
    assert ledger.relieve(5) == ["a", "b"]  # 3 + 3 >= 5
    assert ledger.held_blocks == 6
    assert ledger.relieve(0) == []
    assert ledger.relieve(100) == ["c", "d"]  # never more than what is held
    assert ledger.relieve(1) == []


def test_finished_sending_counts_releases_by_reason() -> None:
    ledger = HoldLedger(8)
    for rid in ("first", "pressure", "pulled", "expired", "router"):
        ledger.hold(h(rid, 2, expires_at=50.0))  # the fifth hold (10 > 8) releases "first" by the budget
    ledger.relieve(1)  # "pressure" is the oldest now
    assert ledger.release("router", ReleaseReason.NOT_OFFERED)
    assert not ledger.release("router", ReleaseReason.NOT_OFFERED)  # already gone
    assert ledger.finished_sending("first", 10.0) is ReleaseReason.BUDGET
    assert ledger.finished_sending("pressure", 10.0) is ReleaseReason.PRESSURE
    assert ledger.finished_sending("router", 10.0) is ReleaseReason.NOT_OFFERED
    assert ledger.finished_sending("pulled", 10.0) is ReleaseReason.PULLED  # before its expiry, not asked: a pull
    assert ledger.finished_sending("expired", 60.0) is ReleaseReason.TTL  # after its expiry, not asked: the TTL
    assert ledger.finished_sending("p-side-request", 10.0) is None  # not a D hold: not counted
    ledger.not_held()
    assert ledger.releases == {
        ReleaseReason.PULLED: 1,
        ReleaseReason.BUDGET: 1,
        ReleaseReason.PRESSURE: 1,
        ReleaseReason.TTL: 1,
        ReleaseReason.NOT_OFFERED: 2,
        ReleaseReason.DECLINED: 0,
    }
    assert ledger.held_blocks == 0
    assert [r.value for r in ReleaseReason] == ["pulled", "budget", "pressure", "ttl", "not_offered", "declined"]


@given(
    budget=st.integers(0, 40),
    ops=st.lists(st.tuples(st.sampled_from(["hold", "relieve", "finish"]), st.integers(0, 12)), max_size=60),
)
def test_held_never_exceeds_the_budget_and_every_release_is_counted_once(budget: int, ops: list[tuple[str, int]]) -> None:
    ledger = HoldLedger(budget)
    alive: list[str] = []
    released: list[str] = []
    for i, (op, n) in enumerate(ops):
        if op == "hold":
            alive.append(f"r{i}")
            released += ledger.hold(h(f"r{i}", n))
        elif op == "relieve":
            released += ledger.relieve(n)
        elif alive:
            ledger.finished_sending(alive.pop(0), 0.0)
        assert ledger.held_blocks <= budget
        assert len(released) == len(set(released))  # a hold is released at most once
    for rid in alive:
        ledger.finished_sending(rid, 0.0)
    assert ledger.held_blocks == 0
    assert sum(ledger.releases.values()) == sum(1 for op, _ in ops if op == "hold")


def test_release_soon_from_the_fence_thread_is_handed_out_by_the_next_tick() -> None:
    """P computed locally (its cost model) and told D's fence: the hold goes at D's next step, counted as declined."""
    ledger = HoldLedger(100)
    ledger.hold(h("a", 2, expires_at=50.0))
    ledger.hold(h("pinned", 2, expires_at=50.0))
    assert isinstance(ledger.pin("pinned", "t", 0.0, 5.0), PinGrant)
    assert ledger.release_soon("a", ReleaseReason.DECLINED)
    assert not ledger.release_soon("a", ReleaseReason.DECLINED) and not ledger.release_soon("never", ReleaseReason.DECLINED)
    assert ledger.release_soon("pinned", ReleaseReason.DECLINED)  # deferred: another reader holds the pin
    assert ledger.tick(1.0) == ["a"]
    assert ledger.tick(10.0) == ["pinned"]  # its pin ended unused
    assert ledger.finished_sending("a", 2.0) is ReleaseReason.DECLINED
    assert ledger.take_announcements()[:2] == ["a", "pinned"]
