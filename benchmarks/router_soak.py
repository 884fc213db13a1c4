"""Router soak with restarts: a real `bpdkv router` process in front of 2 P + 2 D emulated vLLM servers (test doubles,
held to recorded real vLLM responses) that crash and come back as new engines one after another, under concurrent
multi-turn conversations (plain, all claiming one X-Session-Id, concurrent branches of one history).

    python benchmarks/router_soak.py --seconds 600 [--concurrency 6] [--restart-every 30] [--out FILE]

Prints one JSON document: requests and outcomes (ok, clean errors of requests in flight on a killed upstream —
excused —, anything else as failures), the restarts, the router's RSS over the run (growth = median of the last
fifth minus the median just after warm-up), P's pulls and any KV of another history pulled. Exit 1 on a failure, a
hang, a wrong answer, wrong KV or RSS growth above --growth-bound-mb. tests/router/test_soak.py runs the same soak
for 75 s in CI.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bpdkv.testing.soak import SoakSettings, run_soak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--restart-every", type=float, default=30, help="seconds between two upstream crashes")
    ap.add_argument("--down-seconds", type=float, default=2)
    ap.add_argument("--think-seconds", type=float, default=0, help="pause between turns of half the clients")
    ap.add_argument("--growth-bound-mb", type=float, default=25)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    settings = SoakSettings(
        duration=args.seconds,
        concurrency=args.concurrency,
        restart_every=args.restart_every,
        down_seconds=args.down_seconds,
        think_seconds=args.think_seconds,
    )
    report = run_soak(settings)
    summary = report.summary()
    summary["rss_mb_samples"] = report.rss_mb[:: max(len(report.rss_mb) // 60, 1)]
    ok = not report.failures() and report.wrong_kv_tokens == 0 and report.rss_growth_mb() <= args.growth_bound_mb
    result = {"benchmark": "router_soak", "ok": ok, "growth_bound_mb": args.growth_bound_mb, **summary}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
