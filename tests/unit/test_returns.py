"""The router's return forecast (router/returns.py): endings read off a request's history, per-ending gap quantiles on
the turn-gap buckets, ending transitions, the pooled turn-gap fallback, and the params D gets."""

from __future__ import annotations

from typing import Any

import pytest

from bpdkv import contracts
from bpdkv.contracts import TurnEnding
from bpdkv.router.metrics import RouterMetrics
from bpdkv.router.returns import BOUNDS, MIN_SAMPLES, ReturnModel, endings, quantile, stamp
from bpdkv.router.sessions import SessionEntry

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
CALL = {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def body(*assistant: str, tools: bool = True) -> dict[str, Any]:
    """A chat history whose assistant turns ended as given ('t' tool calls, 'f' final answer), then the next input."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for kind in assistant:
        if kind == "t":
            messages += [CALL, {"role": "tool", "tool_call_id": "c", "content": "result"}]
        else:
            messages += [{"role": "assistant", "content": "done"}, {"role": "user", "content": "and now?"}]
    return {"messages": messages, **({"tools": TOOLS} if tools else {})}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def entry(stored_at: float) -> SessionEntry:
    return SessionEntry(params={}, expires_at=stored_at + 470, history="h", stored_at=stored_at)


def test_endings_are_read_off_the_history() -> None:
    assert endings(body("t", "t", "f")) == [TurnEnding.TOOL_CALLS, TurnEnding.TOOL_CALLS, TurnEnding.FINAL]
    assert endings(body()) == []
    assert endings({"prompt": "text"}) == []
    assert endings({"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}) == [TurnEnding.FINAL]


def test_quantile_interpolates_inside_the_bucket() -> None:
    counts = [0.0] * len(BOUNDS)
    counts[BOUNDS.index(2.0)] = 10  # all in (1, 2]
    assert quantile(counts, 0.5) == pytest.approx(1.5)
    assert quantile([0.0] * len(BOUNDS), 0.5) is None
    overflow = [0.0] * len(BOUNDS)
    overflow[-1] = 3
    assert quantile(overflow, 0.5) == BOUNDS[-2]  # past the last bucket: its bound, as histogram_quantile answers


def test_each_ending_gets_its_own_quantiles_and_transitions_pick_the_likely_one() -> None:
    clock = Clock()
    model = ReturnModel(RouterMetrics(), clock)
    for _ in range(20):  # tool results come back in ~2 s, a person after a final answer in ~100 s
        model.observe(body("t", "t"), entry(clock.now - 1.7))
        model.observe(body("t", "f"), entry(clock.now - 100))
    got = model.forecast(body("t", "t"), endings(body("t", "t")))
    tool, final = got[TurnEnding.TOOL_CALLS.value], got[TurnEnding.FINAL.value]
    assert 1 < tool[contracts.RETURN_P50] <= 2 and 90 < final[contracts.RETURN_P50] <= 120
    assert tool[contracts.RETURN_P90] >= tool[contracts.RETURN_P50]
    # after tool calls: 20 went on to tool calls, 20 to a final answer → a coin; add evidence for tools
    assert got[contracts.RETURN_P_TOOL] == pytest.approx(0.5)
    for _ in range(10):
        model.observe(body("t", "t"), None)  # no stored turn (first offer, expired): the transition still counts
    again = model.forecast(body("t", "t"), endings(body("t", "t")))
    assert again[contracts.RETURN_LIKELY] == TurnEnding.TOOL_CALLS.value and again[contracts.RETURN_P_TOOL] > 0.5
    # without tools offered the turn can only end in an answer
    no_tools = model.forecast(body("t", tools=False), endings(body("t")))
    assert no_tools[contracts.RETURN_LIKELY] == TurnEnding.FINAL.value and no_tools[contracts.RETURN_P_TOOL] == 0


def test_few_returns_of_an_ending_fall_back_to_the_pooled_turn_gaps() -> None:
    clock = Clock()
    metrics = RouterMetrics()
    model = ReturnModel(metrics, clock)
    assert model.forecast(body("t"), endings(body("t")))[TurnEnding.FINAL.value] is None  # nothing measured yet
    for _ in range(10):
        metrics.gap(40.0)  # what the lookup measures for `bpdkv tune` (every ending)
    pooled = model.quantiles(TurnEnding.FINAL)
    assert pooled is not None and 30 < pooled[contracts.RETURN_P50] <= 45 and pooled[contracts.RETURN_SAMPLES] == 10
    for _ in range(int(MIN_SAMPLES) + 1):  # decayed: a little over MIN_SAMPLES observations
        model.observe(body("f"), entry(clock.now - 500))
    own = model.quantiles(TurnEnding.FINAL)
    assert own is not None and own[contracts.RETURN_P50] > 480  # its own returns once there are enough


def test_old_returns_decay() -> None:
    clock = Clock()
    model = ReturnModel(RouterMetrics(), clock)
    for _ in range(3000):
        model.observe(body("t"), entry(clock.now - 100))
    for _ in range(3000):
        model.observe(body("t"), entry(clock.now - 1.5))
    q = model.quantiles(TurnEnding.TOOL_CALLS)
    assert q is not None and q[contracts.RETURN_P50] <= 2  # the traffic of now, not of the start


def test_stamp_and_the_turn() -> None:
    clock = Clock()
    model = ReturnModel(RouterMetrics(), clock)
    assert model.turn(body("t"), None, hold=False) is None  # D holds nothing: no forecast
    forecast = model.turn(body("t"), None, hold=True)
    assert forecast is not None and set(forecast) == {"tool_calls", "final", contracts.RETURN_LIKELY, contracts.RETURN_P_TOOL}
    params = {contracts.REMOTE_ENGINE_ID: "p"}
    stamped = stamp(params, forecast)
    assert stamped == {**params, contracts.RETURN_FORECAST: forecast} and params == {contracts.REMOTE_ENGINE_ID: "p"}
    assert stamp(None, forecast) is None and stamp(params, None) is params
