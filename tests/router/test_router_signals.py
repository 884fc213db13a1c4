"""Signals to a real `bpdkv router` process: SIGHUP (systemd `reload`, a closed terminal, a signal to the process
group) neither ends the router nor cuts a stream in flight; it logs one line. One process and two workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bpdkv.router.config import local_redis_conf
from bpdkv.router.server import HUP_IGNORED
from bpdkv.testing.record_vllm import free_port
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator
from tests.router.helpers import SYSTEM, chat


@pytest.fixture(scope="module")
def slow_fleet() -> Iterator[list[str]]:
    """P and a D whose streams last about a second (40 tokens, 25 ms apart): long enough to signal one mid-way."""
    p = VllmEmulator(EmulatorSettings(role="prefill"))
    d = VllmEmulator(EmulatorSettings(role="decode", token_interval=0.025))
    group = ServerGroup([p.app, d.app])
    urls = group.start()
    yield urls
    group.stop()


def _start(tmp_path: Path, urls: list[str], workers: int) -> tuple[subprocess.Popen[bytes], str, Path]:
    port = free_port()
    config: dict[str, Any] = {
        "listen": "127.0.0.1",
        "port": port,
        "prefill": [{"name": "prefill-0", "url": urls[0]}],
        "decode": [{"name": "decode-0", "url": urls[1]}],
    }
    if workers > 1:
        redis_port = free_port()
        conf = tmp_path / "redis.conf"
        conf.write_text(local_redis_conf("router-test", redis_port, str(tmp_path)))
        config.update(workers=workers, state=f"redis://127.0.0.1:{redis_port}/0", local_redis_conf=str(conf))
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "router.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bpdkv.cli", "router", "--config", str(path), "--log-level", "warning"],
            stderr=out,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError("router did not come up")


@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_to_the_process_group_is_logged_and_changes_nothing(slow_fleet: list[str], tmp_path: Path, workers: int) -> None:
    proc, url, log = _start(tmp_path, slow_fleet, workers)
    try:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a long answer please"}]
        streamed: dict[str, Any] = {}

        def stream() -> None:
            streamed["result"] = chat(url, messages, stream=True, ignore_eos=True)

        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(0.4)  # the stream is under way (about a second long)
        os.killpg(proc.pid, signal.SIGHUP)  # supervisor, workers and their redis-server alike
        reader.join(30)
        assert not reader.is_alive()
        text, events = streamed["result"]
        assert len(text.encode()) == 40 and events[-1]["choices"][0]["finish_reason"] == "length"  # all of it arrived
        time.sleep(0.5)
        assert proc.poll() is None
        for turn in range(4):  # new connections: with two workers, the kernel spreads them over both
            answer, _ = chat(url, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"after the HUP {turn}"}])
            assert answer
        assert HUP_IGNORED in log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(45) in (0, -signal.SIGTERM)  # uvicorn re-raises the SIGTERM it handled: a clean stop too
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
