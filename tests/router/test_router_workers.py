"""Multi-worker routers: the rendered files, and real `bpdkv router` processes whose workers share sessions through a
real redis-server the supervisor starts itself."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bpdkv.render import render_topology, system_packages
from bpdkv.router.config import load_config, local_redis_conf
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator
from bpdkv.topology.loader import load_topology
from tests.conftest import ROOT
from tests.router.helpers import SYSTEM, chat


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_render_multi_worker_router(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "local-cpu.yaml").read_text())
    doc.setdefault("router", {})["workers"] = 2
    doc["router"].pop("state", None)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    topology = load_topology(path).topology
    artifacts = render_topology(topology)
    config_art = next(a for a in artifacts if a.path.endswith(".router.yaml"))
    (tmp_path / "router.yaml").write_text(config_art.content)
    config = load_config(tmp_path / "router.yaml")
    assert config.workers == 2 and config.state == "redis://127.0.0.1:6390/0"
    conf = next(a for a in artifacts if a.path == config.local_redis_conf)
    assert conf.host == config_art.host and "port 6390" in conf.content and "bind 127.0.0.1" in conf.content
    assert system_packages(topology) == {config_art.host: ("redis-server",)}
    # One worker (the default): no Redis asked for, the config is as before.
    doc["router"]["workers"] = 1
    path.write_text(yaml.safe_dump(doc))
    single = load_topology(path).topology
    assert (
        system_packages(single) == {}
        and "workers" not in next(a for a in render_topology(single) if a.path.endswith(".router.yaml")).content
    )


@pytest.fixture
def emulated() -> Iterator[tuple[VllmEmulator, list[str]]]:
    p = VllmEmulator(EmulatorSettings(role="prefill", prefix_caching=False))
    d = VllmEmulator(EmulatorSettings(role="decode"))
    group = ServerGroup([p.app, d.app])
    urls = group.start()
    yield p, urls
    group.stop()


def _start_router(tmp_path: Path, urls: list[str], workers: int) -> tuple[subprocess.Popen[bytes], int, int]:
    port, redis_port = _free_port(), _free_port()
    conf = tmp_path / "redis.conf"
    conf.write_text(local_redis_conf("router-test", redis_port, str(tmp_path)))
    config: dict[str, Any] = {
        "listen": "127.0.0.1",
        "port": port,
        "prefill": [{"name": "prefill-0", "url": urls[0]}],
        "decode": [{"name": "decode-0", "url": urls[1]}],
        "state": f"redis://127.0.0.1:{redis_port}/0",
        "workers": workers,
        "local_redis_conf": str(conf),
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "bpdkv.cli", "router", "--config", str(path), "--log-level", "warning"], start_new_session=True
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, port, redis_port
        except httpx.HTTPError:
            time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("router did not come up")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def test_workers_share_sessions_through_their_redis(emulated: Any, tmp_path: Path) -> None:
    p, urls = emulated
    proc, port, redis_port = _start_router(tmp_path, urls, workers=2)
    try:
        assert len(_children(proc.pid)) == 3  # two workers and the redis-server
        url = f"http://127.0.0.1:{port}"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "turn 0"}]
        for turn in range(1, 16):  # each request on a new connection: the kernel spreads them over both workers
            text, resp = chat(url, messages)
            assert text, resp
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"turn {turn}"}]
        pulls = [r["kv_transfer_params"]["remote_block_ids"] is not None for r in p.requests]
        assert pulls == [False] + [True] * 14  # every turn after the first pulled D's KV, whichever worker served it
        assert p.counters.get("emulator_wrong_kv_tokens", 0) == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(45) == 0
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", redis_port), timeout=1).close()  # its redis went with it
    finally:
        _stop(proc)


def test_a_dead_worker_stops_the_router(emulated: Any, tmp_path: Path) -> None:
    _, urls = emulated
    proc, port, _ = _start_router(tmp_path, urls, workers=2)
    try:
        workers = [c for c in _children(proc.pid) if "bpdkv.router.server" in Path(f"/proc/{c}/cmdline").read_text()]
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(45) != 0  # systemd restarts the whole router rather than it serving on fewer cores
    finally:
        _stop(proc)


def test_workers_without_redis_state_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        yaml.safe_dump(
            {"listen": "127.0.0.1", "port": 8000, "prefill": [{"url": "http://p"}], "decode": [{"url": "http://d"}], "workers": 2}
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "bpdkv.cli", "router", "--config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0 and "workers: 2 processes need shared sessions" in result.stderr
    assert "Traceback" not in result.stderr
