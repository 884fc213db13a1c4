"""Cohort planning (bpdkv/deploy/cohorts.py): node shapes in, steps out — properties over random fleets."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bpdkv.deploy.cohorts import Capacity, CohortStep, Slot, StepKind, plan_roll

slot = st.tuples(st.integers(0, 4), st.integers(0, 4)).filter(lambda t: t[0] or t[1])


@st.composite
def fleets(draw):  # type: ignore[no-untyped-def]
    shapes = draw(st.lists(slot, min_size=1, max_size=8))
    spares = draw(st.lists(slot, min_size=0, max_size=2))
    out = [Slot(f"n{i}", p, d) for i, (p, d) in enumerate(shapes)]
    out += [Slot(f"s{i}", p, d, spare=True) for i, (p, d) in enumerate(spares)]
    return out


@settings(max_examples=300, deadline=None)
@given(fleets(), st.integers(1, 4))
def test_every_node_moves_once_and_the_counts_add_up(slots: list[Slot], k: int) -> None:
    roll = plan_roll(slots, "old", "new", k)
    regular = [s for s in slots if not s.spare]
    moved = [n for s in roll.steps if s.kind is StepKind.SPLIT for n in s.nodes]
    assert sorted(moved) == sorted(s.node for s in regular)  # each regular node exactly once
    total = Capacity(sum(s.prefill for s in regular), sum(s.decode for s in regular))
    last = roll.steps[-1].after
    assert last["old"] == Capacity(0, 0) and last["new"] == total  # spares retired at the end
    for step in roll.steps:
        for caps in (step.during, step.after):
            assert all(c.prefill >= 0 and c.decode >= 0 for c in caps.values())
            assert caps["old"].prefill + caps["new"].prefill <= total.prefill + sum(s.prefill for s in slots if s.spare)


@settings(max_examples=300, deadline=None)
@given(fleets(), st.integers(1, 4))
def test_a_step_moves_at_most_k_of_a_role_unless_one_node_holds_more(slots: list[Slot], k: int) -> None:
    by_name = {s.node: s for s in slots}
    for step in plan_roll(slots, "old", "new", k).steps:
        if step.kind is not StepKind.SPLIT:
            continue
        nodes = [by_name[n] for n in step.nodes]
        # A node's P and D cannot be split: one that holds more than k of a role moves whole (alone or with what the
        # new generation still needs of the other role).
        if not any(s.prefill > k for s in nodes):
            assert sum(s.prefill for s in nodes) <= k, step
        if not any(s.decode > k for s in nodes):
            assert sum(s.decode for s in nodes) <= k, step


def avoidable(regular: list[Slot], spares: list[Slot]) -> bool:
    """Some set of nodes holds, with the spares (which start the new generation first), a P and a D and leaves a P and
    a D behind: moved first, it keeps a generation serving throughout."""
    from itertools import combinations

    for size in range(0, len(regular)):
        for moved in combinations(regular, size):
            rest = [s for s in regular if s not in moved]
            new = [*moved, *spares]
            if all(sum(getattr(s, r) for s in group) for group in (new, rest) for r in ("prefill", "decode")):
                return True
    return False


@settings(max_examples=400, deadline=None)
@given(fleets(), st.integers(1, 4))
def test_downtime_exactly_where_no_cohort_can_avoid_it(slots: list[Slot], k: int) -> None:
    regular = [s for s in slots if not s.spare]
    if not (sum(s.prefill for s in regular) and sum(s.decode for s in regular)):
        return  # not a serving fleet to begin with
    roll = plan_roll(slots, "old", "new", k)
    spare_complete = any(s.prefill for s in slots if s.spare) and any(s.decode for s in slots if s.spare)
    if spare_complete:
        assert not roll.downtime  # a spare P and D carry the new generation from the first step
    else:
        assert roll.downtime == (not avoidable(regular, [s for s in slots if s.spare])), roll


def test_two_mixed_nodes_roll_one_at_a_time() -> None:
    roll = plan_roll([Slot("host1", 1, 1), Slot("host2", 1, 1)], "a", "b")
    assert [(s.kind, s.nodes) for s in roll.steps] == [(StepKind.SPLIT, ("host1",)), (StepKind.SPLIT, ("host2",))]
    assert roll.steps[0].during == {"a": Capacity(1, 1), "b": Capacity(0, 0)}
    assert roll.steps[0].after == {"a": Capacity(1, 1), "b": Capacity(1, 1)}
    assert roll.steps[1].during == {"a": Capacity(0, 0), "b": Capacity(1, 1)} and not roll.downtime


def test_p_and_d_nodes_move_in_lockstep() -> None:
    slots = [Slot("p1", 1, 0), Slot("p2", 1, 0), Slot("p3", 1, 0), Slot("d1", 0, 1), Slot("d2", 0, 1), Slot("d3", 0, 1)]
    roll = plan_roll(slots, "a", "b")
    assert [s.nodes for s in roll.steps] == [("p1", "d1"), ("p2", "d2"), ("p3", "d3")]
    assert not roll.downtime


def test_one_p_one_d_without_a_spare_is_downtime_and_a_spare_removes_it() -> None:
    bare = plan_roll([Slot("p", 1, 0), Slot("d", 0, 1)], "a", "b")
    assert bare.downtime and bare.downtime_steps() == [1]
    spared = plan_roll([Slot("p", 1, 0), Slot("d", 0, 1), Slot("s", 1, 1, spare=True)], "a", "b")
    assert [s.kind for s in spared.steps] == [StepKind.SURGE, StepKind.SPLIT, StepKind.RETIRE]
    assert not spared.downtime
    assert spared.steps[-1].after == {"a": Capacity(0, 0), "b": Capacity(1, 1)}


def test_a_resumed_roll_counts_the_nodes_already_moved() -> None:
    roll = plan_roll([Slot("host2", 1, 1)], "a", "b", moved=[Slot("host1", 1, 1)])
    assert [s.nodes for s in roll.steps] == [("host2",)]
    assert roll.steps[0].during == {"a": Capacity(0, 0), "b": Capacity(1, 1)} and not roll.downtime


def test_steps_round_trip_through_json() -> None:
    step = plan_roll([Slot("h1", 1, 1), Slot("h2", 1, 1)], "a", "b").steps[0]
    assert CohortStep.from_json(step.to_json()) == step
