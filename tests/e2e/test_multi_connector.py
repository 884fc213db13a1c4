"""bpdkv's connector inside vLLM's MultiConnector, the shape `bpdkv render` gives an instance with a host-memory tier
(bpdkv.render.with_host_tier: bpdkv's NIXL connector first, a second child with kv_role kv_both), on real vLLM-CPU P and
D behind the router. vLLM's OffloadingConnector raises on CPU platforms, so the second child here is vLLM's
ExampleConnector (it stores every request's KV on local disk and loads it back): the MultiConnector machinery is the
same — children chosen per request, stats of every child rebuilt by class name in the API server
(`KVConnectorFactory.get_connector_class_by_name`, which failed every request on GPU while bpdkv's connector was not
registered: issue 46), `kv_transfer_params` merged across children.

A multi-turn conversation, streamed and not, through the router: every answer equals a single server's (greedy), P
pulls D's blocks from turn 2 with digests verified, and neither engine logs an unregistered connector or a traceback.
Three servers for the module (P, D, a reference); ~1 min on 2 cores.

What this cannot show on vllm-cpu 0.32: the by-name lookup that failed on GPU. 0.32's engine hands the API server
its children's stats as objects (the conversation passed here with the registration removed from the plugin), 0.34's
as dicts rebuilt by name; the registration is proven on GPU (benchmarks/results/gpu-h100/vllm-0.34-host-tier) and its
logic in tests/unit/test_vllm_plugin_quiet.py."""

from __future__ import annotations

import json
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bpdkv import contracts
from bpdkv.bench.runner import metric_value
from bpdkv.render import with_host_tier
from bpdkv.router.app import Router
from bpdkv.router.config import HealthSettings, PathSettings, RouterConfig, Timeouts, UpstreamSpec
from bpdkv.testing.vllm_emulator import ServerGroup
from tests.e2e.conftest import VllmServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CHAT = "/v1/chat/completions"
QUESTIONS = [
    "the router plans the cache transfer for the next turn of the agent, explain the history",
    "now the decode engine streams the answer, what does the prefill node pull?",
    "summarise the key value blocks and the tokens of the system in detail",
    "what happens when the tool call result comes back slow?",
]


def multi_config(role: str, storage: Path) -> dict[str, Any]:
    """The rendered host-tier shape around bpdkv's connector, its second child vLLM's ExampleConnector (runs on CPU)."""
    nixl = {
        "kv_connector": "BpdkvNixlConnector",
        "kv_connector_module_path": "bpdkv.vllm_plugin.connector",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            contracts.EXTRA_BIDIRECTIONAL: True,
            contracts.EXTRA_RECOMPUTE_THRESHOLD: 16,
            contracts.EXTRA_BLOCKS_TTL: 120,
            contracts.EXTRA_BACKENDS: ["UCX"],
            # What is pulled is the point here, not the cost model's choice (tests/e2e/test_slow_link.py tests that).
            contracts.EXTRA_PULL_DECISION: contracts.PULL_DECISION_THRESHOLD,
        },
    }
    instance = types.SimpleNamespace(kv_host_memory_gib=1, role="decode" if role == "kv_consumer" else "prefill")
    config = with_host_tier(nixl, instance)  # type: ignore[arg-type]
    children = config["kv_connector_extra_config"][contracts.MULTI_CONNECTORS]
    assert children[0] is nixl and children[1]["kv_role"] == "kv_both"  # the render's order and roles
    children[1] = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage / role)},
    }
    return config


class Fleet:
    def __init__(self, p: VllmServer, d: VllmServer, ref: VllmServer, url: str) -> None:
        self.p, self.d, self.ref, self.url = p, d, ref, url

    def metric(self, server: VllmServer, name: str, **labels: str) -> float:
        return metric_value(httpx.get(server.url + "/metrics", timeout=30).text, name, labels)


@pytest.fixture(scope="module")
def fleet(tiny_model: Path) -> Iterator[Fleet]:
    with tempfile.TemporaryDirectory(prefix="bpdkv-multi-") as tmp:
        logs = Path(tmp)
        servers = [
            VllmServer(name, logs, None, args=("--kv-transfer-config", json.dumps(multi_config(role, logs / "storage"))))
            for name, role in (("multi-prefill", "kv_producer"), ("multi-decode", "kv_consumer"))
        ]
        servers.append(VllmServer("multi-reference", logs, None, plugins=False))
        group: ServerGroup | None = None
        try:
            for server in servers:
                server.wait()
            p, d, ref = servers
            config = RouterConfig(
                prefill=(UpstreamSpec("prefill-0", p.url),),
                decode=(UpstreamSpec("decode-0", d.url),),
                timeouts=Timeouts(connect=5, prefill=120, decode_first_byte=120, decode_idle=120),
                health=HealthSettings(interval=0, failures_to_eject=3, backoff_max=5),
                paths=PathSettings(local_max_tokens=0),
            )
            group = ServerGroup([Router(config).app])
            (url,) = group.start()
            yield Fleet(p, d, ref, url)
        finally:
            if group is not None:
                group.stop()
            for server in servers:
                server.stop()


def ask(url: str, messages: list[dict[str, str]], stream: bool, headers: dict[str, str] | None = None) -> str:
    body = {"model": "tiny", "messages": messages, "max_tokens": 24, "temperature": 0, "stream": stream}
    if not stream:
        resp = httpx.post(url + CHAT, json=body, headers=headers, timeout=180)
        assert resp.status_code == 200, resp.text
        return str(resp.json()["choices"][0]["message"]["content"])
    text = ""
    with httpx.stream("POST", url + CHAT, json=body, headers=headers, timeout=180) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    text += (choice.get("delta") or {}).get("content") or ""
    return text


@pytest.mark.parametrize("first_stream", [False, True], ids=["json-first", "stream-first"])
def test_multi_turn_through_a_multiconnector_equals_a_single_server(fleet: Fleet, first_stream: bool) -> None:
    system = f"You are a helpful assistant for model cache questions ({'stream' if first_stream else 'json'} first)."
    messages = [{"role": "system", "content": system}]
    # P's own cache bypassed: what P reuses of the history must come from D (or be computed), never from P's HBM.
    headers = {contracts.P_CACHE_HEADER: contracts.SWITCH_OFF}
    pulled_per_turn = []
    for i, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        before = fleet.metric(fleet.p, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        got = ask(fleet.url, messages, stream=(i % 2 == 0) == first_stream, headers=headers)
        pulled_per_turn.append(fleet.metric(fleet.p, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - before)
        assert got == ask(fleet.ref.url, messages, stream=False), f"turn {i + 1}"
        messages.append({"role": "assistant", "content": got})
    assert pulled_per_turn[0] == 0 and all(n > 0 for n in pulled_per_turn[1:]), pulled_per_turn
    assert fleet.metric(fleet.p, "vllm:bpdkv_verified_tokens_total") >= sum(pulled_per_turn)
    for server in (fleet.p, fleet.d):
        log = server.log.read_text(errors="replace")
        assert "is not registered" not in log and "Traceback" not in log, server.name
        assert "MultiConnector" in log  # the engine really ran the composed connector
