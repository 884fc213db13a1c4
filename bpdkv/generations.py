"""Generations: the P and D engines that can pair with each other.

A P and a D pair only when they agree on everything NIXL copies raw (the model, its dtype and KV cache dtype, the block
size), on the connector, and on the vLLM release: upstream's NIXL compatibility hash includes `vllm_version` and its
connector protocol number (15 on 0.33, 16 on 0.34), so every vLLM upgrade breaks pairing. Those values are the
compatibility fingerprint; its digest is the generation. The planner compares fingerprints to find a compatibility
break, render writes the generation into the router config beside every P and D upstream (with what the engine itself
reports, so the router can check it at runtime), and the router pairs P and D only within one generation
(bpdkv/router/generations.py).

One place computes the fingerprint: this module.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from bpdkv.topology.model import Topology


def compat_fingerprint(topology: Topology) -> dict[str, Any]:
    """What P and D must agree on; a change is a compatibility break (a new generation)."""
    return {
        "model": topology.model.id,
        "vllm": topology.vllm.version,
        "vllm_package": topology.vllm.package,
        "dtype": topology.model.dtype,
        "kv_cache_dtype": sorted({i.kv_cache_dtype for _, i in topology.instances() if i.role != "router"}),
        "block_size": sorted({i.block_size for _, i in topology.instances() if i.role != "router"}),
        "connector": topology.kv_transfer.connector,
    }


def generation_id(fingerprint: dict[str, Any]) -> str:
    """The generation's name: a digest of the fingerprint (12 hex digits), the same for equal fingerprints."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]


def router_generation(topology: Topology) -> dict[str, Any]:
    """The router config's entry for this topology's generation: its id, and what its engines report at runtime
    (vLLM's GET /version, and the `root` of GET /v1/models: the --model argument) for the router to check."""
    fingerprint = compat_fingerprint(topology)
    m = topology.model
    return {
        "id": generation_id(fingerprint),
        "vllm": topology.vllm.version,
        "model_root": m.path or m.id,
        "fingerprint": fingerprint,
    }
