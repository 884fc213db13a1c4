"""NIXL's progress thread waits for events instead of spinning a core (issue 45 item 1).

What spins: NIXL's Python agent (`nixl_agent.__init__`, NIXL 1.x `_api.py`) always sets
`nixlAgentConfig.pthrDelay = 0` and, by default, a progress thread. The UCX backend's shared progress thread
(`nixlUcxSharedThread::run`, `ucx_backend.cpp`) arms its workers and then `poll()`s their event fds with a timeout of
`ceil(pthrDelay µs → ms)`: 0 ms. So it never sleeps — one core per engine process from start-up, holding or not.

Why a delay and not another design:
- The thread is already event-driven: each worker is armed (`ucp_worker_arm`) and its event fd is in the poll set, so
  a peer's READ request, a completion or a notification wakes it at once. The delay is only the poll's *timeout*, a
  periodic wake NIXL keeps as a safety net for fds that UCX fails to signal. A timeout > 0 therefore turns a busy
  spin into a blocking wait without delaying anything that is signalled: D serves a held block's READ as promptly as
  before, and P's own transfers are progressed by the engine thread too (`check_xfer_state` → `progressLoop`).
- No progress thread at all (`enable_prog_thread=False`) would leave D's side of a READ over TCP (the lab, and any
  non-RDMA link) to the engine's step loop, which idles for up to 50 ms between steps while it only holds (idle.py):
  a pull would wait on D's steps. Rejected.
- The plugin's own progress thread would duplicate NIXL's event loop for no gain. Rejected.

How: the agent's constructor is NIXL's, so the delay is applied where it hands the config to the native agent: the
`nixlBind` name in the agent's module is replaced by a thin proxy whose `nixlAgent(name, config)` sets `pthrDelay`
first and forwards everything else untouched. Found by feature (the module global, `nixlAgent`, `pthrDelay`); a NIXL
without them keeps its own behaviour and the start-up log says so. Configured per engine by
`kv_connector_extra_config.bpdkv_nixl_progress_delay_us` (0: NIXL's busy spin). Imports only the standard library.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

log = logging.getLogger("vllm.bpdkv_plugin")

DELAY_KEY = "bpdkv_nixl_progress_delay_us"
# The progress thread's poll timeout: only a safety-net wake (events wake it at once). 10 ms: ~100 empty wakes/s idle.
DEFAULT_DELAY_US = 10_000
AGENT_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api", "nixl_rocm._api")


class _DelayedBindings:
    """NIXL's native bindings module, except that every agent is created with the given progress-thread delay."""

    def __init__(self, real: Any, delay_us: int) -> None:
        self._bpdkv_real = real
        self._bpdkv_delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bpdkv_real, name)

    def nixlAgent(self, name: Any, config: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - NIXL's name
        if getattr(config, "useProgThread", False) and int(getattr(config, "pthrDelay", 0) or 0) < self._bpdkv_delay_us:
            config.pthrDelay = self._bpdkv_delay_us
        return self._bpdkv_real.nixlAgent(name, config, *args, **kwargs)


def _agent_modules() -> list[Any]:
    found = []
    for name in AGENT_MODULES:
        module = sys.modules.get(name)
        if module is None:
            try:
                module = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - that NIXL build is not installed
                continue
        if module not in found:
            found.append(module)
    return found


def install(delay_us: int) -> str:
    """Make NIXL agents created from now on in this process wait `delay_us` at most between progress polls.

    Returns what was done, for the start-up log: "installed", "kept" (already so), "off" (delay 0) or why not."""
    if delay_us <= 0:
        return "off"
    outcome = "no NIXL agent module"
    for module in _agent_modules():
        bindings = getattr(module, "nixlBind", None)
        if bindings is None or not hasattr(bindings, "nixlAgent"):
            outcome = f"{module.__name__} has no nixlBind.nixlAgent"
            continue
        if isinstance(bindings, _DelayedBindings):
            bindings._bpdkv_delay_us = delay_us
            outcome = "kept"
            continue
        config_cls = getattr(bindings, "nixlAgentConfig", None)
        if config_cls is not None and not hasattr(config_cls(), "pthrDelay"):
            outcome = f"{module.__name__}'s agent config has no pthrDelay"
            continue
        module.nixlBind = _DelayedBindings(bindings, delay_us)
        outcome = "installed"
    return outcome


def configure(extra: dict[str, Any]) -> None:
    """From the connector's extra config, before its NIXL agent is created."""
    raw = extra.get(DELAY_KEY, DEFAULT_DELAY_US)
    try:
        delay_us = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{DELAY_KEY} must be a whole number of microseconds (0: NIXL's busy poll), got {raw!r}") from None
    if delay_us < 0:
        raise ValueError(f"{DELAY_KEY} must be ≥ 0 (0: NIXL's busy poll), got {delay_us}")
    outcome = install(delay_us)
    if outcome in ("installed", "kept"):
        log.info("bpdkv: NIXL progress thread waits on events, polling at most every %d µs (%s)", delay_us, DELAY_KEY)
    elif outcome == "off":
        log.info("bpdkv: NIXL progress thread left busy-polling (%s=0)", DELAY_KEY)
    else:
        log.warning("bpdkv: NIXL progress thread may busy-poll a core: %s", outcome)
