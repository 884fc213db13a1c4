"""What one redis-server sustains for the router's session traffic: real RedisStore turns (take + put through
bpdkv.router.resp, the scripts the router runs) from several processes against a real redis-server, the server's CPU per
turn read from /proc; so one core of Redis serves 1 / (CPU per turn) turns a second. Prints one JSON document.

    python benchmarks/redis_capacity.py --seconds 8 --procs 2 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bpdkv.lab.ports import free_port
from bpdkv.lab.processes import stop_group

CLK = os.sysconf("SC_CLK_TCK")


def cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


async def turns(url: str, concurrency: int, seconds: float, worker: int) -> dict[str, Any]:
    """Conversations as the router runs them: each turn takes the previous turn's entry (one script) and stores the
    next (SET PX), as RedisStore does for chat; the released check (EXISTS) too."""
    from bpdkv.router.sessions import RedisStore, SessionEntry, Verdict

    store = RedisStore(url, timeout=2.0)
    params = {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": list(range(40)), "remote_engine_id": "d" * 36}
    params |= {"remote_request_id": "r" * 40, "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 5000}
    done = 0
    misses = 0
    deadline = time.monotonic() + seconds

    async def conversation(cid: int) -> None:
        nonlocal done, misses
        turn = 0
        while time.monotonic() < deadline:
            history = f"{worker}-{cid}-{turn}"
            key = "c:{" + f"{worker:04d}{cid:012d}" + "}" + history
            if turn:
                prev = f"{worker}-{cid}-{turn - 1}"
                entry, _ = await store.take(["c:{" + f"{worker:04d}{cid:012d}" + "}" + prev], lambda e: Verdict.TAKE, frozenset({prev}))
                if entry is None:
                    misses += 1
                await store.is_released(f"decode-0:{turn}")
            entry = SessionEntry(params=params, expires_at=time.time() + 60, history=history, decode="decode-0", stored_at=time.time())
            await store.put(key, entry, 60)
            done += 1
            turn = (turn + 1) % 50

    await asyncio.gather(*(conversation(i) for i in range(concurrency)))
    commands = store.commands
    await store.close()
    return {"turns": done, "misses": misses, "commands": commands}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--driver":
        import uvloop

        uvloop.install()
        url, conc, secs, worker = sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(asyncio.run(turns(url, conc, secs, worker))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--procs", type=int, default=2, help="driver processes (each one connection, like a router worker)")
    ap.add_argument("--concurrency", type=int, default=64, help="conversations per driver")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    work = tempfile.mkdtemp(prefix="redis-capacity-")
    port = free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", work],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        time.sleep(0.5)
        url = f"redis://127.0.0.1:{port}/0"
        cpu0, t0 = cpu(server.pid), time.monotonic()
        drivers = [
            subprocess.Popen(
                [sys.executable, __file__, "--driver", url, str(args.concurrency), str(args.seconds), str(i)], stdout=subprocess.PIPE
            )
            for i in range(args.procs)
        ]
        results = [json.loads(d.communicate(timeout=args.seconds + 60)[0]) for d in drivers]
        elapsed = time.monotonic() - t0
        server_cpu = cpu(server.pid) - cpu0
        done = sum(r["turns"] for r in results)
        commands = sum(r["commands"] for r in results)
        out = {
            "benchmark": "redis_capacity",
            "machine": {"cpus": os.cpu_count(), "shared_with": args.note},
            "settings": vars(args),
            "turns_per_s": done / elapsed,
            "commands_per_turn": commands / max(done, 1),
            "misses": sum(r["misses"] for r in results),
            "redis_cores": server_cpu / elapsed,
            "redis_cpu_us_per_turn": 1e6 * server_cpu / max(done, 1),
            # One core of redis-server at this CPU per turn (the drivers, not Redis, limit this machine's run).
            "turns_per_s_per_redis_core": done / max(server_cpu, 1e-9),
        }
        print(json.dumps(out, indent=2))
    finally:
        stop_group(server, 5)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
