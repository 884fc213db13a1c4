"""Plan and apply wall time for 1, 3 and 8 real SSH test hosts, serial vs parallel. Root only. Prints JSON.

    python benchmarks/plan_apply.py [--hosts 1 3 8]

Hosts are network namespaces with real sshd and docker-systemctl-replacement (bpdkv.lab.hosts); the
instances run tests/hosts/fake_vllm.py (a real HTTP server with /health and /v1/models) in place of vLLM.

Every apply also says where its time went: `apply_cli_cpu_s` (the bpdkv process's own CPU), `apply_machine_cpu_s`
(every core of this machine during the apply: the CLI plus every host's sshd, shells, service manager and fake
servers, which share this machine's cores), and `apply_cpu_busy` (machine CPU / (wall × cores): near 1.0 means
the hosts queue for CPU, well below means the apply waits on the hosts' own timers).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bpdkv.lab.hosts import TestHosts  # noqa: E402
from tests.hosts.conftest import topology_doc, wipe, write_topology  # noqa: E402


def doc_for(lab: TestHosts, n: int) -> dict[str, Any]:
    doc = topology_doc(lab)
    nodes = []
    for i in range(n):
        role = "prefill" if i % 2 == 0 else "decode"
        if n == 1:
            instances = [{"role": "prefill", "port": 8100}, {"role": "decode", "port": 8200}, {"role": "router", "port": 8000}]
        else:
            instances = [{"role": role, "port": 8100 if role == "prefill" else 8200}]
            if i == n - 1:
                instances.append({"role": "router", "port": 8000})
        nodes.append({"name": f"host{i + 1}", "host": f"10.213.0.{11 + i}", "hardware": "cpu", "instances": instances})
    if n == 1:
        nodes[0]["data_plane_address"] = "10.213.0.11"
    doc["nodes"] = nodes
    return doc


def machine_cpu_s() -> float:
    """CPU seconds spent by every process on this machine so far (user + nice + system + irq + softirq)."""
    with open("/proc/stat") as fh:
        ticks = [int(x) for x in fh.readline().split()[1:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(argv: list[str]) -> tuple[float, int, float, float]:
    """Wall seconds, exit code, the command's own CPU seconds, and the whole machine's CPU seconds meanwhile."""
    cli0, machine0 = children_cpu_s(), machine_cpu_s()
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    wall = time.perf_counter() - start
    return wall, proc.returncode, children_cpu_s() - cli0, machine_cpu_s() - machine0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[1, 3, 8])
    args = ap.parse_args()
    lab = TestHosts(max(args.hosts))
    results = []
    with lab, tempfile.TemporaryDirectory() as tmp:
        for n in args.hosts:
            topo = write_topology(Path(tmp) / f"t{n}.yaml", doc_for(lab, n))
            for mode, flags in (
                ("serial", ["--parallel", "1", "--max-unavailable", "1"]),
                ("parallel", ["--parallel", "16", "--max-unavailable", "16"]),
            ):
                wipe(lab)
                plan_s, plan_rc, _, _ = timed(["bpdkv", "plan", str(topo), "--no-diff", *flags[:2]])
                apply_s, apply_rc, cli_cpu, machine_cpu = timed(["bpdkv", "apply", str(topo), "-y", *flags])
                noop_s, noop_rc, _, _ = timed(["bpdkv", "plan", str(topo), "--no-diff", *flags[:2]])
                row = {
                    "hosts": n,
                    "mode": mode,
                    "plan_s": round(plan_s, 3),
                    "apply_s": round(apply_s, 3),
                    "apply_cli_cpu_s": round(cli_cpu, 2),
                    "apply_machine_cpu_s": round(machine_cpu, 2),
                    "apply_cpu_busy": round(machine_cpu / (apply_s * (os.cpu_count() or 1)), 2),
                    "converged_plan_s": round(noop_s, 3),
                    "rc": [plan_rc, apply_rc, noop_rc],
                }
                results.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        wipe(lab)
    one = {r["mode"]: r["apply_s"] for r in results if r["hosts"] == min(args.hosts)}
    out: dict[str, Any] = {
        "benchmark": "plan_apply",
        "command": "python benchmarks/plan_apply.py --hosts " + " ".join(map(str, args.hosts)),
        "cores": os.cpu_count(),
        "runs": results,
    }
    big = [r for r in results if r["hosts"] == max(args.hosts) and r["mode"] == "parallel"]
    if big and "parallel" in one:
        out["apply_largest_vs_one_host_parallel"] = round(big[0]["apply_s"] / one["parallel"], 2)
    three = [r for r in results if r["hosts"] == 3]
    if three:
        out["plan_3_hosts_s"] = min(r["plan_s"] for r in three)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
