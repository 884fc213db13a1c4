"""Multi-worker routers: the rendered files, and real `bpdkv router` processes whose workers share sessions through a
real redis-server the supervisor starts itself."""

from __future__ import annotations

import os
import shutil
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
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from bpdkv.contracts import local_redis_conf
from bpdkv.lab.ports import free_port
from bpdkv.prometheus_text import metric_value
from bpdkv.render import render_topology, system_packages
from bpdkv.router.config import load_config
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator
from bpdkv.topology.validate import load_topology
from tests.conftest import ROOT
from tests.router.helpers import SYSTEM, chat


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


def _start_router(tmp_path: Path, urls: list[str], workers: int | str) -> tuple[subprocess.Popen[bytes], int, int]:
    """`bpdkv router` with `workers` processes and its own redis-server; urls: P's, then each D's."""
    port, redis_port = free_port(), free_port()
    conf = tmp_path / "redis.conf"
    conf.write_text(local_redis_conf("router-test", redis_port, str(tmp_path)))
    config: dict[str, Any] = {
        "listen": "127.0.0.1",
        "port": port,
        "prefill": [{"name": "prefill-0", "url": urls[0]}],
        "decode": [{"name": f"decode-{i}", "url": url} for i, url in enumerate(urls[1:])],
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
        # Every turn after the first found its stored D location, whichever worker served it (the scrape sums them).
        assert metric_value(httpx.get(url + "/metrics", timeout=10).text, "bpdkv_router_reuse_total", {"outcome": "hit"}) == 14
        assert p.counters.get("emulator_wrong_kv_tokens", 0) == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(45) == 0
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", redis_port), timeout=1).close()  # its redis went with it
    finally:
        _stop(proc)


def _worker_pids(proc: subprocess.Popen[bytes]) -> list[int]:
    return [c for c in _children(proc.pid) if "bpdkv.router.server" in Path(f"/proc/{c}/cmdline").read_text()]


def _metrics_dir(pid: int) -> Path:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    value = next(e for e in environ if e.startswith(b"PROMETHEUS_MULTIPROC_DIR="))
    return Path(value.split(b"=", 1)[1].decode())


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text) for s in family.samples}


def _requests_per_worker(metrics_dir: Path, tmp_path: Path) -> dict[int, float]:
    """Each worker's own count of served chat requests, read from its files alone (one directory per worker)."""
    counts: dict[int, float] = {}
    for counter in metrics_dir.glob("counter_*.db"):
        pid = int(counter.stem.split("_")[1])
        alone = tmp_path / f"worker-{pid}"
        alone.mkdir()
        shutil.copy(counter, alone / counter.name)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, str(alone))
        counts[pid] = registry.get_sample_value("bpdkv_router_requests_total", {"route": "/v1/chat/completions", "status": "200"}) or 0.0
    return counts


def test_metrics_of_all_workers_whichever_answers_the_scrape(emulated: Any, tmp_path: Path) -> None:
    _, urls = emulated
    proc, port, _ = _start_router(tmp_path, urls, workers=2)
    try:
        workers = _worker_pids(proc)
        metrics_dir = _metrics_dir(workers[0])
        assert len(workers) == 2 and _metrics_dir(workers[1]) == metrics_dir and metrics_dir.is_dir()
        url = f"http://127.0.0.1:{port}"
        served = 24
        for i in range(served):  # a new connection each: the kernel spreads them over both workers
            text, resp = chat(url, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}])
            assert text, resp
        per_worker = _requests_per_worker(metrics_dir, tmp_path)
        assert sorted(per_worker) == sorted(workers) and all(n > 0 for n in per_worker.values()), per_worker
        assert sum(per_worker.values()) == served
        scrapes = 8  # new connections too: with both workers answering some (all on one: 2**-7)
        for _ in range(scrapes):
            resp = httpx.get(url + "/metrics", timeout=10)
            assert resp.status_code == 200
            samples = _samples(resp.text)
            assert samples[("bpdkv_router_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))] == served
            reuse = {k[1][0][1]: v for k, v in samples.items() if k[0] == "bpdkv_router_reuse_total"}
            assert sum(reuse.values()) == served and reuse.get("miss", 0) == served, reuse  # new conversations each
            assert samples[("bpdkv_router_ttft_seconds_count", ())] == served
            assert samples[("bpdkv_router_upstream_seconds_count", (("role", "decode"),))] == served
            assert samples[("bpdkv_router_in_flight", ())] == 0  # the scrape itself is not a completion request
            assert samples[("bpdkv_router_backend_healthy", (("role", "decode"), ("upstream", "decode-0")))] == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(45) == 0
        assert not metrics_dir.exists()  # the supervisor removed its run's directory
    finally:
        _stop(proc)


def test_a_dead_worker_stops_the_router(emulated: Any, tmp_path: Path) -> None:
    _, urls = emulated
    proc, port, _ = _start_router(tmp_path, urls, workers=2)
    try:
        workers = _worker_pids(proc)
        assert len(workers) == 2
        metrics_dir = _metrics_dir(workers[0])
        os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(45) != 0  # systemd restarts the whole router rather than it serving on fewer cores
        assert not metrics_dir.exists()
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


def test_auto_workers_follow_the_cores() -> None:
    from bpdkv.router.workers import auto_workers, usable_cores

    assert [auto_workers(n) for n in (1, 2, 3, 4, 8, 16)] == [1, 1, 1, 3, 7, 15]
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)


def test_auto_on_a_small_node_is_one_process_without_its_redis(emulated: Any, tmp_path: Path) -> None:
    """`workers: auto` that comes to one process (this machine has < 4 cores) serves alone with sessions in memory:
    the redis-server render configured for the workers is not started (it would only add round trips)."""
    from bpdkv.router.workers import auto_workers

    if auto_workers() != 1:
        pytest.skip("a node with 4 or more cores runs workers under auto")
    p, urls = emulated
    proc, port, redis_port = _start_router(tmp_path, urls, workers="auto")
    try:
        assert _children(proc.pid) == []  # no worker processes, no redis-server
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", redis_port), timeout=1).close()
        url = f"http://127.0.0.1:{port}"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "turn 0"}]
        for turn in range(1, 4):
            text, resp = chat(url, messages)
            assert text, resp
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"turn {turn}"}]
        assert metric_value(httpx.get(url + "/metrics", timeout=10).text, "bpdkv_router_reuse_total", {"outcome": "hit"}) == 2
    finally:
        _stop(proc)
