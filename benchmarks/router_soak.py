"""Router soak: many concurrent streaming conversations for a bounded time; RSS sampled; errors counted.

    python benchmarks/router_soak.py --conversations 200 --seconds 600

Uses benchmarks/fastemu.py (test double) for P and D and a real `bpdkv router` process. The router's session TTL
is set short (--session-ttl, default 60 s) so abandoned conversations' entries reach their steady state inside the
run; memory growth is judged on the second half of the run (after that steady state).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router_overhead as ro  # noqa: E402


async def sampler(pid: int, stop_at: float, every: float, samples: list[tuple[float, int]]) -> None:
    start = time.perf_counter()
    while time.perf_counter() < stop_at:
        samples.append((time.perf_counter() - start, ro.rss_bytes(pid)))
        await asyncio.sleep(every)


async def run(port: int, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    samples: list[tuple[float, int]] = []
    stop_at = time.perf_counter() + args.seconds
    results: dict[str, Any] = {"ttft": [], "total": [], "done": 0, "errors": []}
    await asyncio.gather(
        sampler(pid, stop_at, args.sample_every, samples),
        *(ro.client(port, stop_at, time.perf_counter(), results, i, args.turns) for i in range(args.conversations)),
    )
    half = [rss for t, rss in samples if t >= args.seconds / 2]
    return {
        "requests": results["done"],
        "errors": len(results["errors"]),
        "error_samples": sorted(set(results["errors"]))[:5],
        "ttft_p50_ms": 1000 * ro.pct(results["ttft"], 0.5),
        "ttft_p99_ms": 1000 * ro.pct(results["ttft"], 0.99),
        "rss_mb_first": samples[0][1] / 2**20 if samples else None,
        "rss_mb_max": max(r for _, r in samples) / 2**20 if samples else None,
        "rss_mb_second_half_min": min(half) / 2**20 if half else None,
        "rss_mb_second_half_max": max(half) / 2**20 if half else None,
        "rss_mb_last": samples[-1][1] / 2**20 if samples else None,
        "samples": [(round(t, 1), round(r / 2**20, 1)) for t, r in samples],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--session-ttl", type=float, default=60)
    ap.add_argument("--sample-every", type=float, default=10)
    ap.add_argument("--growth-bound-mb", type=float, default=32, help="allowed RSS growth over the second half")
    args = ap.parse_args()
    procs: list[ro.Proc] = []
    try:
        emu = ro.Proc([sys.executable, str(ro.ROOT / "benchmarks" / "fastemu.py"), "--max-seconds", str(args.seconds + 120)])
        procs.append(emu)
        assert emu.popen.stdout is not None
        urls = json.loads(emu.popen.stdout.readline())
        port = ro.free_port()
        router = ro.start_router(urls, port, "--session-ttl", str(args.session_ttl))
        procs.append(router)
        ro.wait_http(port)
        result = asyncio.run(run(port, router.popen.pid, args))
        growth = (result["rss_mb_second_half_max"] or 0) - (result["rss_mb_second_half_min"] or 0)
        result.update(
            {
                "benchmark": "router_soak",
                "conversations": args.conversations,
                "seconds": args.seconds,
                "second_half_growth_mb": growth,
                "growth_bound_mb": args.growth_bound_mb,
                "ok": result["errors"] == 0 and growth <= args.growth_bound_mb,
            }
        )
    finally:
        for p in reversed(procs):
            p.stop()
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
