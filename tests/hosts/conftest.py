"""Real SSH test hosts (network namespaces, real sshd, docker-systemctl-replacement as systemctl)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from bpdkv.lab.hosts import PER_HOST_DIRS, TestHosts, TestHostsUnavailable

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def lab() -> Iterator[TestHosts]:
    hosts = TestHosts(3)
    try:
        hosts.start()
    except TestHostsUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"test hosts unavailable in CI: {exc}")
        pytest.skip(f"test hosts unavailable: {exc}")
    try:
        yield hosts
    finally:
        hosts.stop()


def wipe(lab: TestHosts, fake_venv: bool = True) -> None:
    """Back to empty hosts: stop services (inside each host), clear per-host dirs, then install the fake venv."""
    for host in lab.hosts:
        lab.exec(host, "for p in $(pgrep -f fake_vllm); do kill $p; done; true")
        # Real vLLM/router processes a failed e2e run may have left (their command lines name the host's venv).
        lab.exec(host, "for p in $(pgrep -f /opt/bpdkv/venv); do kill -9 $p; done; true")  # venv-<release> too (rolls)
        # A real `bpdkv router` a test started through a wrapper (its command line names this checkout's venv).
        lab.exec(host, "for p in $(pgrep -f '[b]pdkv router --config'); do kill -9 $p; done; true")
        for d in PER_HOST_DIRS:
            # Empty, never replace: the host's bind mount holds on to this very directory.
            for child in (host.fs / d.lstrip("/")).iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        if not fake_venv:
            continue
        bin_dir = host.fs / "opt/bpdkv/venv/bin"
        bin_dir.mkdir(parents=True)
        for name in ("python", "bpdkv"):
            shutil.copy(HERE / "fake_vllm.py", bin_dir / name)
            (bin_dir / name).chmod(0o755)


@pytest.fixture
def hosts(lab: TestHosts) -> Iterator[TestHosts]:
    wipe(lab)
    yield lab
    wipe(lab)


def topology_doc(lab: TestHosts, **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "bpdkv/v1",
        "name": "hosts-test",
        "profile": "tiny-cpu",
        "ssh": {"user": "root", "identity_file": str(lab.key), "known_hosts": str(lab.known_hosts), "connect_timeout": 3},
        "vllm": {"start_timeout": 20, "env": {"FAKE_VERSION": "v1"}},
        "bootstrap": {"enabled": False},  # the venv is a fake vLLM (fake_vllm.py); the real bootstrap: test_fleet_e2e.py
        "nodes": [
            {"name": "host1", "host": "10.213.0.11", "hardware": "cpu", "instances": [{"role": "prefill", "port": 8100}]},
            {"name": "host2", "host": "10.213.0.12", "hardware": "cpu", "instances": [{"role": "decode", "port": 8200}]},
            {"name": "host3", "host": "10.213.0.13", "hardware": "cpu", "instances": [{"role": "router", "port": 8000}]},
        ],
        **extra,
    }


def write_topology(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def bpdkv(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bpdkv", *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
