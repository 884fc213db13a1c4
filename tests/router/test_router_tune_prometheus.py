"""`bpdkv tune --prometheus`: a real Prometheus server (Debian's package) scrapes the real router through the scrape
configuration `bpdkv render` writes (file-based targets, the topology's labels; only the interval shortened), and
tune reads the window back through Prometheus' HTTP API."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bpdkv import tune
from bpdkv.lab.ports import free_port
from bpdkv.observability import prometheus_config, scrape_targets
from bpdkv.topology.validate import load_topology
from tests.router.test_router_tune import THINK, _workload

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/local-cpu.yaml"
pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (.ci/install-test-deps.sh)")


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    answer = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", answer
    return list(answer["data"]["result"])


def _wait(what: str, check: Any, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A Prometheus on loopback, its config from the topology; targets/router.json is the test's to write."""
    topology = load_topology(EXAMPLE, str(EXAMPLE)).topology
    config = yaml.safe_load(prometheus_config(topology))
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "targets").mkdir()
    for role in ("prefill", "decode", "router"):
        (tmp_path / "targets" / f"{role}.json").write_text("[]")
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait("prometheus ready", lambda: httpx.get(url + "/-/ready", timeout=2).status_code == 200)
        yield url, tmp_path / "targets" / "router.json"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def test_tune_reads_the_window_from_prometheus(fleet_factory, prometheus) -> None:  # type: ignore[no-untyped-def]
    url, targets = prometheus
    now = [10_000.0]
    fleet = fleet_factory(router_changes={"session_ttl": 100.0, "expiry_margin": 10.0}, clock=lambda: now[0])
    topology = load_topology(EXAMPLE, str(EXAMPLE)).topology
    group = scrape_targets(topology)["router"][0]
    group["targets"] = [fleet.url.removeprefix("http://")]
    targets.write_text(json.dumps([group]))
    gap_count = 'bpdkv_router_turn_gap_seconds_count{topology="local-cpu"}'
    _wait("the first scrape of the router", lambda: bool(_query(url, gap_count)))
    _workload(fleet.url, now, "prom")
    _wait("a scrape after the workload", lambda: float(_query(url, gap_count)[0]["value"][1]) == len(THINK))
    time.sleep(1.5)  # one more scrape: the window's last sample is the final value

    cmd = [sys.executable, "-m", "bpdkv.cli", "tune", str(EXAMPLE), "--prometheus", url, "--since", "5m", "--output", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    by = {r["setting"]: r for r in json.loads(done.stdout)["recommendations"]}
    ttl = by["decoder_kv_blocks_ttl"]
    assert ttl["recommended"] is not None and 0.8 * 270 <= ttl["recommended"] <= 1.2 * 270, ttl
    # increase() extrapolates to the window's edges: counts a little above the true 60 gaps, the shares unchanged.
    assert ttl["predicted"]["gaps"] >= len(THINK)
    assert abs(ttl["predicted"]["hit_rate_before"] - 19 / 60) <= 0.02, ttl
    assert "expired" in ttl["evidence"]


def test_a_prometheus_error_is_one_line(prometheus) -> None:  # type: ignore[no-untyped-def]
    url, _ = prometheus
    query = tune.prometheus_query(url)
    with pytest.raises(tune.TuneError, match="Prometheus refused"):
        query("sum(")  # Prometheus' own 400 answer: a parse error
