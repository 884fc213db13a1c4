"""Retry of NIXL's side-channel handshake on a receive timeout (used by BpdkvNixlConnector; no vLLM import)."""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger("bpdkv.vllm_plugin")

DEFAULT_ATTEMPTS = 3


def retrying(handshake: Any, attempts: int) -> Any:
    """Upstream gives a NIXL side-channel handshake one try with a fixed 5 s receive timeout; a D busy enough to answer
    late fails every request waiting on it. Each retry opens a fresh socket (upstream's call does), so a late answer to
    an abandoned one is dropped. Only timeouts are retried: a refused handshake (compatibility hash) fails at once."""

    @functools.wraps(handshake)
    def retrying(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(1, attempts + 1):
            try:
                return handshake(*args, **kwargs)
            except Exception as exc:
                if type(exc).__name__ != "Again" or attempt == attempts:  # zmq.Again: the receive timed out
                    raise
                log.warning("bpdkv: NIXL handshake timed out (attempt %d of %d); retrying", attempt, attempts)
        raise AssertionError("unreachable")

    return retrying
