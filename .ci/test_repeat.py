#!/usr/bin/env python3
"""The flake hunt (`make test-repeat N=3`): the slow layers N times in a row, each in a fresh pytest process from a
clean state, with CPU competitors taking cores the way a loaded machine would; every failure printed with its test name
and first line, and a JSON summary (runs, durations, counts, failures). Exit 1 if any run failed.

Run it before every submission: a test that passes only on an idle machine fails in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPETITOR_LIFETIME_S = 4 * 3600  # bounded: a competitor never outlives a forgotten run by more than this
BUSY = f"import time\nend = time.monotonic() + {COMPETITOR_LIFETIME_S}\nwhile time.monotonic() < end:\n    pass\n"


def leftovers() -> list[str]:
    """What a clean state must not have: lab test hosts (network namespaces host1..) and vLLM servers of a run."""
    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    found += [f"network namespace {line.split()[0]}" for line in netns if line.strip().startswith("host")]
    procs = subprocess.run(["pgrep", "-af", "vllm.entrypoints.openai.api_server"], capture_output=True, text=True).stdout
    found += [f"vLLM server: {line[:100]}" for line in procs.splitlines() if line.strip()]
    return found


def failures(junit: Path) -> tuple[dict[str, int], list[str]]:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    names: list[str] = []
    if not junit.exists():
        return counts, ["(no report: pytest did not finish)"]
    for suite in ET.parse(junit).getroot().iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            for bad in (*case.findall("failure"), *case.findall("error")):
                first = (bad.get("message") or "").strip().splitlines()[:1]
                names.append(f"{case.get('classname')}::{case.get('name')}: {bad.tag}: {first[0][:200] if first else ''}")
    return counts, names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--competitors", type=int, default=1, help="busy processes taking one core each during every run")
    ap.add_argument("--out", type=Path, default=ROOT / ".venv" / "test-repeat")
    ap.add_argument("tests", nargs="*", default=["tests/e2e", "tests/hosts"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, BPDKV_E2E="1", BPDKV_E2E_REQUIRED="1")
    plugins = ["-p", "borrow_guard_plugin"] if env.get("BPDKV_BORROW_LOG") else []
    summary = []
    for run in range(1, args.runs + 1):
        dirty = leftovers()
        if dirty:
            print(f"run {run}: not a clean state (a run before this one left them):", *dirty, sep="\n  ", flush=True)
        junit = args.out / f"run-{run}.xml"
        junit.unlink(missing_ok=True)
        competitors = [subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True) for _ in range(args.competitors)]
        started = time.monotonic()
        cmd = [sys.executable, "-m", "pytest", *plugins, "-q", "-p", "no:cacheprovider", "--timeout=1800"]
        cmd += ["--junitxml", str(junit), *args.tests]
        print(f"== run {run}/{args.runs}, {args.competitors} core(s) taken by a competitor: {' '.join(cmd[2:])}", flush=True)
        try:
            code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        finally:
            for proc in competitors:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        seconds = round(time.monotonic() - started, 1)
        counts, failed = failures(junit)
        summary.append({"run": run, "exit": code, "seconds": seconds, **counts, "failed": failed, "left_dirty": leftovers()})
        print(f"== run {run}: exit {code} in {seconds} s: {counts}", *failed, sep="\n  ", flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    bad = [s for s in summary if s["exit"] != 0 or s["failed"] or s["left_dirty"]]
    print(json.dumps({"runs": len(summary), "failed_runs": len(bad), "seconds": [s["seconds"] for s in summary]}))
    for s in bad:
        print(f"run {s['run']}: exit {s['exit']}", *s["failed"], *(f"left: {x}" for x in s["left_dirty"]), sep="\n  ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
