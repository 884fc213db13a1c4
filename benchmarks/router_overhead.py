"""Router overhead: C concurrent streaming chat conversations through a router vs straight to an emulated D.

Modes, measured in one run series on loopback: `direct` (client → D), `bpdkv` (client → bpdkv router → P → D,
sessions and reuse on, one process), `bpdkv-w2` (two worker processes sharing the port, sessions in the redis-server
the router starts itself), and `vllm-router` (the Rust PD router, PyPI vllm-router 0.1.17, when its binary is given
or on PATH). D is benchmarks/fastemu.py (a test double): 64 tokens, first after 20 ms, then every 5 ms.
Prints one JSON document: per mode and C, completed req/s, TTFT p50/p99, added TTFT vs direct, share of direct
throughput, and the router's CPU per request (from /proc/<pid>/stat of the router and its child processes: workers
and their redis-server count too). --profile writes a py-spy profile of the one-process router at the largest C.

    python benchmarks/router_overhead.py --concurrency 16 64 256 --seconds 8 [--vllm-router /path/to/vllm-router]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bpdkv.lab.ports import free_port
from bpdkv.lab.processes import stop_group

ROOT = Path(__file__).resolve().parent.parent
CLK = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """The process and its descendants (a multi-worker router: supervisor, workers, redis-server)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            todo += [int(c) for c in task.read_text().split()]
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process tree (threads included; every process in it is alive for the whole run)."""
    total = 0
    for p in tree(pid):
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / CLK


def rss_bytes(pid: int) -> int:
    total = 0
    for p in tree(pid):
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def wait_http(port: int, path: str = "/health", timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"nothing healthy on port {port} after {timeout}s")


class Proc:
    """A child process we started; ended by PID, bounded lifetime."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True)

    def stop(self) -> None:
        stop_group(self.popen, grace=10)


def start_router(urls: dict[str, str], port: int, workers: int, work: Path) -> Proc:
    """A real `bpdkv router` process in front of the emulated P and D; with workers > 1, their own redis-server."""
    from bpdkv.router.config import local_redis_conf

    config: dict[str, Any] = {
        "listen": "127.0.0.1",
        "port": port,
        "prefill": [{"name": "prefill-0", "url": urls["prefill"]}],
        "decode": [{"name": "decode-0", "url": urls["decode"]}],
        "health": {"interval": 5},
    }
    if workers > 1:
        redis_port = free_port()
        conf = work / f"redis-{port}.conf"
        conf.write_text(local_redis_conf("bench", redis_port, str(work)))
        config.update(workers=workers, state=f"redis://127.0.0.1:{redis_port}/0", local_redis_conf=str(conf))
    path = work / f"router-{port}.yaml"
    path.write_text(json.dumps(config))
    return Proc([sys.executable, "-m", "bpdkv.cli", "router", "--config", str(path), "--log-level", "warning"])


SYSTEM = "You are a terse assistant answering benchmark questions. " * 4


async def one_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> tuple[float, float, int]:
    """One streamed request on a kept-alive connection: (TTFT, total seconds, content events). The chunked body is
    parsed from whatever each socket read brought (one await per read, not two per chunk): the load generator
    shares the cores with what it measures, so it must cost as little as it can — the same for every mode."""
    start = time.perf_counter()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (len(body), body)
    )
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.split(b"\r\n", 1)[0].decode())
    lower = head.lower()
    ttft = 0.0
    if b"transfer-encoding: chunked" not in lower:
        length = int(lower.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        data = await reader.readexactly(length)
        return time.perf_counter() - start, time.perf_counter() - start, data.count(b'"content":"tok "')
    data = bytearray()
    buf = b""
    at = 0  # where the next chunk's size line starts in buf
    while True:
        while True:  # every whole chunk in buf
            eol = buf.find(b"\r\n", at)
            if eol < 0:
                break
            size = int(buf[at:eol].split(b";", 1)[0], 16)
            if size == 0:
                if len(buf) < eol + 4:
                    break  # the final CRLF is still to come
                if len(buf) > eol + 4:
                    raise RuntimeError("bytes after the end of a chunked response")
                return ttft, time.perf_counter() - start, data.count(b'"content":"tok "')
            end = eol + 2 + size
            if len(buf) < end + 2:
                break
            if not ttft:
                ttft = time.perf_counter() - start
            data += buf[eol + 2 : end]
            at = end + 2
        buf = buf[at:]
        at = 0
        more = await reader.read(65536)
        if not more:
            raise asyncio.IncompleteReadError(buf, None)
        buf += more


async def client(port: int, deadline: float, measure_from: float, results: dict[str, Any], cid: int, turns: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < deadline:
            messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
            for turn in range(turns):
                if time.perf_counter() >= deadline:
                    break
                messages.append({"role": "user", "content": f"conversation {cid} turn {turn}: next step?"})
                body = json.dumps({"model": "m", "messages": messages, "max_tokens": 64, "stream": True, "ignore_eos": True}).encode()
                t0 = time.perf_counter()
                try:
                    ttft, total, n = await one_request(reader, writer, body)
                except (RuntimeError, asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
                    results["errors"].append(str(exc)[:80])
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    break
                if t0 >= measure_from and time.perf_counter() <= deadline:
                    results["ttft"].append(ttft)
                    results["total"].append(total)
                    results["done"] += 1
                messages.append({"role": "assistant", "content": "tok " * n})
    finally:
        writer.close()


async def load(port: int, concurrency: int, seconds: float, warmup: float, turns: int) -> dict[str, Any]:
    results: dict[str, Any] = {"ttft": [], "total": [], "done": 0, "errors": []}
    start = time.perf_counter()
    measure_from = start + warmup
    deadline = measure_from + seconds
    await asyncio.gather(*(client(port, deadline, measure_from, results, i, turns) for i in range(concurrency)))
    return results


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def run_mode(mode: str, port: int, pid: int | None, emu_pid: int, c: int, args: argparse.Namespace) -> dict[str, Any]:
    cpu0 = cpu_seconds(pid) if pid else 0.0
    emu0, own0, busy0 = cpu_seconds(emu_pid), time.process_time(), machine_busy()
    t0 = time.perf_counter()
    if args.client_loop == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    results = asyncio.run(load(port, c, args.seconds, args.warmup, args.turns))
    elapsed = time.perf_counter() - t0
    cpu = (cpu_seconds(pid) - cpu0) if pid else None
    busy1 = machine_busy()
    total_requests = results["done"]
    return {
        "mode": mode,
        "concurrency": c,
        "completed": total_requests,
        "req_per_s": total_requests / args.seconds,
        "ttft_p50_ms": 1000 * pct(results["ttft"], 0.5),
        "ttft_p99_ms": 1000 * pct(results["ttft"], 0.99),
        "e2e_p50_ms": 1000 * pct(results["total"], 0.5),
        "errors": len(results["errors"]),
        "error_samples": sorted(set(results["errors"]))[:3],
        # CPU over the whole run (warm-up included) divided by all requests it served, measured ones or not.
        "router_cpu_ms_per_request": None
        if cpu is None
        else 1000 * cpu / max(total_requests * (args.seconds + args.warmup) / args.seconds, 1),
        "router_rss_mb": None if pid is None else rss_bytes(pid) / 2**20,
        # Cores in use over the run: the load generator (this process), the emulated P+D, the router, the machine
        # (everything, other work included). A load generator near one core is itself a bottleneck.
        "cores": {
            "client": (time.process_time() - own0) / elapsed,
            "emulator": (cpu_seconds(emu_pid) - emu0) / elapsed,
            "router": None if cpu is None else cpu / elapsed,
            "machine": (busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1) * (os.cpu_count() or 1),
        },
        "wall_s": elapsed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=1.5)
    ap.add_argument("--turns", type=int, default=6, help="turns per conversation before a new one starts")
    ap.add_argument("--vllm-router", default=shutil.which("vllm-router"), help="path of the vllm-router binary (peer)")
    ap.add_argument(
        "--client-loop",
        choices=["uvloop", "asyncio"],
        default="uvloop",
        help="the load generator's event loop (sessions 1-4 ran asyncio's; uvloop leaves more of the cores to the measured)",
    )
    ap.add_argument("--modes", nargs="+", default=["direct", "bpdkv", "bpdkv-w2", "vllm-router"])
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="py-spy profile of the one-process router at the largest C: flame graph (.svg) or collapsed stacks (.txt)",
    )
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="router-overhead-"))

    procs: list[Proc] = []
    out: dict[str, Any] = {"benchmark": "router_overhead", "machine": {"cpus": os.cpu_count()}, "runs": []}
    try:
        emu = Proc([sys.executable, str(ROOT / "benchmarks" / "fastemu.py"), "--max-seconds", "1800"])
        procs.append(emu)
        assert emu.popen.stdout is not None
        urls = json.loads(emu.popen.stdout.readline())
        d_port = int(urls["decode"].rsplit(":", 1)[1])
        wait_http(d_port)
        routers: dict[str, tuple[int, int]] = {"direct": (d_port, 0)}
        for mode, workers in (("bpdkv", 1), ("bpdkv-w2", 2)):
            if mode in args.modes:
                port = free_port()
                r = start_router(urls, port, workers, work)
                procs.append(r)
                wait_http(port)
                routers[mode] = (port, r.popen.pid)
        if "vllm-router" in args.modes and args.vllm_router:
            port = free_port()
            r = Proc(
                [
                    args.vllm_router,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--vllm-pd-disaggregation",
                    "--prefill",
                    urls["prefill"],
                    "--decode",
                    urls["decode"],
                    "--policy",
                    "round_robin",
                    "--log-level",
                    "warning",
                    "--prometheus-port",
                    str(free_port()),
                ]
            )
            procs.append(r)
            wait_http(port, "/health", 60)
            routers["vllm-router"] = (port, r.popen.pid)
        elif "vllm-router" in args.modes:
            out["vllm_router"] = "not run: binary not found (pip install vllm-router==0.1.17, then pass --vllm-router)"
        for c in args.concurrency:
            direct = None
            for mode in ("direct", "bpdkv", "bpdkv-w2", "vllm-router"):
                if mode not in routers:
                    continue
                port, pid = routers[mode]
                spy = None
                if args.profile and mode == "bpdkv" and c == max(args.concurrency) and shutil.which("py-spy"):
                    spy = subprocess.Popen(
                        [
                            "py-spy",
                            "record",
                            "-p",
                            str(pid),
                            "-o",
                            str(args.profile),
                            "-d",
                            str(int(args.seconds + args.warmup)),
                            "-r",
                            "200",
                            *(["--format", "raw"] if args.profile.suffix == ".txt" else []),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                res = run_mode(mode, port, pid or None, emu.popen.pid, c, args)
                if spy is not None:
                    spy.wait(60)
                    res["profiled"] = True  # py-spy's sampling costs CPU: this row's CPU figures are not comparable
                if mode == "direct":
                    direct = res
                elif direct:
                    res["added_ttft_p50_ms"] = res["ttft_p50_ms"] - direct["ttft_p50_ms"]
                    res["added_ttft_p99_ms"] = res["ttft_p99_ms"] - direct["ttft_p99_ms"]
                    res["throughput_share_of_direct"] = res["req_per_s"] / direct["req_per_s"] if direct["req_per_s"] else None
                out["runs"].append(res)
                print(json.dumps(res), file=sys.stderr, flush=True)
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
