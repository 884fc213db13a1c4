"""The router's session store through a Redis Sentinel failover, under load: a real router (sessions in Redis through
`redis+sentinel://`) in front of emulated P and D, a real redis-server master and replica and real Sentinels on
loopback; multi-turn conversations run while the master is SIGKILLed. Prints one JSON document: requests, client
errors (non-200 answers or failed requests), the seconds until the Sentinels name the new master (failover_s), the
seconds from the kill until a turn hits D's stored location again (reuse_resumed_s), Sentinel's down-after.

    flock /tmp/bpdkv-heavy.lock python benchmarks/redis_failover.py --out benchmarks/results/router/failover.json

Target (issue 35): 0 client errors; reuse_resumed_s <= 2 * down_after_s + failover_s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

SYSTEM = "You are a helpful assistant. " * 8


def _converse(url: str, turns: int, stop: threading.Event, tally: dict[str, int], lock: threading.Lock) -> None:
    """Conversations of `turns` turns each, one after another, until `stop`; every answer counted."""
    with httpx.Client(timeout=30) as client:
        conv = 0
        while not stop.is_set():
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM + str(conv)}]
            for turn in range(turns):
                if stop.is_set():
                    break
                messages.append({"role": "user", "content": f"Question {turn}: tell me about topic {turn * 7} please."})
                body = {"model": "emulated", "messages": messages, "max_tokens": 16}
                try:
                    resp = client.post(url + "/v1/chat/completions", json=body)
                    ok = resp.status_code == 200
                    text = resp.json()["choices"][0]["message"]["content"] if ok else ""
                except (httpx.HTTPError, ValueError, KeyError):
                    ok, text = False, ""
                with lock:
                    tally["requests"] += 1
                    tally["client_errors"] += 0 if ok else 1
                if not ok:
                    break
                messages.append({"role": "assistant", "content": text})
            conv += 1


def failover_under_load(
    router_url: str,
    group: Any,  # bpdkv.testing.sentinel.SentinelGroup, started
    metric: Callable[..., float],  # (name, **labels) → the router's metric value
    conversations: int = 4,
    turns: int = 8,
    before_s: float = 2.0,
    limit_s: float = 40.0,
    after_s: float = 1.0,
) -> dict[str, Any]:
    """Load from `conversations` threads; after `before_s` the master is SIGKILLed; sampled every 0.1 s until the
    Sentinels name a new master and a hit is counted after the outage was seen (or `limit_s`), then `after_s` more."""
    tally = {"requests": 0, "client_errors": 0}
    lock = threading.Lock()
    stop = threading.Event()
    threads = [threading.Thread(target=_converse, args=(router_url, turns, stop, tally, lock), daemon=True) for _ in range(conversations)]
    for t in threads:
        t.start()
    result: dict[str, Any] = {}
    try:
        time.sleep(before_s)
        hits_before = metric("bpdkv_router_reuse_total", outcome="hit")
        old_port = group.master_port()
        unavailable_at_kill = metric("bpdkv_router_reuse_total", outcome="unavailable")
        t0 = time.monotonic()
        group.kill_master()
        failover_s = resumed_s = None
        outage_hits: float | None = None
        new_port = None
        while time.monotonic() - t0 < limit_s:
            now = time.monotonic() - t0
            if failover_s is None:
                port = group.master_port()
                if port is not None and port != old_port:
                    failover_s, new_port = now, port
            hits = metric("bpdkv_router_reuse_total", outcome="hit")
            if outage_hits is None:
                if metric("bpdkv_router_reuse_total", outcome="unavailable") > unavailable_at_kill:
                    outage_hits = hits  # the router saw the store fail: from here a new hit means reuse is back
            elif resumed_s is None and hits > outage_hits:
                resumed_s = now
            if failover_s is not None and resumed_s is not None:
                break
            time.sleep(0.1)
        time.sleep(after_s)  # the load goes on after the recovery: no error there either
    finally:
        stop.set()
        for t in threads:
            t.join(35)
    down_after_s = group.down_after_ms / 1000
    result = {
        "requests": tally["requests"],
        "client_errors": tally["client_errors"],
        "failover_s": None if failover_s is None else round(failover_s, 2),
        "reuse_resumed_s": None if resumed_s is None else round(resumed_s, 2),
        "down_after_s": down_after_s,
        "hits_before_kill": hits_before,
        "outage_seen": outage_hits is not None,
        "master_port_before": old_port,
        "master_port_after": new_port,
        "sentinels": group.sentinels,
        "store_errors": metric("bpdkv_router_store_errors_total"),
    }
    if failover_s is not None and resumed_s is not None:
        result["target_s"] = round(2 * down_after_s + failover_s, 2)
        result["within_target"] = resumed_s <= 2 * down_after_s + failover_s
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentinels", type=int, default=3)
    ap.add_argument("--down-after-ms", type=int, default=1000)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--before", type=float, default=3.0, help="seconds of load before the kill")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--note", default="")
    args = ap.parse_args()

    from bpdkv.bench.runner import metric_value
    from bpdkv.router.app import Router
    from bpdkv.router.config import HealthSettings, PathSettings, RouterConfig, Timeouts, UpstreamSpec
    from bpdkv.router.sessions import RedisStore
    from bpdkv.testing.sentinel import SentinelGroup
    from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator

    with tempfile.TemporaryDirectory(prefix="bpdkv-failover-") as tmp:
        group = SentinelGroup(Path(tmp), sentinels=args.sentinels, down_after_ms=args.down_after_ms)
        emus = ServerGroup([VllmEmulator(EmulatorSettings(role="prefill")).app, VllmEmulator(EmulatorSettings(role="decode")).app])
        routers = None
        try:
            group.start()
            p_url, d_url = emus.start()
            config = RouterConfig(
                prefill=(UpstreamSpec("prefill-0", p_url),),
                decode=(UpstreamSpec("decode-0", d_url),),
                timeouts=Timeouts(connect=2, prefill=10, decode_first_byte=10, decode_idle=10),
                health=HealthSettings(interval=0, failures_to_eject=3, backoff_max=5),
                paths=PathSettings(local_max_tokens=0),  # every continued turn through P: a hit is a pull from D
            )
            routers = ServerGroup([Router(config, store=RedisStore(group.url, timeout=0.25)).app])
            (url,) = routers.start()

            def metric(name: str, **labels: str) -> float:
                return metric_value(httpx.get(url + "/metrics", timeout=10).text, name, labels)

            result = failover_under_load(url, group, metric, conversations=args.conversations, before_s=args.before)
        finally:
            if routers is not None:
                routers.stop()
            emus.stop()
            group.stop()
    result["note"] = args.note
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
