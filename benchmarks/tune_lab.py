"""`bpdkv tune` closing the loop on the emulated fleet: a known think-time distribution against a TTL that is too short,
tune's TTL from the router's own /metrics, then the same workload (a fresh draw) with that TTL.

One P, one D (bpdkv's vLLM emulator, held to recorded real vLLM answers) and the real router in this process; the
router's clock is the benchmark's, so a conversation's think time is a step of it, not a wait. Lognormal think times
(median 60 s, sigma 0.8: p90 ≈ 167 s), 3 turns per conversation, the router's TTL 60 s (+ 10 s margin).

    .venv/bin/python benchmarks/tune_lab.py --out benchmarks/results/tune/summary.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from pathlib import Path
from typing import Any

import httpx

from bpdkv import tune
from bpdkv.prometheus_text import metric_value
from bpdkv.router.app import Router
from bpdkv.router.config import HealthSettings, PathSettings, RouterConfig, Timeouts, UpstreamSpec
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator

SYSTEM = "You are a helpful assistant. " * 8
MARGIN = 10


def think_times(seed: int, n: int, median: float, sigma: float) -> list[float]:
    rng = random.Random(seed)
    return [median * math.exp(sigma * rng.gauss(0, 1)) for _ in range(n)]


def run_conversations(url: str, now: list[float], gaps: list[float], turns: int, tag: str) -> None:
    gap = iter(gaps)
    with httpx.Client(timeout=30) as client:
        for c in range(len(gaps) // (turns - 1)):
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
            for t in range(turns):
                if t:
                    now[0] += next(gap)
                messages.append({"role": "user", "content": f"{tag} conversation {c} turn {t}: go on"})
                body = {"model": "emulated", "messages": messages, "max_tokens": 16}
                answer = client.post(url + "/v1/chat/completions", json=body).json()
                messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})


def fleet(session_ttl: float, clock: Any) -> tuple[list[ServerGroup], str]:
    p, d = VllmEmulator(EmulatorSettings(role="prefill")), VllmEmulator(EmulatorSettings(role="decode"))
    emulators = ServerGroup([p.app, d.app])
    urls = emulators.start()
    base = RouterConfig(
        prefill=(UpstreamSpec("prefill-0", urls[0]),),
        decode=(UpstreamSpec("decode-0", urls[1]),),
        timeouts=Timeouts(connect=2, prefill=30, decode_first_byte=30, decode_idle=30),
        health=HealthSettings(interval=0, failures_to_eject=3, backoff_max=5),
        paths=PathSettings(local_max_tokens=0),
    )
    router = Router(dataclasses.replace(base, session_ttl=session_ttl, expiry_margin=float(MARGIN)), clock=clock)
    routers = ServerGroup([router.app])
    return [routers, emulators], routers.start()[0]


def hits(url: str) -> float:
    return metric_value(httpx.get(url + "/metrics", timeout=10).text, "bpdkv_router_reuse_total", {"outcome": "hit"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--conversations", type=int, default=150)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--median", type=float, default=60.0)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--ttl", type=float, default=60.0, help="the router's TTL before tuning (seconds, without the margin)")
    args = ap.parse_args()
    n = args.conversations * (args.turns - 1)
    before_gaps = think_times(1, n, args.median, args.sigma)
    after_gaps = think_times(2, n, args.median, args.sigma)
    now = [1_000_000.0]

    groups, url = fleet(args.ttl, lambda: now[0])
    try:
        signals = tune.watch([url], [], 1, 1, sleep=lambda _: run_conversations(url, now, before_gaps, args.turns, "before"))
        hit_before = hits(url) / n
    finally:
        for g in groups:
            g.stop()
    current = tune.Current(int(args.ttl) + MARGIN, MARGIN, 0.5, 0, 1, 1)
    rec = tune.recommend_ttl(signals, current)
    if rec.recommended is None:
        print(rec.evidence)
        return 1
    groups, url = fleet(float(rec.recommended - MARGIN), lambda: now[0])
    try:
        run_conversations(url, now, after_gaps, args.turns, "after")
        hit_after = hits(url) / n
    finally:
        for g in groups:
            g.stop()
    ordered = sorted(before_gaps)
    summary = {
        "think_p90_s": round(ordered[int(0.9 * len(ordered))], 1),
        "think_distribution": f"lognormal median {args.median} s sigma {args.sigma}, {n} gaps, {args.turns} turns/conversation",
        "ttl_before_s": int(args.ttl) + MARGIN,
        "recommended_ttl_s": rec.recommended,
        "evidence": rec.evidence,
        "hit_rate_before": round(hit_before, 3),
        "hit_rate_predicted": rec.predicted.get("hit_rate_predicted"),
        "hit_rate_after": round(hit_after, 3),
        "fleet": "bpdkv vLLM emulator (1 P, 1 D) + the real router in one process; the router's clock stepped by the think times",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
