"""The capacity model against figures computed by hand from the profiles' sizes (GiB = 2**30 bytes).

usable per GPU = memory x 0.9 (vLLM's default gpu_memory_utilization) - 2 GiB activation headroom.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from bpdkv.cli import main
from bpdkv.errors import InvalidTopology
from bpdkv.topology.capacity import gpu_capacity, instance_capacity, smallest_fitting_tp
from bpdkv.topology.model import ModelSpec
from bpdkv.topology.validate import load_topology, validate_document
from bpdkv.topology.yaml_source import parse_yaml

GIB = 2**30
H200 = 140.4  # GiB per GPU (p5en.48xlarge preset)
H100 = 79.6  # GiB per GPU (p5.48xlarge preset)


def _model(profile: str) -> ModelSpec:
    text = f"apiVersion: bpdkv/v1\nname: t\nprofile: {profile}\nnodes: [{{name: a, host: h, hardware: cpu, instances: [{{role: prefill}}, {{role: decode}}, {{role: router}}]}}]\n"
    return validate_document(parse_yaml(text, "t.yaml")).topology.model


def test_gqa_qwen3_32b_on_h200() -> None:
    model = _model("qwen3-32b")
    one = gpu_capacity(model, model.size, H200, tp=1, kv_cache_dtype="auto")  # type: ignore[arg-type]
    # weights 32.8e9 x 2 B = 61.09 GiB; KV 140.4 x 0.9 - 2 - 61.09 = 63.27 GiB
    # per token 2 (K,V) x 64 layers x 8 KV heads x 128 x 2 B = 262,144 B -> 63.27 GiB / 256 KiB = 259,134 tokens
    assert (round(one.weights_gib, 2), round(one.kv_gib, 2), one.kv_bytes_per_token, one.kv_tokens) == (61.09, 63.27, 262_144, 259_134)
    two = gpu_capacity(model, model.size, H200, tp=2, kv_cache_dtype="auto")  # type: ignore[arg-type]
    # tp 2: half the weights (30.55 GiB) and half the KV heads per GPU (131,072 B/token): 93.81 GiB -> 768,512 tokens
    assert (round(two.weights_gib, 2), two.kv_bytes_per_token, two.kv_tokens) == (30.55, 131_072, 768_512)
    sixteen = gpu_capacity(model, model.size, H200, tp=16, kv_cache_dtype="auto")  # type: ignore[arg-type]
    # 8 KV heads over 16 ranks: every rank keeps one head (vLLM replicates), 2 x 64 x 1 x 128 x 2 = 32,768 B
    assert sixteen.kv_bytes_per_token == 32_768


def test_dense_llama_70b_on_h100_needs_tp_4() -> None:
    model = _model("llama-3.3-70b-instruct")
    one, two, four = (gpu_capacity(model, model.size, H100, tp, "auto") for tp in (1, 2, 4))  # type: ignore[arg-type]
    # tp 1: 70.6e9 x 2 B = 131.50 GiB of weights > 79.6 x 0.9 - 2 = 69.64 GiB usable
    assert round(one.weights_gib, 2) == 131.5 and not one.weights_fit and one.kv_tokens == 0
    # tp 2: 65.75 GiB weights leave 3.89 GiB = 25,484 tokens at 163,840 B/token: less than max_model_len 131,072
    assert (two.kv_bytes_per_token, two.kv_tokens) == (163_840, 25_484)
    # tp 4: 32.88 GiB weights, 36.76 GiB KV at 81,920 B/token = 481,877 tokens
    assert (four.kv_bytes_per_token, four.kv_tokens) == (81_920, 481_877)
    assert smallest_fitting_tp(model, H100, 8) == 4


def test_mla_glm5_fp8_on_h200() -> None:
    model = _model("glm-5-fp8")
    cap = gpu_capacity(model, model.size, H200, tp=8, kv_cache_dtype="fp8")  # type: ignore[arg-type]
    # weights 744e9 x 1 B / 8 = 86.61 GiB; KV 124.36 - 86.61 = 37.75 GiB
    # MLA: 78 layers x (512 latent + 64 rope) x 1 B (fp8) = 44,928 B per token on every rank -> 902,121 tokens
    assert (round(cap.weights_gib, 2), round(cap.kv_gib, 2), cap.kv_bytes_per_token, cap.kv_tokens) == (86.61, 37.75, 44_928, 902_121)
    # The latent is not split over TP: tp 4 would not shrink the per-token bytes (weights do not fit anyway).
    assert gpu_capacity(model, model.size, H200, tp=4, kv_cache_dtype="fp8").kv_bytes_per_token == 44_928  # type: ignore[arg-type]
    assert smallest_fitting_tp(model, H200, 8) == 8
    assert smallest_fitting_tp(model, H100, 8) is None  # 744 GB of FP8 weights exceed 8 x 69.64 GiB


def test_mla_deepseek_r1_bf16_kv_on_h200() -> None:
    model = _model("deepseek-r1")
    cap = gpu_capacity(model, model.size, H200, tp=8, kv_cache_dtype="auto")  # type: ignore[arg-type]
    # FP8 weights 671e9 x 1 B / 8 = 78.11 GiB; KV 124.36 - 78.11 = 46.25 GiB; kv_cache_dtype auto = bf16 (2 B):
    # 61 layers x (512 + 64) x 2 B = 70,272 B per token -> 706,619 tokens
    assert (round(cap.weights_gib, 2), round(cap.kv_gib, 2), cap.kv_bytes_per_token, cap.kv_tokens) == (78.11, 46.25, 70_272, 706_619)


def test_dense_tiny_model_on_cpu() -> None:
    t = load_topology(Path("examples/local-cpu.yaml")).topology
    node, inst = t.instances("decode")[0]
    cap = instance_capacity(t, node, inst)
    # VLLM_CPU_KVCACHE_SPACE 1 GiB; 2 (K,V) x 2 layers x 2 KV heads x 64 x 4 B (float32) = 2,048 B -> 524,288 tokens
    assert cap is not None and (cap.device, cap.kv_bytes_per_token, cap.kv_tokens) == ("cpu", 2_048, 524_288)


GLM_TP1 = """apiVersion: bpdkv/v1
name: glm
profile: glm-5-fp8
nodes:
  - name: a
    host: 10.0.0.1
    hardware: p5en.48xlarge
    instances:
      - {role: prefill, gpus: [0], tp: 1}
      - {role: decode, gpus: [1], tp: 1}
      - {role: router}
"""


def test_glm5_fp8_tp1_on_p5en_refused_with_one_clear_line(tmp_path: Path) -> None:
    path = tmp_path / "glm.yaml"
    path.write_text(GLM_TP1)
    with pytest.raises(InvalidTopology) as info:
        load_topology(path, "glm.yaml")
    lines = info.value.lines()
    assert len(lines) == 2  # prefill and decode, one line each
    assert lines[0] == (
        "glm.yaml:9:9: nodes[0].instances[0]: prefill 'prefill-0' (tp 1 on H200-141GB): weights need 692.9 GiB per GPU but "
        "124.4 GiB is usable (140.4 GiB x gpu_memory_utilization 0.9 - 2 GiB activation headroom); use tp 8 or more"
    )


def test_sequence_that_does_not_fit_refused(tmp_path: Path) -> None:
    path = tmp_path / "llama.yaml"
    path.write_text(
        GLM_TP1.replace("glm-5-fp8", "llama-3.3-70b-instruct")
        .replace("p5en", "p5")
        .replace("gpus: [0], tp: 1", "gpus: [0, 1], tp: 2")
        .replace("gpus: [1], tp: 1", "gpus: [2, 3], tp: 2")
    )
    with pytest.raises(InvalidTopology) as info:
        load_topology(path, "llama.yaml")
    assert "KV cache holds 25,484 tokens" in info.value.lines()[0] and "max_model_len 131,072" in info.value.lines()[0]
    assert "use tp 4 or more" in info.value.lines()[0]


def test_gpu_memory_utilization_from_extra_args(tmp_path: Path) -> None:
    path = tmp_path / "q.yaml"
    path.write_text(
        GLM_TP1.replace("glm-5-fp8", "qwen3-32b").replace(
            "{role: decode, gpus: [1], tp: 1}", '{role: decode, gpus: [1], extra_args: ["--gpu_memory_util=0.6"]}'
        )
    )
    t = load_topology(path).topology
    node, decode = t.instances("decode")[0]
    cap = instance_capacity(t, node, decode)
    # 140.4 x 0.6 - 2 - 61.09 = 21.15 GiB -> 86,610 tokens at 262,144 B
    assert cap is not None and cap.gpu_memory_utilization == 0.6 and cap.kv_tokens == 86_610


def test_validate_json_prints_the_figures(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["validate", "examples/p5-glm5-fp8.yaml", "--output", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    decode = next(c for c in report["capacity"] if c["instance"] == "decode-0")
    assert (decode["tp"], decode["kv_tokens"], decode["weights_gib"], decode["activation_headroom_gib"]) == (8, 902_121, 86.61, 2.0)


def test_profiles_show_prints_the_figures() -> None:
    result = CliRunner().invoke(main, ["profiles", "show", "glm-5-fp8"])
    assert result.exit_code == 0
    assert "p5en.48xlarge" in result.output and "tp 8: weights 86.6 GiB/GPU" in result.output and "902,121 tokens" in result.output
    assert "p5.48xlarge: no tp up to 8 GPUs fits" in result.output


HOLD = """apiVersion: bpdkv/v1
name: hb
profile: qwen3-32b
kv_transfer: {kv_hold_budget: 0.9}
nodes:
  - name: a
    host: 10.0.0.1
    hardware: p5en.48xlarge
    instances:
      - {role: prefill, gpus: [0]}
      - {role: decode, gpus: [1]}
      - {role: decode, gpus: [2], kv_hold_budget: 0.2}
      - {role: router}
"""


def test_hold_budget_warning_and_rendering(tmp_path: Path) -> None:
    from bpdkv.render import render_topology

    path = tmp_path / "hb.yaml"
    path.write_text(HOLD)
    result = load_topology(path, "hb.yaml")
    # 0.9 of 259,134 tokens held leaves 25,913 for live requests: fewer than two 32,768-token sequences.
    (warning,) = [w for w in result.warnings if "hold budget" in w.message]
    assert warning.line == 11 and "hold budget 0.9 leaves 25,913 of 259,134 KV tokens" in warning.message
    t = result.topology
    caps = {i.name: instance_capacity(t, n, i) for n, i in t.instances() if i.role != "router"}
    assert caps["decode-1"].hold_budget == 0.2 and caps["decode-1"].live_tokens == 207_307  # type: ignore[union-attr]
    assert caps["prefill-0"].hold_budget is None  # type: ignore[union-attr]
    scripts = {a.instance: a.content for a in render_topology(t) if a.path.endswith(".sh")}
    assert '"bpdkv_hold_budget":0.9' in scripts["decode-0"] and '"bpdkv_hold_budget":0.2' in scripts["decode-1"]
    assert "bpdkv_hold_budget" not in scripts["prefill-0"]


def test_hold_budget_defaults_to_the_plugins_and_only_on_decode(tmp_path: Path) -> None:
    from bpdkv.contracts import DEFAULT_HOLD_BUDGET

    path = tmp_path / "hb.yaml"
    path.write_text(
        HOLD.replace("kv_transfer: {kv_hold_budget: 0.9}\n", "").replace(
            "{role: prefill, gpus: [0]}", "{role: prefill, gpus: [0], kv_hold_budget: 0.3}"
        )
    )
    with pytest.raises(InvalidTopology) as info:
        load_topology(path, "hb.yaml")
    assert info.value.lines() == [
        "hb.yaml:9:36: nodes[0].instances[0].kv_hold_budget: kv_hold_budget applies to decode instances only; remove it from prefill 'prefill-0'"
    ]
    path.write_text(HOLD.replace("kv_transfer: {kv_hold_budget: 0.9}\n", ""))
    t = load_topology(path).topology
    node, decode = t.instances("decode")[0]
    assert instance_capacity(t, node, decode).hold_budget == DEFAULT_HOLD_BUDGET  # type: ignore[union-attr]


@pytest.mark.parametrize("value", ["1.5", "0", "lots"])
def test_bad_gpu_memory_utilization_refused(tmp_path: Path, value: str) -> None:
    path = tmp_path / "q.yaml"
    path.write_text(
        GLM_TP1.replace("glm-5-fp8", "qwen3-8b").replace(
            "{role: decode, gpus: [1], tp: 1}", f'{{role: decode, gpus: [1], extra_args: ["--gpu-memory-utilization={value}"]}}'
        )
    )
    with pytest.raises(InvalidTopology) as info:
        load_topology(path, "q.yaml")
    assert info.value.lines() == [
        f"q.yaml:10:9: nodes[0].instances[1]: decode 'decode-0': --gpu-memory-utilization '{value}' must be a share of GPU memory in (0, 1]"
    ]
