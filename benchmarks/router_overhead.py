"""Router overhead: C concurrent streaming chat conversations through a router vs straight to an emulated D.

Modes, measured in one run series on loopback: `direct` (client → D), `bpdkv` (client → bpdkv router → P → D,
sessions and reuse on, one process), `bpdkv-wN` for each worker count N > 1 of `--workers` (N worker processes
sharing the port, sessions in the redis-server the router starts itself), and `vllm-router` (the Rust PD router, PyPI
vllm-router 0.1.17, when its binary is given or on PATH). D is benchmarks/fastemu.py (a test double): 64 tokens,
first after 20 ms, then every 5 ms. On a many-core machine the load generator (`--client-procs`) and the emulator
(`--emulator-procs`, SO_REUSEPORT) run in several processes, so that neither caps what is measured.
Prints one JSON document: per mode and C, completed req/s, TTFT p50/p99, added TTFT vs direct, share of direct
throughput, and the router's CPU per request (from /proc/<pid>/stat of the router and its child processes: workers
and their redis-server count too, also shown apart), how the router's connections spread over its workers, and for
worker modes the Redis commands and bytes per request (INFO of its redis-server). --profile DIR runs, after the
measured rows, one more pass per bpdkv mode at the largest C under py-spy (`record --subprocesses`: CPU samples) and writes
collapsed stacks there; the JSON gets each profile's shares by category.

    python benchmarks/router_overhead.py --concurrency 16 64 256 --seconds 8 --workers 1 2 [--vllm-router PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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


def start_router(urls: dict[str, str], port: int, workers: int, work: Path, redis: bool = False) -> tuple[Proc, int | None]:
    """A real `bpdkv router` process in front of the emulated P and D; with workers > 1, their own redis-server
    (its port returned, for its INFO)."""
    from bpdkv.contracts import local_redis_conf

    config: dict[str, Any] = {
        "listen": "127.0.0.1",
        "port": port,
        "prefill": [{"name": "prefill-0", "url": urls["prefill"]}],
        "decode": [{"name": "decode-0", "url": urls["decode"]}],
        "health": {"interval": 5},
    }
    redis_port = None
    if workers > 1 or redis:
        redis_port = free_port()
        conf = work / f"redis-{port}.conf"
        conf.write_text(local_redis_conf("bench", redis_port, str(work)))
        config.update(workers=workers, state=f"redis://127.0.0.1:{redis_port}/0", local_redis_conf=str(conf))
    path = work / f"router-{port}.yaml"
    path.write_text(json.dumps(config))
    return Proc([sys.executable, "-m", "bpdkv.cli", "router", "--config", str(path), "--log-level", "warning"]), redis_port


TOKENS = 64  # D streams this many (the emulator's --tokens); set by main and load_worker
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
        while time.monotonic() < deadline:
            messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
            for turn in range(turns):
                if time.monotonic() >= deadline:
                    break
                messages.append({"role": "user", "content": f"conversation {cid} turn {turn}: next step?"})
                body = json.dumps({"model": "m", "messages": messages, "max_tokens": TOKENS, "stream": True, "ignore_eos": True}).encode()
                t0 = time.monotonic()
                try:
                    ttft, total, n = await one_request(reader, writer, body)
                except (RuntimeError, asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
                    results["errors"].append(str(exc)[:80])
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    break
                results["all"] += 1
                if t0 >= measure_from and time.monotonic() <= deadline:
                    results["ttft"].append(ttft)
                    results["total"].append(total)
                    results["done"] += 1
                messages.append({"role": "assistant", "content": "tok " * n})
    finally:
        writer.close()


async def load(port: int, concurrency: int, start: float, warmup: float, seconds: float, turns: int, first_cid: int = 0) -> dict[str, Any]:
    """`concurrency` conversations from monotonic time `start`; measured from start + warmup for `seconds`."""
    results: dict[str, Any] = {"ttft": [], "total": [], "done": 0, "all": 0, "errors": []}
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    measure_from = start + warmup
    deadline = measure_from + seconds
    await asyncio.gather(*(client(port, deadline, measure_from, results, first_cid + i, turns) for i in range(concurrency)))
    return results


def _use_loop(name: str) -> None:
    if name == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def load_worker(argv: list[str]) -> None:
    """One load-generator process (--client-procs > 1): its share of the conversations; results as JSON on stdout."""
    global TOKENS
    port, concurrency, first_cid, turns = (int(a) for a in argv[:4])
    start, warmup, seconds = (float(a) for a in argv[4:7])
    _use_loop(argv[7])
    TOKENS = int(argv[8])
    results = asyncio.run(load(port, concurrency, start, warmup, seconds, turns, first_cid))
    results["cpu_s"] = time.process_time()
    print(json.dumps(results))


def run_load(port: int, c: int, args: argparse.Namespace) -> tuple[dict[str, Any], float]:
    """(merged results, load-generator CPU seconds): in this process, or split over --client-procs processes."""
    start = time.monotonic() + (1.0 if args.client_procs > 1 else 0.0)  # their start-up
    if args.client_procs <= 1:
        own0 = time.process_time()
        _use_loop(args.client_loop)
        results = asyncio.run(load(port, c, start, args.warmup, args.seconds, args.turns))
        return results, time.process_time() - own0
    shares = [c // args.client_procs + (1 if i < c % args.client_procs else 0) for i in range(args.client_procs)]
    procs, first = [], 0
    for share in shares:
        if share:
            argv = [str(x) for x in (port, share, first, args.turns, start, args.warmup, args.seconds, args.client_loop, args.tokens)]
            procs.append(subprocess.Popen([sys.executable, __file__, "--load-worker", *argv], stdout=subprocess.PIPE))
        first += share
    merged: dict[str, Any] = {"ttft": [], "total": [], "done": 0, "all": 0, "errors": []}
    cpu = 0.0
    for proc in procs:
        out, _ = proc.communicate(timeout=args.warmup + args.seconds + 120)
        part = json.loads(out)
        for key in ("ttft", "total", "errors"):
            merged[key] += part[key]
        merged["done"] += part["done"]
        merged["all"] += part["all"]
        cpu += part["cpu_s"]
    return merged, cpu


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


def proc_cpu(pid: int) -> float:
    return sum(proc_cpu_split(pid))


def proc_cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of one process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK, int(fields[12]) / CLK


def ctx_switches(pids: list[int]) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of these processes, all their threads."""
    vol = invol = 0
    for p in pids:
        for task in Path(f"/proc/{p}/task").iterdir():
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    vol += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    invol += int(line.split()[1])
    return vol, invol


def proc_name(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def connections_per_process(pid: int, port: int) -> dict[str, int]:
    """Established client connections to `port` held by each process of the router's tree (how SO_REUSEPORT spread
    them), read from /proc/net/tcp and each process's fds."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "01" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    out = {}
    for p in tree(pid):
        n = 0
        try:
            for fd in Path(f"/proc/{p}/fd").iterdir():
                try:
                    link = os.readlink(fd)
                except OSError:
                    continue
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    n += 1
        except OSError:
            continue
        if n:
            out[f"{proc_name(p)}:{p}"] = n
    return out


def redis_info(port: int) -> dict[str, int]:
    """The counters of a redis-server's INFO stats and commandstats (calls per command)."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"INFO all\r\n")
        data = b""
        while True:
            data += s.recv(65536)
            head, _, rest = data.partition(b"\r\n")
            if head.startswith(b"$") and len(rest) >= int(head[1:]):
                break
    out: dict[str, int] = {}
    for line in rest.decode().splitlines():
        key, _, value = line.partition(":")
        if key in ("total_commands_processed", "total_net_input_bytes", "total_net_output_bytes"):
            out[key] = int(value)
        elif key.startswith("cmdstat_"):
            out["calls_" + key[8:]] = int(value.split("calls=", 1)[1].split(",", 1)[0])
    return out


class RedisProbe(threading.Thread):
    """PING the router's redis-server every 10 ms from outside the router: how fast Redis answers under this load."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.rtts, self.halt = port, [], threading.Event()

    def run(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self.halt.wait(0.01):
                t0 = time.perf_counter()
                s.sendall(b"PING\r\n")
                s.recv(64)
                self.rtts.append(time.perf_counter() - t0)

    def summary(self) -> dict[str, float]:
        self.halt.set()
        self.join(5)
        return {"pings": len(self.rtts), "rtt_p50_ms": 1000 * pct(self.rtts, 0.5), "rtt_p99_ms": 1000 * pct(self.rtts, 0.99)}


def router_counters(port: int) -> dict[str, float]:
    """Reuse outcomes, store errors and upstream errors from a bpdkv router's /metrics (all workers)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    out: dict[str, float] = {}
    for line in data.decode(errors="replace").split("\r\n\r\n", 1)[-1].splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("bpdkv_router_reuse_total", "bpdkv_router_store_errors_total", "bpdkv_router_upstream_errors_total"):
            key = line.rsplit(" ", 1)[0].replace("bpdkv_router_", "")
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def run_mode(
    mode: str, port: int, pid: int | None, emu_pids: list[int], c: int, args: argparse.Namespace, redis_port: int | None
) -> dict[str, Any]:
    procs = tree(pid) if pid else []
    split0 = {p: proc_cpu_split(p) for p in procs}
    per0 = {p: sum(v) for p, v in split0.items()}
    ctx0 = ctx_switches(procs)
    emu0, busy0 = sum(cpu_seconds(e) for e in emu_pids), machine_busy()
    info0 = redis_info(redis_port) if redis_port else None
    counters0 = router_counters(port) if mode.startswith("bpdkv") else None
    probe = RedisProbe(redis_port) if redis_port else None
    if probe is not None:
        probe.start()
    spread: dict[str, int] = {}
    sampler = None
    if pid:

        def sample() -> None:
            spread.update(connections_per_process(pid, port))

        sampler = threading.Timer(args.warmup + args.seconds / 2, sample)
        sampler.start()
    t0 = time.perf_counter()
    results, client_cpu = run_load(port, c, args)
    elapsed = time.perf_counter() - t0
    if sampler is not None:
        sampler.join()
    split1 = {p: proc_cpu_split(p) for p in procs}
    per = {p: sum(split1[p]) - per0[p] for p in procs}
    user = sum(split1[p][0] - split0[p][0] for p in procs)
    ctx1 = ctx_switches(procs)
    cpu = sum(per.values()) if pid else None
    busy1 = machine_busy()
    total_requests = results["done"]
    served = max(results["all"], 1)  # every request completed while the CPU was counted, warm-up included
    row: dict[str, Any] = {
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
        "served": results["all"],
        "router_cpu_ms_per_request": None if cpu is None else 1000 * cpu / served,
        "router_user_ms_per_request": None if cpu is None else 1000 * user / served,  # the rest is system time
        "router_rss_mb": None if pid is None else rss_bytes(pid) / 2**20,
        # Cores in use over the run: the load generator, the emulated P+D, the router, the machine (everything, other
        # work included). A load generator or emulator process near one core is itself a bottleneck.
        "cores": {
            "client": client_cpu / elapsed,
            "emulator": (sum(cpu_seconds(e) for e in emu_pids) - emu0) / elapsed,
            "router": None if cpu is None else cpu / elapsed,
            "machine": (busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1) * (os.cpu_count() or 1),
        },
        "wall_s": elapsed,
    }
    if pid:
        # Context switches of the router's processes per request: voluntary (it waited for I/O: one per loop
        # iteration that found nothing to do) and involuntary (preempted by another process wanting the core).
        row["router_ctx_switches_per_request"] = {"voluntary": (ctx1[0] - ctx0[0]) / served, "involuntary": (ctx1[1] - ctx0[1]) / served}
    if pid and len(procs) > 1:
        # Each process of the router apart (supervisor, workers, redis-server): cores over the run.
        row["router_processes"] = {f"{proc_name(p)}:{p}": round(v / elapsed, 3) for p, v in per.items()}
    if spread:
        row["client_connections"] = spread
    if counters0 is not None:
        # What the router did with sessions over the run (every turn after a conversation's first should be a hit).
        counters1 = router_counters(port)
        row["router_counters"] = {k: v - counters0.get(k, 0.0) for k, v in counters1.items() if v - counters0.get(k, 0.0)}
    if redis_port and info0 is not None and probe is not None:
        row["redis_ping"] = probe.summary()
        info1 = redis_info(redis_port)
        delta = {k: info1.get(k, 0) - info0.get(k, 0) for k in info1}
        row["redis_per_request"] = {
            "commands": delta["total_commands_processed"] / served,
            "bytes_in": delta["total_net_input_bytes"] / served,
            "bytes_out": delta["total_net_output_bytes"] / served,
            "by_command": {k[6:]: round(v / served, 3) for k, v in sorted(delta.items()) if k.startswith("calls_") and v},
        }
    return row


CATEGORIES = {
    # substring of a frame (file or function) → category; the first that matches a stack's frames counts it
    "redis client (bpdkv.router.resp / redis-py)": ("router/resp.py", "/redis/"),
    "metrics (prometheus_client)": ("prometheus_client",),
    "relay to the client": ("router/relay.py",),
    "upstream client (P, D)": ("router/upstream_http.py",),
    "identity digests": ("router/sessions.py",),
}


def profile_summary(path: Path) -> dict[str, Any]:
    """Shares of a py-spy raw (collapsed) profile: idle (--idle: the process waited in epoll), then categories."""
    total = idle = 0
    counts: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        k = int(n)
        total += k
        leaf = stack.rsplit(";", 1)[-1]
        if "(idle)" in stack or leaf.startswith("run_forever") or leaf.startswith("select ("):
            idle += k
            continue
        for name, needles in CATEGORIES.items():
            if any(needle in stack for needle in needles):
                counts[name] += k
                break
    busy = max(total - idle, 1)
    return {
        "samples": total,
        "idle_share": idle / max(total, 1),
        "of_busy_samples": {name: round(v / busy, 3) for name, v in counts.items()},
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--load-worker":
        load_worker(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=1.5)
    ap.add_argument("--turns", type=int, default=6, help="turns per conversation before a new one starts")
    ap.add_argument("--tokens", type=int, default=64, help="tokens D streams per request (the capacity model's per-token cost)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="bpdkv worker counts, one mode each (1 = one process)")
    ap.add_argument("--client-procs", type=int, default=1, help="load-generator processes (1: in this process)")
    ap.add_argument("--emulator-procs", type=int, default=1, help="emulated P/D processes sharing their ports")
    ap.add_argument("--vllm-router", default=shutil.which("vllm-router"), help="path of the vllm-router binary (peer)")
    ap.add_argument(
        "--client-loop",
        choices=["uvloop", "asyncio"],
        default="uvloop",
        help="the load generator's event loop (sessions 1-4 ran asyncio's; uvloop leaves more of the cores to the measured)",
    )
    ap.add_argument("--modes", nargs="+", default=["direct", "bpdkv", "vllm-router"], help="bpdkv = every --workers count")
    ap.add_argument("--note", default="", help="what else shared the hardware (written into the JSON)")
    ap.add_argument("--profile", type=Path, default=None, help="folder for py-spy profiles of the bpdkv modes at the largest C")
    args = ap.parse_args()
    global TOKENS
    TOKENS = args.tokens
    # SIGTERM (timeout, a CI stop) ends the run through the finally below: every process it started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="router-overhead-"))

    procs: list[Proc] = []
    out: dict[str, Any] = {
        "benchmark": "router_overhead",
        "machine": {"cpus": os.cpu_count(), "shared_with": args.note},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": [],
    }
    try:
        emu_argv = [sys.executable, str(ROOT / "benchmarks" / "fastemu.py"), "--max-seconds", "1800", "--tokens", str(args.tokens)]
        if args.emulator_procs > 1:
            emu_argv += ["--port-p", str(free_port()), "--port-d", str(free_port()), "--reuse-port"]
        emus = [Proc(emu_argv) for _ in range(max(1, args.emulator_procs))]
        procs += emus
        urls = {}
        for emu in emus:
            assert emu.popen.stdout is not None
            urls = json.loads(emu.popen.stdout.readline())
        d_port = int(urls["decode"].rsplit(":", 1)[1])
        wait_http(d_port)
        emu_pids = [e.popen.pid for e in emus]
        routers: dict[str, tuple[int, int, int | None]] = {"direct": (d_port, 0, None)}
        order = ["direct"]
        if "bpdkv" in args.modes:
            for workers in args.workers:
                mode = "bpdkv" if workers == 1 else f"bpdkv-w{workers}"
                port = free_port()
                r, redis_port = start_router(urls, port, workers, work)
                procs.append(r)
                wait_http(port)
                routers[mode] = (port, r.popen.pid, redis_port)
                order.append(mode)
        if "bpdkv-redis" in args.modes:
            # Diagnosis: one process with its sessions in Redis (a supervisor, one worker, redis-server): the store's
            # cost without the split over processes.
            port = free_port()
            r, redis_port = start_router(urls, port, 1, work, redis=True)
            procs.append(r)
            wait_http(port)
            routers["bpdkv-redis"] = (port, r.popen.pid, redis_port)
            order.append("bpdkv-redis")
        if "vllm-router" in args.modes and args.vllm_router:
            port = free_port()
            argv = [args.vllm_router, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation"]
            argv += ["--prefill", urls["prefill"], "--decode", urls["decode"], "--policy", "round_robin", "--log-level", "warning"]
            r = Proc([*argv, "--prometheus-port", str(free_port())])
            procs.append(r)
            wait_http(port, "/health", 60)
            routers["vllm-router"] = (port, r.popen.pid, None)
            order.append("vllm-router")
        elif "vllm-router" in args.modes:
            out["vllm_router"] = "not run: binary not found (pip install vllm-router==0.1.17, then pass --vllm-router)"
        for c in args.concurrency:
            direct = None
            for mode in order:
                port, pid, redis_port = routers[mode]
                res = run_mode(mode, port, pid or None, emu_pids, c, args, redis_port)
                if mode == "direct":
                    direct = res
                elif direct:
                    res["added_ttft_p50_ms"] = res["ttft_p50_ms"] - direct["ttft_p50_ms"]
                    res["added_ttft_p99_ms"] = res["ttft_p99_ms"] - direct["ttft_p99_ms"]
                    res["throughput_share_of_direct"] = res["req_per_s"] / direct["req_per_s"] if direct["req_per_s"] else None
                out["runs"].append(res)
                print(json.dumps(res), file=sys.stderr, flush=True)
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if args.profile and Path(spy).exists():
            # After the measured rows: py-spy's sampling costs CPU, so these rows' figures are not comparable.
            args.profile.mkdir(parents=True, exist_ok=True)
            c = max(args.concurrency)
            out["profiles"] = []
            for mode in order:
                if not mode.startswith("bpdkv"):
                    continue
                port, pid, redis_port = routers[mode]
                target = args.profile / f"profile-{mode}-c{c}.collapsed.txt"
                argv = [spy, "record", "-p", str(pid), "-o", str(target), "-d", str(int(args.seconds + args.warmup)), "-r", "200"]
                recorder = subprocess.Popen(
                    [*argv, "--format", "raw", "--subprocesses"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                res = run_mode(mode, port, pid, emu_pids, c, args, redis_port)
                recorder.wait(60)
                summary = profile_summary(target) if target.exists() else {"missing": True}
                out["profiles"].append({"mode": mode, "concurrency": c, "file": target.name, "req_per_s": res["req_per_s"], **summary})
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
