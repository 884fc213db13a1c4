"""bpdkv's vLLM node plugin (entry point group `vllm.general_plugins`: `bpdkv = bpdkv.vllm_plugin:register`).

Loaded by every vLLM process. In the API server it makes streaming responses carry the request's final
`kv_transfer_params` (vLLM puts them only in non-streaming bodies); the token-verifying connector is
`bpdkv.vllm_plugin.connector.BpdkvNixlConnector`. Imports only vLLM and the standard library.
"""

from __future__ import annotations

import logging

log = logging.getLogger("bpdkv.vllm_plugin")
_registered = False


def register() -> None:
    """Idempotent: vLLM may call it several times per process."""
    global _registered
    if _registered:
        return
    _registered = True
    from bpdkv.vllm_plugin import streaming

    streaming.install()
    _tolerant_stats()
    _bind_cache_manager()


def _tolerant_stats() -> None:
    """bpdkv's connector adds counters to NIXL's stats; make the base class merge unknown keys instead of failing."""
    from bpdkv.vllm_plugin.compat import StatsBase

    if StatsBase is None or getattr(StatsBase, "_bpdkv_tolerant", False):
        return

    def aggregate(self, other):  # type: ignore[no-untyped-def]
        if other is not None and not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self

    StatsBase.aggregate = aggregate
    StatsBase._bpdkv_tolerant = True


def _bind_cache_manager() -> None:
    """vLLM 0.32 hands connectors the scheduler's KV cache manager; 0.24 does not. The hold budget needs its free-block
    count to release held blocks before a live request waits, so hand it over after the scheduler is built."""
    import importlib

    try:
        module = importlib.import_module("vllm.v1.core.sched.scheduler")
    except Exception:  # noqa: BLE001 - a process without the engine (e.g. a tool): nothing to bind
        return
    scheduler_cls = getattr(module, "Scheduler", None)
    if scheduler_cls is None or getattr(scheduler_cls, "_bpdkv_binds", False):
        return
    original = scheduler_cls.__init__

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        original(self, *args, **kwargs)
        connector = getattr(self, "connector", None)
        manager = getattr(self, "kv_cache_manager", None)
        if manager is not None and getattr(connector, "_bpdkv_unbound", False):
            connector.bind_kv_cache_manager(manager)

    scheduler_cls.__init__ = __init__
    scheduler_cls._bpdkv_binds = True
