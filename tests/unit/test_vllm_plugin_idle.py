"""bpdkv/vllm_plugin/idle.py: an engine that only holds finished requests' KV waits for work instead of stepping."""

from __future__ import annotations

import queue
import sys
import threading
import types
from collections import deque
from typing import Any

import pytest

from bpdkv.vllm_plugin import idle


class FakeScheduler:
    def __init__(self, unfinished: int = 0, held: int = 0, push: bool = False) -> None:
        self.unfinished, self.held = unfinished, held
        self.connector = types.SimpleNamespace(has_pending_push_work=lambda: push)

    def get_num_unfinished_requests(self) -> int:
        return self.unfinished

    def has_requests(self) -> bool:
        return bool(self.unfinished or self.held)


class FakeEngine:
    """The shape of vLLM's EngineCore the patch relies on: an input queue and a step that says whether it ran."""

    def __init__(self, scheduler: FakeScheduler) -> None:
        self.scheduler = scheduler
        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.engines_running = False
        self.batch_queue = None
        self.steps = 0
        self.executed = False

    def _process_engine_step(self) -> bool:
        self.steps += 1
        return self.executed


@pytest.mark.parametrize(
    ("scheduler", "running", "expected"),
    [
        (FakeScheduler(held=2), False, True),  # only holds: waits
        (FakeScheduler(unfinished=1, held=2), False, False),  # a request running or waiting (a remote KV load too)
        (FakeScheduler(), False, False),  # nothing at all: upstream's loop already blocks on its queue
        (FakeScheduler(held=1, push=True), False, False),  # push-mode writes in flight
        (FakeScheduler(held=1), True, False),  # a data-parallel wave drives the engine
    ],
)
def test_holds_only(scheduler: FakeScheduler, running: bool, expected: bool) -> None:
    engine = FakeEngine(scheduler)
    engine.engines_running = running
    assert idle.holds_only(engine) is expected


def test_holds_only_with_async_scheduling() -> None:
    """vLLM's batch queue (async scheduling) keeps the previous empty step in flight while the engine spins: empty
    steps there do not count as work, a step that scheduled tokens does, an entry of another shape keeps the loop."""
    engine = FakeEngine(FakeScheduler(held=1))
    empty, busy = types.SimpleNamespace(total_num_scheduled_tokens=0), types.SimpleNamespace(total_num_scheduled_tokens=5)
    engine.batch_queue = deque([(None, empty, None)])  # type: ignore[assignment]
    assert idle.holds_only(engine) is True
    engine.batch_queue = deque([(None, empty, None), (None, busy, None)])  # type: ignore[assignment]
    assert idle.holds_only(engine) is False
    engine.batch_queue = deque(["unknown"])  # type: ignore[assignment]
    assert idle.holds_only(engine) is False


def test_wait_returns_when_a_request_arrives_or_on_wake() -> None:
    inputs: queue.Queue[Any] = queue.Queue()
    inputs.put("request")
    assert idle.wait_for_input(inputs, 60.0) is True  # already queued: no wait at all
    inputs.get()
    threading.Timer(0.05, inputs.put, args=("request",)).start()
    assert idle.wait_for_input(inputs, 60.0) is True  # a put wakes it (queue.Queue notifies not_empty)
    inputs.get()
    assert idle.wait_for_input(inputs, 0.01) is False  # nothing came: the timeout


def test_wake_from_another_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs: queue.Queue[Any] = queue.Queue()
    monkeypatch.setattr(idle, "_queues", [inputs])
    threading.Timer(0.05, idle.wake).start()
    assert idle.wait_for_input(inputs, 60.0) is True
    idle.wake()  # a wake before the wait is not lost
    assert idle.wait_for_input(inputs, 60.0) is True
    assert idle.wait_for_input(inputs, 0.01) is False


def test_install_patches_the_engine_step_once(monkeypatch: pytest.MonkeyPatch) -> None:
    core = types.ModuleType("vllm.v1.engine.core")

    class EngineCore:  # vLLM 0.32: the loop is the process class's, not EngineCore's
        pass

    class EngineCoreProc(EngineCore, FakeEngine):
        pass

    core.EngineCore = EngineCore  # type: ignore[attr-defined]
    core.EngineCoreProc = EngineCoreProc  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core", core)
    monkeypatch.setattr(idle, "_queues", [])
    monkeypatch.setattr(idle, "IDLE_WAIT_S", 60.0)
    assert idle.install() is True
    patched = EngineCoreProc._process_engine_step
    assert patched is not FakeEngine._process_engine_step
    assert idle.install() is True and EngineCoreProc._process_engine_step is patched  # idempotent

    holding = EngineCoreProc(FakeScheduler(held=1))
    threading.Timer(0.05, holding.input_queue.put, args=("request",)).start()
    assert holding._process_engine_step() is False  # waited for the request (not 60 s), then returned the step's result
    assert holding.steps == 1 and idle._queues == [holding.input_queue]

    busy = EngineCoreProc(FakeScheduler(unfinished=1))
    busy.executed = True
    assert busy._process_engine_step() is True  # a step that ran the model never waits


def test_install_without_the_engine_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    core = types.ModuleType("vllm.v1.engine.core")
    core.EngineCore = type("EngineCore", (), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core", core)
    assert idle.install() is False
    assert not hasattr(core.EngineCore, "_bpdkv_idle")  # type: ignore[attr-defined]
