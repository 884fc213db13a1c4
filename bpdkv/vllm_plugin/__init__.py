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
