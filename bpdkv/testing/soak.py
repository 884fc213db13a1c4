"""A soak of a real `bpdkv router` process in front of emulated P and D (test doubles) that are restarted during it.

Clients hold multi-turn conversations (streamed and not) for `duration` seconds; every `restart_every` seconds one
upstream (P and D in turn) is killed, stays down `down_seconds`, and comes back on the same port as a new engine (its
held blocks gone, like a restarted vLLM). Every answer is checked against the emulator's single-server reference.
The report says which requests failed and whether each failure overlapped the death of an upstream (the only
failures allowed: the killed upstream's in-flight requests, with a clean error, never a hang), and samples the
router's RSS. Used by tests/router/test_soak.py (short) and benchmarks/router_soak.py (10 minutes, JSON).
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bpdkv import contracts
from bpdkv.lab.ports import free_port
from bpdkv.lab.processes import stop_group
from bpdkv.sse import read_stream
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator


class Outcome(enum.Enum):
    OK = "ok"
    WRONG_ANSWER = "wrong_answer"  # 200 but not what a single server answers
    CLEAN_ERROR = "clean_error"  # an HTTP error status, or a stream that ended early without [DONE]
    HANG = "hang"  # no complete answer within the client's timeout


@dataclass(frozen=True)
class SoakSettings:
    duration: float = 600.0
    concurrency: int = 6
    turns: int = 4
    restart_every: float = 20.0
    down_seconds: float = 2.0
    request_timeout: float = 30.0
    max_tokens: int = 24
    think_seconds: float = 0.0  # pause between turns (an agent running its tools): conversations outlive restarts
    decoder_ttl: float = 30.0  # short, so the router's sessions expire during the soak and memory must stay flat
    token_interval: float = 0.004
    rss_every: float = 2.0
    warmup_fraction: float = 0.2  # RSS before this share of the run is warm-up


@dataclass(frozen=True)
class RequestRecord:
    started: float  # seconds since the soak began
    ended: float
    stream: bool
    outcome: Outcome
    status: int | None
    detail: str = ""


@dataclass(frozen=True)
class Restart:
    upstream: str
    killed_at: float
    back_at: float


@dataclass
class SoakReport:
    settings: SoakSettings
    records: list[RequestRecord] = field(default_factory=list)
    restarts: list[Restart] = field(default_factory=list)
    rss_mb: list[tuple[float, float]] = field(default_factory=list)
    wrong_kv_tokens: float = 0.0  # KV of other tokens pulled by a P (a history merged with another): must stay 0
    pulls: float = 0.0  # P's pulls of D's blocks: the soak exercised reuse through P
    local_turns: float = 0.0  # turns D continued from its own hold (decode_local)

    def overlaps_a_death(self, r: RequestRecord) -> bool:
        """In flight when an upstream was killed (its shutdown takes up to the graceful timeout)."""
        return any(r.started <= k.killed_at + 0.5 and r.ended >= k.killed_at for k in self.restarts)

    def failures(self) -> list[RequestRecord]:
        """Failures not excused by a death: any hang or wrong answer, and clean errors of requests not in flight then."""
        return [
            r
            for r in self.records
            if r.outcome in (Outcome.HANG, Outcome.WRONG_ANSWER) or (r.outcome is Outcome.CLEAN_ERROR and not self.overlaps_a_death(r))
        ]

    def rss_growth_mb(self) -> float:
        """Median RSS of the last fifth minus the median just after warm-up."""
        start = self.settings.duration * self.settings.warmup_fraction
        after = [mb for t, mb in self.rss_mb if t >= start]
        if len(after) < 4:
            return 0.0
        fifth = max(len(after) // 5, 1)
        return _median(after[-fifth:]) - _median(after[:fifth])

    def summary(self) -> dict[str, Any]:
        counts = {o.value: sum(1 for r in self.records if r.outcome is o) for o in Outcome}
        return {
            "settings": asdict(self.settings),
            "requests": len(self.records),
            "outcomes": counts,
            "excused_errors": sum(1 for r in self.records if r.outcome is Outcome.CLEAN_ERROR and self.overlaps_a_death(r)),
            "failures": [dict(asdict(r), outcome=r.outcome.value) for r in self.failures()][:50],
            "restarts": [asdict(k) for k in self.restarts],
            "rss_mb_first": self.rss_mb[0][1] if self.rss_mb else None,
            "rss_mb_last": self.rss_mb[-1][1] if self.rss_mb else None,
            "rss_growth_mb": round(self.rss_growth_mb(), 2),
            "wrong_kv_tokens": self.wrong_kv_tokens,
            "pulls": self.pulls,
            "local_turns": self.local_turns,
            "latency_p50_s": round(_median([r.ended - r.started for r in self.records if r.outcome is Outcome.OK] or [0.0]), 4),
        }


def _median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if s else 0.0


class Upstream:
    """One emulated vLLM server on a fixed port, restartable as a new engine."""

    def __init__(self, name: str, settings: EmulatorSettings) -> None:
        self.name = name
        self.settings = settings
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.emulator: VllmEmulator | None = None
        self.group: ServerGroup | None = None
        self.past: list[VllmEmulator] = []  # engines killed before: their counters still count

    def counter(self, name: str) -> float:
        return sum(e.counters.get(name, 0) for e in [*self.past, *([self.emulator] if self.emulator else [])])

    def start(self) -> None:
        self.emulator = VllmEmulator(self.settings)
        self.group = ServerGroup([self.emulator.app], ports=[self.port])
        self.group.start()

    def kill(self) -> None:
        assert self.group is not None and self.emulator is not None
        self.emulator.close()  # its engine leaves the fabric: its blocks can no longer be pulled
        self.group.crash()
        self.past.append(self.emulator)


def router_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class SoakFleet:
    """2 P + 2 D emulators and one `bpdkv router` process (health checks every second, short timeouts)."""

    def __init__(self, settings: SoakSettings, workdir: Path) -> None:
        p = EmulatorSettings(role="prefill", decoder_kv_blocks_ttl=settings.decoder_ttl, kv_recompute_threshold=16)
        d = EmulatorSettings(
            role="decode", decoder_kv_blocks_ttl=settings.decoder_ttl, kv_recompute_threshold=16, token_interval=settings.token_interval
        )
        self.upstreams = [Upstream("prefill-0", p), Upstream("decode-0", d), Upstream("prefill-1", p), Upstream("decode-1", d)]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "listen": "127.0.0.1",
            "port": self.port,
            "prefill": [{"name": u.name, "url": u.url} for u in self.upstreams if u.name.startswith("prefill")],
            "decode": [{"name": u.name, "url": u.url} for u in self.upstreams if u.name.startswith("decode")],
            "timeouts": {"connect": 2, "prefill": 10, "decode_first_byte": 10, "decode_idle": 10},
            "health": {"interval": 1, "failures_to_eject": 1, "backoff_max": 2},
        }
        self.config_path = workdir / "router.json"
        self.config_path.write_text(json.dumps(config))
        self.log = workdir / "router.log"
        self.router: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        for u in self.upstreams:
            u.start()
        argv = [sys.executable, "-m", "bpdkv.cli", "router", "--config", str(self.config_path), "--log-level", "warning"]
        self.router = subprocess.Popen(
            ["timeout", "3600", *argv], stdout=self.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"router exited {self.router.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"router not healthy after 30 s: {self.log.read_text()[-2000:]}")

    def router_pid(self) -> int:
        """The router's own process (under `timeout`, in its own group)."""
        assert self.router is not None
        out = subprocess.run(["pgrep", "-P", str(self.router.pid)], capture_output=True, text=True).stdout.split()
        return int(out[0]) if out else self.router.pid

    def stop(self) -> None:
        if self.router is not None:
            stop_group(self.router, grace=10)
        for u in self.upstreams:
            if u.group is not None:
                u.group.stop()


def reference_answer(messages: list[dict[str, Any]], max_tokens: int) -> str:
    """What a single (emulated) vLLM answers: the emulator's generation is a pure function of the prompt."""
    output, _ = VllmEmulator.generate(VllmEmulator.chat_tokens(messages), max_tokens, False)
    return bytes(output).decode()


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout: float) -> tuple[Outcome, int | None, str, str]:
    """(outcome, status, answer text, detail); a request with no complete answer within `timeout` is a hang."""
    try:
        return await asyncio.wait_for(_exchange(client, url, body), timeout)
    except asyncio.TimeoutError:
        return Outcome.HANG, None, "", f"no answer within {timeout} s"
    except httpx.HTTPError as exc:  # the router closed the connection: a clean (if abrupt) error, not a hang
        return Outcome.CLEAN_ERROR, None, "", f"{type(exc).__name__}: {exc}"


async def _exchange(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[Outcome, int | None, str, str]:
    if not body.get("stream"):
        resp = await client.post(url, json=body)
        if resp.status_code != 200:
            return Outcome.CLEAN_ERROR, resp.status_code, "", resp.text[:200]
        return Outcome.OK, 200, resp.json()["choices"][0]["message"]["content"], ""
    parts: list[str] = []
    done = False
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            return Outcome.CLEAN_ERROR, resp.status_code, "", (await resp.aread()).decode()[:200]
        async for line in resp.aiter_lines():
            got = read_stream([line])  # the one SSE parser, a line at a time (an error event ends the exchange at once)
            done = done or got.done
            for event in got.events:
                if "error" in event:
                    return Outcome.CLEAN_ERROR, 200, "", json.dumps(event)[:200]
                parts += [(ch.get("delta") or {}).get("content") or "" for ch in event.get("choices", [])]
    if not done:
        return Outcome.CLEAN_ERROR, 200, "", "stream ended without [DONE]"
    return Outcome.OK, 200, "".join(parts), ""


SHARED_SESSION = "soak-shared-session"
BRANCH_BASE = [
    {"role": "system", "content": "A history that several clients continue at once. " * 6},
    {"role": "user", "content": "Where do we start?"},
]


async def _client(fleet: SoakFleet, settings: SoakSettings, report: SoakReport, t0: float, cid: int, stop_at: float) -> None:
    """Three kinds of client, by cid % 3: plain conversations; conversations that all name one X-Session-Id (each
    claims the others' session: the router must never hand one history's KV to another); branches of one shared
    history, sent concurrently. Every second group of three sends each turn through P (pull-only), the others let the
    router continue short turns on D (decode_local), so both reuse paths run under the restarts."""
    url = fleet.url + "/v1/chat/completions"
    kind = cid % 3
    headers = {"X-Session-Id": SHARED_SESSION} if kind == 1 else {}
    if (cid // 3) % 2 == 1:
        headers[contracts.PATHS_HEADER] = contracts.PATHS_PULL_ONLY
    conv = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(settings.request_timeout), headers=headers) as client:
        while time.monotonic() < stop_at:
            conv += 1
            if kind == 2:
                messages = [*BRANCH_BASE, {"role": "assistant", "content": reference_answer(BRANCH_BASE, settings.max_tokens)}]
            else:
                messages = [{"role": "system", "content": f"Soak client {cid}, conversation {conv}. " * 6}]
            for turn in range(settings.turns):
                if time.monotonic() >= stop_at:
                    return
                messages.append({"role": "user", "content": f"Question {turn} of client {cid}: tell me about topic {conv * 31 + turn}."})
                stream = (cid + turn) % 2 == 0
                body = {"model": "emulated", "messages": messages, "max_tokens": settings.max_tokens, "stream": stream}
                started = time.monotonic() - t0
                outcome, status, text, detail = await _one(client, url, body, settings.request_timeout)
                if outcome is Outcome.OK and text != reference_answer(messages, settings.max_tokens):
                    outcome, detail = Outcome.WRONG_ANSWER, f"got {text!r}"
                report.records.append(RequestRecord(started, time.monotonic() - t0, stream, outcome, status, detail))
                if outcome is not Outcome.OK:
                    break  # start a new conversation
                messages.append({"role": "assistant", "content": text})
                if settings.think_seconds and cid % 2:
                    await asyncio.sleep(settings.think_seconds * (1 + (cid + turn) % 3) / 2)


async def _restarter(fleet: SoakFleet, settings: SoakSettings, report: SoakReport, t0: float, stop_at: float) -> None:
    i = 0
    while True:
        await asyncio.sleep(settings.restart_every)
        if time.monotonic() + settings.down_seconds + 1 >= stop_at:
            return
        upstream = fleet.upstreams[i % len(fleet.upstreams)]
        i += 1
        killed_at = time.monotonic() - t0
        await asyncio.to_thread(upstream.kill)
        await asyncio.sleep(settings.down_seconds)
        await asyncio.to_thread(upstream.start)
        report.restarts.append(Restart(upstream.name, round(killed_at, 3), round(time.monotonic() - t0, 3)))


async def _rss(fleet: SoakFleet, settings: SoakSettings, report: SoakReport, t0: float, stop_at: float) -> None:
    pid = fleet.router_pid()
    while time.monotonic() < stop_at:
        report.rss_mb.append((round(time.monotonic() - t0, 2), round(router_rss_mb(pid), 2)))
        await asyncio.sleep(settings.rss_every)


async def _soak(fleet: SoakFleet, settings: SoakSettings) -> SoakReport:
    report = SoakReport(settings)
    t0 = time.monotonic()
    stop_at = t0 + settings.duration
    tasks = [_client(fleet, settings, report, t0, cid, stop_at) for cid in range(settings.concurrency)]
    await asyncio.gather(*tasks, _restarter(fleet, settings, report, t0, stop_at), _rss(fleet, settings, report, t0, stop_at))
    report.wrong_kv_tokens = sum(u.counter("emulator_wrong_kv_tokens") for u in fleet.upstreams)
    report.pulls = sum(u.counter("nixl_xfer_count") for u in fleet.upstreams if u.name.startswith("prefill"))
    report.local_turns = sum(u.counter("emulator_local_turns") for u in fleet.upstreams if u.name.startswith("decode"))
    return report


def run_soak(settings: SoakSettings, workdir: Path | None = None) -> SoakReport:
    """Start the fleet, soak, stop everything (also on failure). Bounded: duration + the clients' timeout."""
    with tempfile.TemporaryDirectory(prefix="bpdkv-soak-") as tmp:
        fleet = SoakFleet(settings, workdir or Path(tmp))
        try:
            fleet.start()
            return asyncio.run(_soak(fleet, settings))
        finally:
            fleet.stop()
            if os.environ.get("BPDKV_KEEP_LOGS") and fleet.log.exists():
                Path(os.environ["BPDKV_KEEP_LOGS"]).mkdir(parents=True, exist_ok=True)
                (Path(os.environ["BPDKV_KEEP_LOGS"]) / "soak-router.log").write_bytes(fleet.log.read_bytes())
