"""A vLLM release carries the NIXL (with its UCX) it was tested with and vLLM's own exact cutlass pin: plan, install
command and wheelhouse of a 0.34 profile all name one NIXL version and `nvidia-cutlass-dsl[cu13]==4.8.0` (issue 42 item 4)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from bpdkv.deploy import bootstrap
from bpdkv.deploy.bootstrap import (
    CUTLASS_DSL,
    RELEASES,
    build_wheelhouse,
    install_command,
    package_changes,
    platform_tags,
    vllm_requirements,
)
from bpdkv.deploy.fleet import connect, plan_topology
from bpdkv.topology.profiles import list_profiles, load_profile
from bpdkv.topology.validate import load_topology
from tests.conftest import ROOT

EXAMPLE_034 = ROOT / "examples" / "p5en-qwen3-32b.yaml"  # profile qwen3-32b: vLLM 0.34.0
CUTLASS_PIN = "nvidia-cutlass-dsl[cu13]==4.8.0"  # vLLM 0.34.0's METADATA Requires-Dist, read from its wheel


def topology_with(tmp_path: Path, **changes: Any):  # type: ignore[no-untyped-def]
    doc = yaml.safe_load(EXAMPLE_034.read_text())
    for section, values in changes.items():
        doc.setdefault(section, {}).update(values)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_topology(path).topology


def test_every_gpu_and_cpu_profile_release_has_its_tested_nixl() -> None:
    for ref in list_profiles("models"):
        vllm = load_profile(ref).data.get("vllm", {})
        key = (vllm.get("package", "vllm"), vllm["version"])
        assert key in RELEASES, f"{ref.name}: vLLM {key} has no tested NIXL recorded in bootstrap.RELEASES"


def test_the_plan_of_a_034_profile_installs_one_named_nixl_version() -> None:
    plan, _ = plan_topology(str(EXAMPLE_034), True, 1, connect(), (), None)
    lines = [p.line for h in plan.hosts for p in h.packages if p.name == "nixl"]
    assert len(lines) == 2 and set(lines) == {"nixl: (none) → 1.5.1 (tested with vllm 0.34.0; UCX 1.23.0 inside)"}, lines
    assert not any("newest release" in line or "not set" in line for h in plan.hosts for line in (p.line for p in h.packages))


def test_the_install_names_exact_pins_and_no_bare_name() -> None:
    topology = load_topology(EXAMPLE_034).topology
    assert vllm_requirements(topology) == ["vllm==0.34.0", "nixl==1.5.1", CUTLASS_PIN]
    command = install_command(topology, topology.nodes[0], "/w/bpdkv.whl", offline=True)
    words = next(line for line in command.splitlines() if "pip install" in line and "--force-reinstall" not in line).split()
    assert "nixl==1.5.1" in words and f"'{CUTLASS_PIN}'" in words
    assert "nixl" not in words and CUTLASS_DSL not in words


def test_the_wheelhouse_of_a_034_fleet_downloads_the_pins_for_every_compatible_platform_tag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """build_wheelhouse runs pip download; here pip is replaced by a recorder that writes the wheels the real resolution
    of `nixl==1.5.1 nvidia-cutlass-dsl[cu13]==4.8.0` for cp312/manylinux_2_28 gives (pip install --dry-run --report,
    2026-12-05): one NIXL version in three wheels, the cutlass DSL with its cu13 libs (its base also requires the cu12 libs)."""
    topology = load_topology(EXAMPLE_034).topology
    seen: list[list[str]] = []

    def fake_wheel(out: Path) -> Path:
        wheel = out / "bpdkv-0.1.0-py3-none-any.whl"
        wheel.write_bytes(b"")
        return wheel

    def fake_pip(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        seen.append(argv)
        out = Path(argv[argv.index("-d") + 1])
        for name in (
            "nixl-1.5.1-py3-none-any.whl",
            "nixl_cu12-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl",
            "nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl",
            "nvidia_cutlass_dsl-4.8.0-py3-none-any.whl",
            "nvidia_cutlass_dsl_libs_cu13-4.8.0-cp312-cp312-manylinux_2_28_x86_64.whl",
        ):
            (out / name).write_bytes(b"")
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(bootstrap, "build_bpdkv_wheel", fake_wheel)
    monkeypatch.setattr(bootstrap.subprocess, "run", fake_pip)
    house = build_wheelhouse(topology, tmp_path / "house", "3.12", "manylinux_2_28_x86_64")
    (argv,) = seen
    assert argv[argv.index("-d") + 2 :][1:4] == ["vllm==0.34.0", "nixl==1.5.1", CUTLASS_PIN]
    platforms = [argv[i + 1] for i, a in enumerate(argv) if a == "--platform"]
    assert platforms[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in platforms and "manylinux2014_x86_64" in platforms
    manifest = json.loads((tmp_path / "house" / bootstrap.WHEELHOUSE_MANIFEST).read_text())
    assert manifest["requirements"] == ["vllm==0.34.0", "nixl==1.5.1", CUTLASS_PIN]
    nixl_versions = {f.split("-")[1] for f in house.files if f.split("-")[0] in ("nixl", "nixl_cu12", "nixl_cu13")}
    assert nixl_versions == {"1.5.1"}


def test_platform_tags_take_every_older_manylinux() -> None:
    assert platform_tags("manylinux_2_17_x86_64") == [
        *(f"manylinux_2_{n}_x86_64" for n in range(17, 4, -1)),
        "manylinux2014_x86_64",
        "manylinux2010_x86_64",
        "manylinux1_x86_64",
    ]
    assert platform_tags("manylinux_2_28_aarch64")[:2] == ["manylinux_2_28_aarch64", "manylinux_2_27_aarch64"]
    assert platform_tags("linux_x86_64") == ["linux_x86_64"]


def test_an_explicit_pin_wins_and_a_base_venv_keeps_its_own_nixl(tmp_path: Path) -> None:
    assert vllm_requirements(topology_with(tmp_path, bootstrap={"nixl_version": "1.4.0"}))[1] == "nixl==1.4.0"
    based = topology_with(tmp_path, bootstrap={"base_venv": "/opt/base"})
    (nixl,) = [c for c in package_changes(based, based.nodes[0], {}, None) if c.name == "nixl"]
    assert nixl.line == "nixl: (none) → whichever base_venv has (bootstrap.nixl_version not set)"


def test_a_release_without_a_tested_nixl_says_so(tmp_path: Path) -> None:
    topology = topology_with(tmp_path, vllm={"version": "0.35.0"})
    assert vllm_requirements(topology) == ["vllm==0.35.0", "nixl", CUTLASS_DSL]  # pip takes vLLM's own cutlass pin
    (nixl,) = [c for c in package_changes(topology, topology.nodes[0], {}, None) if c.name == "nixl"]
    assert nixl.line == (
        "nixl: (none) → the newest release (bootstrap.nixl_version not set; no NIXL tested with this vLLM release is known)"
    )
    converged = package_changes(topology, topology.nodes[0], {"nixl": "1.6.0"}, None)
    assert next(c for c in converged if c.name == "nixl").action == "none"


def test_a_node_with_another_nixl_than_the_pin_is_upgraded(tmp_path: Path) -> None:
    topology = load_topology(EXAMPLE_034).topology
    node = topology.nodes[0]
    (nixl,) = [c for c in package_changes(topology, node, {"nixl": "1.5.2"}, None) if c.name == "nixl"]
    assert nixl.action == "upgrade" and nixl.line.startswith("nixl: 1.5.2 → 1.5.1 (tested with vllm 0.34.0")
    pinned = dataclasses.replace(topology, bootstrap=dataclasses.replace(topology.bootstrap, nixl_version="1.5.2"))
    assert all(c.action == "none" for c in package_changes(pinned, node, {"nixl": "1.5.2"}, None) if c.name == "nixl")
