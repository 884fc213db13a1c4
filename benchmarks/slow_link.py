"""Reuse on vs off across P→D link rates (issue 21): real vLLM-CPU P and D on two lab test hosts (network namespaces),
the link between them throttled by `tc` tbf on both hosts' eth0. JSON out. The model: tests/e2e/wide_model.py (the
tiny model's 2 KiB of KV per token, P computing ~1,000 tokens/s here): unthrottled (~100 MB/s over veth) a pull is
~50x faster than computing, at 16 mbit about break-even, at 2 mbit ~10x slower.

Per rate, each mode on fresh servers, the same workload (token-id conversations, round robin, P's cache salted every
turn so that P must pull or compute the history — the case reuse is for):
- `off`: P gets no D params and computes every prompt;
- then `bpdkv calibrate` on those (warm) servers measures the link and P's compute: the seed a fleet gets from it;
- `on`: P with the cost model, seeded by that calibration (the deployment flow: calibrate, merge, apply);
- at the unthrottled rate also `on_threshold`: today's rule (`bpdkv_pull_decision: threshold`), for "no worse than today";
- at the rates named by --spin-rates also `on_spin`: reuse on with upstream's engine loop (`bpdkv_idle_wait: 0`), which
  steps every ~1 ms while the engine only holds KV (bpdkv/vllm_plugin/idle.py): the cause of the declined-offer cost
  (issue 41), measured beside its fix.
TTFT = P's answer + D's first streamed token, measured by the client; turns >= 2 are summarised. Each mode also records
the CPU seconds P's and D's processes used during its workload (P and D share this machine's cores).

Needs root (test hosts) and the vLLM-CPU venv; run it under the machine-wide lock:
  flock /tmp/bpdkv-heavy.lock timeout 1800 .venv/bin/python benchmarks/slow_link.py
Writes benchmarks/results/slow_link/summary.json and raw.json.

`--diagnose-hold` instead starts one P and D on loopback, makes one P/D turn (D then holds its blocks), and prints the
CPU each thread of P and D uses over a few seconds before and while D holds, with gdb's line for each server's busiest
thread (issue 41 item 1: what in D takes CPU from P while it holds). Also under the lock.
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

from bpdkv import contracts
from bpdkv.bench.calibrate import calibrate
from bpdkv.lab.hosts import TestHosts
from bpdkv.prometheus_text import metric_value
from tests.e2e.conftest import MODEL_DIR, VLLM_PYTHON, VllmServer
from tests.e2e.wide_model import DEFAULT as WIDE_MODEL

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "slow_link"
COMPLETIONS = "/v1/completions"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def stream_turn(d_url: str, body: dict[str, Any], timeout: float = 300) -> tuple[list[int], dict[str, Any] | None, float]:
    """D's streamed answer: (token ids, D's final kv_transfer_params, seconds to the first token)."""
    start = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    params = None
    with httpx.stream("POST", d_url + COMPLETIONS, json=dict(body, stream=True), timeout=timeout) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get(contracts.KV_TRANSFER_PARAMS):
                params = event[contracts.KV_TRANSFER_PARAMS]
            for choice in event.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids and first is None:
                    first = time.perf_counter() - start
                tokens += ids
    return tokens, params, first if first is not None else time.perf_counter() - start


def conversation_start(c: int, tokens: int) -> list[int]:
    return [(i * 37 + c * 101) % 1900 + 10 for i in range(tokens)]


def run_workload(p_url: str, d_url: str, reuse: bool, args: argparse.Namespace) -> list[dict[str, Any]]:
    prompts = [conversation_start(c, args.start_tokens) for c in range(args.conversations)]
    offers: list[dict[str, Any] | None] = [None] * args.conversations
    rows = []
    for turn in range(1, args.turns + 1):
        for c in range(args.conversations):  # round robin: D holds every conversation between its turns
            body = {"model": "tiny", "prompt": prompts[c], "max_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True}
            offer = offers[c] if reuse else None
            p_body = dict(body, max_tokens=1, kv_transfer_params=offer or contracts.prefill_template(), cache_salt=uuid.uuid4().hex)
            start = time.perf_counter()
            p_resp = httpx.post(p_url + COMPLETIONS, json=p_body, timeout=300)
            p_resp.raise_for_status()
            p_s = time.perf_counter() - start
            p_params = p_resp.json()[contracts.KV_TRANSFER_PARAMS]
            d_body = dict(body, return_token_ids=True, kv_transfer_params=p_params if reuse else dict(p_params, **{contracts.HOLD: False}))
            new, d_params, d_first = stream_turn(d_url, d_body)
            rows.append(
                {
                    "conversation": c,
                    "turn": turn,
                    "prompt_tokens": len(prompts[c]),
                    "ttft_ms": round((p_s + d_first) * 1000, 2),
                    "p_ms": round(p_s * 1000, 2),
                    "pull_outcome": p_params.get(contracts.PULL_OUTCOME),
                }
            )
            offers[c] = d_params
            prompts[c] = prompts[c] + new + [(turn * 7 + c + i) % 1900 + 10 for i in range(args.new_tokens)]
    return rows


def p_metrics(url: str) -> dict[str, Any]:
    text = httpx.get(url + "/metrics", timeout=30).text
    decisions: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:bpdkv_pull_decisions_total{"):
            labels = dict(p.split("=", 1) for p in line.split("{", 1)[1].split("}", 1)[0].split(","))
            key = f"{labels['outcome'].strip(chr(34))}/{labels['reason'].strip(chr(34))}"
            decisions[key] = decisions.get(key, 0.0) + float(line.rpartition(" ")[2])
    rates = {
        line.split('link="', 1)[1].split('"', 1)[0]: float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("vllm:bpdkv_link_bytes_per_second{")
    }
    return {
        "decisions": decisions,
        "external_tokens": metric_value(text, "vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
        "nixl_bytes": metric_value(text, "vllm:nixl_bytes_transferred_sum"),
        "link_bytes_per_s": rates,
        "prefill_tokens_per_s": metric_value(text, "vllm:bpdkv_prefill_tokens_per_second"),
        "mispredicted": metric_value(text, "vllm:bpdkv_pull_mispredicted_total"),
    }


def start_pair(lab: TestHosts, logs: Path, label: str, extra: dict[str, Any]) -> tuple[VllmServer, VllmServer]:
    p_host, d_host = lab.hosts
    common = {"extra": extra, "threshold": 16, "ttl": 300, "model": WIDE_MODEL}
    p = VllmServer(f"{label}-prefill", logs, "kv_producer", netns=p_host.name, address=p_host.address, **common)  # type: ignore[arg-type]
    d = VllmServer(f"{label}-decode", logs, "kv_consumer", netns=d_host.name, address=d_host.address, **common)  # type: ignore[arg-type]
    try:
        p.wait()
        d.wait()
    except Exception:
        p.stop()
        d.stop()
        raise
    return p, d


def cpu_seconds(server: VllmServer) -> float:
    """CPU seconds (user + system) of a server's processes so far (its session: API server, engine core, workers)."""
    import subprocess

    ticks = 0
    for pid in subprocess.run(["pgrep", "-s", str(server.proc.pid)], capture_output=True, text=True).stdout.split():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def measured_workload(p: VllmServer, d: VllmServer, reuse: bool, args: argparse.Namespace) -> dict[str, Any]:
    cpu = (cpu_seconds(p), cpu_seconds(d))
    started = time.monotonic()
    rows = run_workload(p.url, d.url, reuse, args)
    wall = time.monotonic() - started
    used = {"p": cpu_seconds(p) - cpu[0], "d": cpu_seconds(d) - cpu[1]}
    return {
        "rows": rows,
        "p": p_metrics(p.url),
        "wall_s": round(wall, 2),
        "cpu_s": {k: round(v, 2) for k, v in used.items()},
        "cores": {k: round(v / wall, 3) for k, v in used.items()},
    }


def threads_cpu(server: VllmServer) -> dict[tuple[str, str, str], float]:
    """CPU seconds so far of each thread of a server's processes: (pid, tid, name) → seconds."""
    import subprocess

    out = {}
    for pid in subprocess.run(["pgrep", "-s", str(server.proc.pid)], capture_output=True, text=True).stdout.split():
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                name, _, rest = task.joinpath("stat").read_text().partition(" (")[2].rpartition(")")
            except OSError:
                continue
            fields = rest.split()
            out[(pid, task.name, name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def diagnose_hold(seconds: float = 4.0) -> int:
    """Per-thread CPU of P and D, idle and while D holds a finished turn's blocks; gdb's line for the busiest thread."""
    import subprocess

    logs = Path(tempfile.mkdtemp(prefix="bpdkv-hold-diag-"))
    p = VllmServer("diag-prefill", logs, "kv_producer", model=WIDE_MODEL)
    d = VllmServer("diag-decode", logs, "kv_consumer", model=WIDE_MODEL)
    try:
        p.wait()
        d.wait()

        def watch(label: str) -> list[tuple[VllmServer, tuple[str, str, str]]]:
            before = [threads_cpu(x) for x in (p, d)]
            time.sleep(seconds)
            busiest = []
            for server, old in zip((p, d), before, strict=True):
                used = {k: (v - old.get(k, 0.0)) / seconds for k, v in threads_cpu(server).items()}
                top = sorted(used.items(), key=lambda kv: -kv[1])[:4]
                print(label, server.name, f"{sum(used.values()):.3f} cores", [(k, round(v, 3)) for k, v in top], flush=True)
                busiest.append((server, top[0][0]))
            return busiest

        watch("no request yet:")
        prompt = conversation_start(0, 420)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        p_params = httpx.post(
            p.url + COMPLETIONS, json=dict(body, max_tokens=1, kv_transfer_params=contracts.prefill_template()), timeout=120
        ).json()[contracts.KV_TRANSFER_PARAMS]
        d_params = httpx.post(d.url + COMPLETIONS, json=dict(body, kv_transfer_params=p_params), timeout=120).json()
        print("D holds:", bool((d_params.get(contracts.KV_TRANSFER_PARAMS) or {}).get(contracts.REMOTE_BLOCK_IDS)), flush=True)
        time.sleep(1.0)
        for server, (pid, tid, _) in watch("D holding, P idle:"):
            out = subprocess.run(["gdb", "-p", pid, "-batch", "-ex", "info threads"], capture_output=True, text=True, timeout=120)
            print(server.name, "busiest thread", tid, [line for line in out.stdout.splitlines() if f"LWP {tid}" in line], flush=True)
            waits = [line for line in server.log.read_text(errors="replace").splitlines() if "only holds KV" in line]
            print(server.name, "idle wait engaged:", waits[:1] or "no", flush=True)
    finally:
        p.stop()
        d.stop()
    return 0


def summary_of(rows: list[dict[str, Any]]) -> dict[str, float]:
    later = [r["ttft_ms"] for r in rows if r["turn"] >= 2]
    return {
        "turns": len(later),
        "ttft_mean_ms": round(statistics.fmean(later), 2),
        "ttft_p50_ms": round(percentile(later, 0.5), 2),
        "ttft_p99_ms": round(percentile(later, 0.99), 2),
        "p_mean_ms": round(statistics.fmean(r["p_ms"] for r in rows if r["turn"] >= 2), 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="unthrottled,16mbit,2mbit", help="comma-separated tc rates; 'unthrottled' = no shaping")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--start-tokens", type=int, default=480)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--spin-rates", default="", help="rates at which also to run on_spin (upstream's idle loop on P and D)")
    ap.add_argument("--no-threshold", action="store_true", help="skip on_threshold (today's rule) at the unthrottled rate")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--diagnose-hold", action="store_true", help="per-thread CPU of P and D while D holds (no benchmark)")
    args = ap.parse_args(argv)
    if not VLLM_PYTHON.exists():
        print(f"vLLM-CPU venv missing at {VLLM_PYTHON}", file=sys.stderr)
        return 1
    import subprocess

    if args.diagnose_hold:
        return diagnose_hold()
    subprocess.run([str(VLLM_PYTHON), "-m", "bpdkv.lab.tiny_model", str(MODEL_DIR)], check=True, capture_output=True, timeout=600)
    # The tiny model's KV shape, 4x wider: P computes ~1,000 tokens/s here, so an unthrottled pull clearly pays.
    subprocess.run(
        [str(VLLM_PYTHON), "-m", "tests.e2e.wide_model", str(WIDE_MODEL)], check=True, capture_output=True, timeout=600, cwd=ROOT
    )
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    logs = Path(tempfile.mkdtemp(prefix="bpdkv-slow-link-"))
    lab = TestHosts(2)
    lab.start()
    raw: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.node()}: {os.cpu_count()} cores, shared with other helpers' work (2-core CI box)",
        "workload": vars(args) | {"out": str(args.out)},
        "runs": [],
    }
    summary: dict[str, Any] = {"rates": []}
    try:
        for rate in rates:
            for host in lab.hosts:
                lab.shape(host, None if rate == "unthrottled" else rate)
            results: dict[str, Any] = {}
            # reuse off, then calibrate on the same servers: the seed the fleet gets from `bpdkv calibrate`
            # (threshold rule on P: reuse off offers P nothing, and calibrate must really pull every size it measures)
            p, d = start_pair(lab, logs, f"{rate}-off", {contracts.EXTRA_PULL_DECISION: contracts.PULL_DECISION_THRESHOLD})
            try:
                results["off"] = measured_workload(p, d, False, args)
                cal = calibrate(p.url, d.url, "tiny", [64, 192, 384], repeat=2, block_size=32, current_threshold=16, gpu=False)
                seed = cal.cost_seed
                results["calibration"] = cal.to_json()
            finally:
                p.stop()
                d.stop()
            runs = [("on", {"bpdkv_cost_seed": seed} if seed else {})]
            if rate in args.spin_rates.split(","):
                runs.append(("on_spin", dict(runs[0][1], bpdkv_idle_wait=0)))
            if rate == "unthrottled" and not args.no_threshold:
                runs.append(("on_threshold", {contracts.EXTRA_PULL_DECISION: contracts.PULL_DECISION_THRESHOLD}))
            for name, extra in runs:
                p, d = start_pair(lab, logs, f"{rate}-{name}", extra)
                try:
                    results[name] = measured_workload(p, d, True, args) | {"extra": extra}
                finally:
                    p.stop()
                    d.stop()
            for name in ("off", "on", "on_spin", "on_threshold"):
                if name in results:
                    results[name]["summary"] = summary_of(results[name]["rows"])
            raw["runs"].append({"link": rate, **results})
            row = {
                "link": rate,
                "reuse_on_ttft_mean_ms": results["on"]["summary"]["ttft_mean_ms"],
                "reuse_off_ttft_mean_ms": results["off"]["summary"]["ttft_mean_ms"],
                "reuse_on_ttft_p99_ms": results["on"]["summary"]["ttft_p99_ms"],
                "reuse_off_ttft_p99_ms": results["off"]["summary"]["ttft_p99_ms"],
                "on_vs_off_mean": round(results["on"]["summary"]["ttft_mean_ms"] / results["off"]["summary"]["ttft_mean_ms"], 3),
                "on_vs_off_p99": round(results["on"]["summary"]["ttft_p99_ms"] / results["off"]["summary"]["ttft_p99_ms"], 3),
                "on_vs_off_p50": round(results["on"]["summary"]["ttft_p50_ms"] / results["off"]["summary"]["ttft_p50_ms"], 3),
                "p_ms_mean": {m: results[m]["summary"]["p_mean_ms"] for m in ("off", "on", "on_spin") if m in results},
                "cores_p_d": {m: results[m]["cores"] for m in ("off", "on", "on_spin") if m in results},
                "decisions_on": results["on"]["p"]["decisions"],
                "link_bytes_per_s_measured": results["on"]["p"]["link_bytes_per_s"],
                "seed": seed,
            }
            if "on_spin" in results:
                spin = results["on_spin"]["summary"]
                row |= {
                    "spin_ttft_mean_ms": spin["ttft_mean_ms"],
                    "spin_ttft_p99_ms": spin["ttft_p99_ms"],
                    "spin_vs_off_mean": round(spin["ttft_mean_ms"] / results["off"]["summary"]["ttft_mean_ms"], 3),
                    "decisions_spin": results["on_spin"]["p"]["decisions"],
                }
            if "on_threshold" in results:
                today = results["on_threshold"]["summary"]
                row |= {
                    "today_ttft_mean_ms": today["ttft_mean_ms"],
                    "today_ttft_p99_ms": today["ttft_p99_ms"],
                    "on_vs_today_mean": round(results["on"]["summary"]["ttft_mean_ms"] / today["ttft_mean_ms"], 3),
                }
            summary["rates"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        for host in lab.hosts:
            lab.shape(host, None)
        lab.stop()
    raw["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    summary["note"] = (
        "turns >= 2, client TTFT (P answer + D first streamed token); each mode on fresh servers, same run; "
        "reuse on seeded by bpdkv calibrate run on the reuse-off servers; on_spin: reuse on with upstream's idle loop "
        "(bpdkv_idle_wait 0); cores_p_d: CPU seconds of P's and D's processes / the workload's wall time; "
        "2-core machine shared with other work (see README.md)"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "raw.json").write_text(json.dumps(raw, indent=1) + "\n")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
