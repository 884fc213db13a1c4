"""The signals `bpdkv tune` reads, from real multi-turn traffic through the real router and the emulated fleet, and
`tune` itself against that router's /metrics: the turn gap histogram, the reuse misses by cause, and a TTL
recommendation that, applied, gives the hit rate it predicted.

The router's clock is the test's (each conversation's think time is a step of it); the traffic, the router, its
store and its /metrics are real."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from bpdkv import tune
from bpdkv.contracts import TURN_GAP_METRIC, MissCause
from tests.router.helpers import SYSTEM, chat

ROOT = Path(__file__).resolve().parents[2]
# Think times 5, 10, ... 300 s: p90 = 270 s (the 54th of 60).
THINK = [5.0 * (i + 1) for i in range(60)]


def _bucket(fleet: Any, le: str) -> float:
    return fleet.metric(TURN_GAP_METRIC + "_bucket", le=le)


def _two_turns(url: str, now: list[float], think: float, tag: str) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"conversation {tag}: first"}]
    text, _ = chat(url, messages)
    now[0] += think
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}]
    text2, resp = chat(url, messages)
    assert text2, resp


def test_gap_histogram_and_miss_causes(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    now = [10_000.0]
    fleet = fleet_factory(router_changes={"session_ttl": 100.0}, clock=lambda: now[0])
    _two_turns(fleet.url, now, 30.0, "a")  # within the TTL: a hit, gap 30 s
    _two_turns(fleet.url, now, 600.0, "b")  # after the router's TTL (D's location gone from the store): expired, gap 600 s
    # A regenerated turn: the same history again finds its location taken by the first try.
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "conversation c"}]
    text, _ = chat(fleet.url, messages)
    now[0] += 12.0
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "again"}]
    chat(fleet.url, messages)
    chat(fleet.url, messages)
    assert fleet.metric(TURN_GAP_METRIC + "_count") == 4
    assert _bucket(fleet, "10.0") == 0
    assert _bucket(fleet, "15.0") == 2  # c's two tries, 12 s after its first turn
    assert _bucket(fleet, "30.0") == 3
    assert _bucket(fleet, "480.0") == 3
    assert _bucket(fleet, "600.0") == 4
    assert fleet.metric(TURN_GAP_METRIC + "_sum") == 30 + 600 + 12 + 12
    misses = {c: fleet.metric("bpdkv_router_reuse_misses_total", cause=c.value) for c in MissCause}
    assert misses[MissCause.EXPIRED] == 1
    assert misses[MissCause.CONSUMED] == 1
    assert sum(misses.values()) == 2  # first turns are not misses; the hits are not
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 2
    assert fleet.metric("bpdkv_router_reuse_total", outcome="expired") == 1


def test_restarted_d_and_a_first_turn_after_nothing_stored(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    now = [10_000.0]
    fleet = fleet_factory(clock=lambda: now[0])
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "restart me"}]
    text, _ = chat(fleet.url, messages)
    now[0] += 1
    fleet.decode[0].restart()  # a new engine: D's next answer names it, and the router stops offering the old one's KV
    chat(fleet.url, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a new conversation"}])
    now[0] += 1
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "still there?"}]
    chat(fleet.url, messages)
    # A history the router never stored (the client brings its own): nothing stored, no gap.
    chat(fleet.url, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "never stored"}, {"role": "user", "content": "y"}])
    assert fleet.metric("bpdkv_router_reuse_misses_total", cause=MissCause.RESTARTED.value) == 1
    assert fleet.metric("bpdkv_router_reuse_misses_total", cause=MissCause.NOTHING_STORED.value) == 1
    assert fleet.metric(TURN_GAP_METRIC + "_count") == 1


def _workload(url: str, now: list[float], tag: str) -> None:
    for i, think in enumerate(THINK):
        _two_turns(url, now, think, f"{tag}-{i}")


def test_tune_watch_recommends_the_p90_and_the_predicted_hit_rate_comes_true(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    """TTL too short (100 s against think times up to 300 s): tune, watching the router while the traffic runs,
    recommends about the p90; a router with that TTL then hits as often as tune predicted."""
    now = [10_000.0]
    margin = 10
    fleet = fleet_factory(router_changes={"session_ttl": 100.0, "expiry_margin": float(margin)}, clock=lambda: now[0])
    ran = []
    signals = tune.watch([fleet.url], [], duration_s=2, interval_s=1, sleep=lambda _: ran.append(_workload(fleet.url, now, str(len(ran)))))
    assert len(ran) == 2  # two rounds of the workload between three scrapes
    current = tune.Current(ttl_s=100 + margin, ttl_margin_s=margin, hold_budget=0.5, local_max_tokens=0, prefill=1, decode=1)
    ttl = tune.recommend_ttl(signals, current)
    assert ttl.recommended is not None and ttl.changes
    assert 0.8 * 270 <= ttl.recommended <= 1.2 * 270, ttl
    assert "turn gaps" in ttl.evidence and "expired" in ttl.evidence
    before = fleet.metric("bpdkv_router_reuse_total", outcome="hit")
    assert before == 2 * 19  # think < 100 s (the TTL): 19 of 60
    assert ttl.predicted["hit_rate_before"] == round(19 / 60, 3)
    predicted = ttl.predicted["hit_rate_predicted"]

    after = fleet_factory(
        router_changes={"session_ttl": float(ttl.recommended - margin), "expiry_margin": float(margin)}, clock=lambda: now[0]
    )
    _workload(after.url, now, "after")
    measured = after.metric("bpdkv_router_reuse_total", outcome="hit") / len(THINK)
    assert measured > ttl.predicted["hit_rate_before"]
    assert abs(measured - predicted) <= 0.10, (measured, predicted)


def test_tune_cli_watch_against_the_router(fleet_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`bpdkv tune TOPOLOGY --router URL --watch 10m --output json --write-override FILE`, a real process: the traffic
    runs between its first scrape and a Ctrl-C (which ends the watch with one last scrape); the JSON carries the
    recommendation and the override fragment the new TTL."""
    import signal
    import time

    now = [10_000.0]
    fleet = fleet_factory(router_changes={"session_ttl": 100.0, "expiry_margin": 10.0}, clock=lambda: now[0])
    metrics = fleet.routers[0].metrics
    scrapes: list[int] = []
    exposition = metrics.exposition
    metrics.exposition = lambda: (scrapes.append(1), exposition())[1]  # counts the CLI's scrapes, answers as before
    override = tmp_path / "tune.yaml"
    cmd = [sys.executable, "-m", "bpdkv.cli", "tune", str(ROOT / "examples/local-cpu.yaml"), "--router", fleet.url]
    cmd += ["--watch", "10m", "--interval", "1s", "--output", "json", "--write-override", str(override)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not scrapes and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert scrapes, "the CLI never scraped the router"
        _workload(fleet.url, now, "cli")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, err.decode()
    result = json.loads(out)
    by = {r["setting"]: r for r in result["recommendations"]}
    ttl = by["decoder_kv_blocks_ttl"]
    assert ttl["predicted"]["gaps"] == len(THINK)
    assert ttl["recommended"] == 280, ttl  # the p90 (270 s) + the topology's TTL margin (10 s)
    assert by["P:D"]["current"] == "1:1"
    assert f"decoder_kv_blocks_ttl: {ttl['recommended']}" in override.read_text()


def test_tune_cli_says_why_when_the_router_is_down(tmp_path: Path) -> None:
    from bpdkv.lab.ports import free_port

    cmd = [sys.executable, "-m", "bpdkv.cli", "tune", str(ROOT / "examples/local-cpu.yaml"), "--router", f"http://127.0.0.1:{free_port()}"]
    done = subprocess.run([*cmd, "--watch", "1s", "--interval", "1s"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "127.0.0.1" in done.stdout + done.stderr


def test_router_down_is_one_line_in_the_library() -> None:
    from bpdkv.lab.ports import free_port

    try:
        tune.watch([f"http://127.0.0.1:{free_port()}"], [], duration_s=1, interval_s=1, sleep=lambda _: None)
    except tune.TuneError as exc:
        assert "127.0.0.1" in str(exc)
    else:
        raise AssertionError("no error")


def test_metrics_are_exported_before_any_miss(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory()
    text = httpx.get(fleet.url + "/metrics", timeout=10).text
    for cause in MissCause:
        assert f'bpdkv_router_reuse_misses_total{{cause="{cause.value}"}} 0.0' in text
    assert TURN_GAP_METRIC + '_bucket{le="3600.0"} 0.0' in text


def _load(url: str, clients: int, seconds: float) -> list[threading.Thread]:
    """`clients` conversations in parallel, each asking one question after another for about `seconds`."""
    import time

    end = time.monotonic() + seconds

    def client(n: int) -> None:
        i = 0
        while time.monotonic() < end:
            chat(url, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"client {n} question {i}"}])
            i += 1

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(clients)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize(
    ("p_settings", "d_settings", "advice"),
    [
        # P computes slowly and has one slot: requests queue at P. A request spends seconds on the slow side, so
        # the 6 clients are there nearly all the time however loaded the machine is (the queue is ~5, the rule needs 1).
        ({"prefill_seconds_per_token": 0.02, "max_num_seqs": 1}, {"max_num_seqs": 1}, "2:1"),
        # D streams slowly (40 tokens, 50 ms apart) and has one slot: requests queue at D.
        ({"max_num_seqs": 1}, {"token_interval": 0.05, "max_num_seqs": 1}, "1:2"),
    ],
    ids=["P-bound", "D-bound"],
)
def test_pd_advice_names_the_side_that_queues(fleet_factory, p_settings: dict[str, Any], d_settings: dict[str, Any], advice: str) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(p_settings=p_settings, d_settings=d_settings, router_changes={"reuse": False})
    threads = _load(fleet.url, 6, 7.0)
    try:
        # vLLM's own queue series, from each engine's /metrics (the emulator's, held to vLLM's names)
        p_urls, d_urls = fleet.emulator_urls[:1], fleet.emulator_urls[1:]
        signals = tune.watch([fleet.url], d_urls, duration_s=4, interval_s=0.5, prefills=p_urls)
    finally:
        for t in threads:
            t.join(timeout=30)
    current = tune.Current(ttl_s=480, ttl_margin_s=10, hold_budget=0.5, local_max_tokens=0, prefill=1, decode=1)
    rec = tune.recommend_ratio(signals, current)
    assert rec.recommended == advice, (rec, signals.waiting)
