"""`bpdkv tune` against the emulated fleet where D's hold budget is what limits reuse, and where nothing happened.

D (the emulator with a hold budget, as the node plugin keeps it) holds at most its budget, releases the oldest holds
past it, names them to the router and reports the plugin's gauges (vllm:bpdkv_held_blocks, _hold_budget_blocks,
_kv_blocks_total) on its /metrics; tune reads those gauges from D itself. The router's clock is the test's (each
conversation's think time is a step of it); the traffic, the router, its store and every /metrics are real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bpdkv import tune
from tests.router.test_router_tune import THINK, _workload

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/local-cpu.yaml"  # decoder_kv_blocks_ttl 120, router.ttl_margin 10
# 8,000 KV blocks, 30 % of them for holds (2,400): one round of the workload makes ~3,000 blocks of holds, so D
# reaches its budget within the first round and releases the oldest holds from then on.
D_HOLDS: dict[str, Any] = {"kv_capacity_tokens": 8000 * 16, "kv_hold_budget": 0.3}


def _by_setting(recommendations: Any) -> dict[str, Any]:
    return {(r["setting"] if isinstance(r, dict) else r.setting): r for r in recommendations}


def test_over_the_hold_budget_tune_caps_the_ttl(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    """The gaps ask for 280 s (p90 270 s + the 10 s margin), 2.5x today's 110 s; D, already at its budget part of
    the time, could not hold that. tune recommends the longest TTL D's budget holds, predicts the hit rate there,
    and says what a larger budget would give; the override carries the capped TTL, never 280."""
    now = [10_000.0]
    fleet = fleet_factory(router_changes={"session_ttl": 100.0, "expiry_margin": 10.0}, d_settings=D_HOLDS, clock=lambda: now[0])
    d = fleet.decode[0]
    ran: list[None] = []
    signals = tune.watch(
        [fleet.url],
        fleet.emulator_urls[1:],
        duration_s=2,
        interval_s=1,
        sleep=lambda _: ran.append(_workload(fleet.url, now, str(len(ran)))),
    )
    assert len(ran) == 2
    # D's gauges, from D's /metrics: the budget is 2,400 of 8,000 blocks; D held up to it and let the oldest go.
    assert signals.budget_share == 0.3
    assert signals.held_share is not None and 0.0 < signals.held_share <= 0.3
    assert d.counters.get("emulator_holds_released_budget", 0) > 0
    assert fleet.metric("bpdkv_router_released_holds_total") == d.counters["emulator_holds_released_budget"]

    current = tune.Current(ttl_s=110, ttl_margin_s=10, hold_budget=0.3, local_max_tokens=0, prefill=1, decode=1)
    result = tune.TuneResult("fleet", signals, tuple(tune.recommend(signals, current)))
    ttl = _by_setting(result.recommendations)["decoder_kv_blocks_ttl"]
    assert ttl.recommended is not None and current.ttl_s < ttl.recommended < 280, ttl  # was 280: over the budget
    assert ttl.capped_by == tune.CAPPED_BY_HOLD_BUDGET
    assert ttl.predicted["ttl_uncapped"] == 280 and ttl.predicted["held_share_uncapped"] > 0.3
    assert tune.predict_ttl(signals, current, ttl.recommended).held_share <= 0.3  # type: ignore[operator]
    assert ttl.predicted["hit_rate_before"] < ttl.predicted["hit_rate_predicted"] < ttl.predicted["hit_rate_uncapped"]
    fragment = tune.override_yaml(result, "fleet")
    assert yaml.safe_load(fragment)["kv_transfer"]["decoder_kv_blocks_ttl"] == ttl.recommended
    assert "capped by D's hold budget (30 %): the turn gaps ask for 280 s" in fragment
    row = next(r for r in tune.rows(result) if r[0] == "decoder_kv_blocks_ttl")
    assert row[2] == f"{ttl.recommended} (capped by kv_hold_budget)" and "capped by the hold budget" in row[4]
    # 240 requests served without queueing: P:D is judged (the no-traffic case below is not)
    assert _by_setting(result.recommendations)["P:D"].recommended == "1:1"


def test_tune_cli_over_the_hold_budget(fleet_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The CLI, a real process watching the router and D (its gauges) while two rounds run: the JSON says the TTL is
    capped by the hold budget and why, the override carries no TTL the budget contradicts."""
    now = [10_000.0]
    fleet = fleet_factory(router_changes={"session_ttl": 110.0, "expiry_margin": 10.0}, d_settings=D_HOLDS, clock=lambda: now[0])
    metrics = fleet.routers[0].metrics
    scrapes: list[int] = []
    exposition = metrics.exposition
    metrics.exposition = lambda: (scrapes.append(1), exposition())[1]  # counts the CLI's scrapes, answers as before
    override = tmp_path / "tune.yaml"
    cmd = [sys.executable, "-m", "bpdkv.cli", "tune", str(EXAMPLE), "--router", fleet.url, "--decode", fleet.emulator_urls[1]]
    cmd += ["--watch", "10m", "--interval", "1s", "--output", "json", "--write-override", str(override)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not scrapes and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert scrapes, "the CLI never scraped the router"
        _workload(fleet.url, now, "cli-1")
        _workload(fleet.url, now, "cli-2")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, err.decode()
    ttl = _by_setting(json.loads(out)["recommendations"])["decoder_kv_blocks_ttl"]
    assert ttl["predicted"]["gaps"] == 2 * len(THINK)
    assert ttl["recommended"] is not None and 120 <= ttl["recommended"] < 280, ttl  # was 280: over the budget
    assert ttl["capped_by"] == "kv_hold_budget"
    assert ttl["predicted"]["hold_budget_share"] == 0.3  # D's gauge, not the topology's 0.5
    assert ttl["predicted"]["ttl_uncapped"] == 280 and ttl["predicted"]["held_share_uncapped"] > 0.3
    assert ttl["predicted"]["held_share_predicted"] <= 0.3
    text = override.read_text()
    written = (yaml.safe_load(text) or {}).get("kv_transfer", {}).get("decoder_kv_blocks_ttl")
    assert written == (ttl["recommended"] if ttl["recommended"] != 120 else None)
    assert "capped by D's hold budget (30 %)" in text and "decoder_kv_blocks_ttl: 280" not in text


def test_tune_cli_without_traffic_says_too_little_data(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    """A fleet nobody uses: every engine reads zero queued, which is no evidence the sizing fits. The table's P:D row
    says "too little data" (it said "keep"), as every other row does."""
    fleet = fleet_factory(d_settings=D_HOLDS)
    cmd = [sys.executable, "-m", "bpdkv.cli", "tune", str(EXAMPLE), "--router", fleet.url, "--decode", fleet.emulator_urls[1]]
    env = {**os.environ, "COLUMNS": "400"}  # one table row per line
    done = subprocess.run([*cmd, "--watch", "2s", "--interval", "1s"], capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    pd = next(line for line in done.stdout.splitlines() if "P:D" in line)
    assert "too little data" in pd and "keep" not in pd, done.stdout
    assert "0 requests finished in the window" in pd
    for line in done.stdout.splitlines():
        if any(s in line for s in ("decoder_kv_blocks_ttl", "kv_hold_budget", "ttl_margin", "local_max_tokens")):
            assert "too little data" in line, line
