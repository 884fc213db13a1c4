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
    _register_connector()
    _bind_cache_manager()


CONNECTOR_NAME = "BpdkvNixlConnector"
CONNECTOR_MODULE = "bpdkv.vllm_plugin.connector"


def _register_connector() -> None:
    """vLLM looks connectors up by name where no module path is at hand: MultiConnector rebuilds its children's stats
    from their class names in the API server's output handler (`build_kv_connector_stats` →
    `KVConnectorFactory.get_connector_class_by_name`). Unregistered, every request through a MultiConnector holding
    bpdkv's connector failed there (issue 46). Registered lazily: the module is imported only when first asked for."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception:  # noqa: BLE001 - a process without vLLM's KV transfer (a tool): nothing to register
        return
    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and CONNECTOR_NAME in registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)


def bpdkv_connectors(connector: object) -> list[object]:
    """bpdkv's connectors in what the scheduler holds: the connector itself, or the children of a MultiConnector."""
    if connector is None:
        return []
    if getattr(connector, "_bpdkv_unbound", None) is not None:
        return [connector]
    found: list[object] = []
    for child in getattr(connector, "_connectors", None) or ():
        found.extend(bpdkv_connectors(child))
    return found


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
        manager = getattr(self, "kv_cache_manager", None)
        for connector in bpdkv_connectors(getattr(self, "connector", None)):  # inside a MultiConnector too
            if manager is not None and getattr(connector, "_bpdkv_unbound", False):
                connector.bind_kv_cache_manager(manager)  # type: ignore[attr-defined]

    scheduler_cls.__init__ = __init__
    scheduler_cls._bpdkv_binds = True
