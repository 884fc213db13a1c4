"""`bpdkv bench` as a library call: where it sends its load and whose /metrics it reads (a URL as given, or a
topology's first router, https when the router serves TLS, and its prefill and decode servers), the workload its
options describe, and `bench compare`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bpdkv.bench import modes, report
from bpdkv.bench.runner import Servers
from bpdkv.bench.sustained import SustainedSpec, ToolLatency
from bpdkv.bench.workload import WorkloadSpec
from bpdkv.errors import UsageError


def is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def router_url(topology: Any, source: str) -> str:
    """The first router instance's URL as a client reaches it: its node's host, its port, https with router.tls."""
    routers = topology.instances("router")
    if not routers:
        raise UsageError(f"{source}: no router instance")
    node, inst = routers[0]
    scheme = "https" if topology.router.tls_cert else "http"
    return f"{scheme}://{node.host}:{inst.port}"


def topology_servers(topology: Any) -> Servers:
    """P's and D's own URLs (vLLM serves plain HTTP on the data-plane address; TLS is the router's alone)."""
    return Servers(
        *(tuple(f"http://{n.data_plane_address}:{i.port}" for n, i in topology.instances(role)) for role in ("prefill", "decode"))
    )


def bench_targets(target: str, topology: Any, servers: Servers) -> tuple[str, Servers]:
    """(router URL, servers): `topology` is the validated Topology of a file TARGET (None for a URL); servers given
    on the command line win over the topology's."""
    if topology is None:
        return target, servers
    return router_url(topology, target), servers if servers.all else topology_servers(topology)


def compare_files(files: tuple[Path, ...]) -> list[dict[str, Any]]:
    """`bpdkv bench compare A.json B.json`: each mode of A against the same mode of B (else the first runs)."""
    if len(files) != 2:
        raise UsageError("usage: bpdkv bench compare A.json B.json")
    a, b = (report.load(f) for f in files)
    pairs = [(x, y) for x in a["runs"] for y in b["runs"] if x["label"] == y["label"]] or [(a["runs"][0], b["runs"][0])]
    return [report.compare(x, y) for x, y in pairs]


def run_bench(target: str, topology: Any, opts: dict[str, Any], progress: Any) -> modes.BenchRun:
    """`bpdkv bench TARGET`: every mode the options ask for, each from a fresh start; `opts` are the command's options."""
    servers = Servers(tuple(opts["prefill_urls"]), tuple(opts["decode_urls"]), tuple(opts["metrics_urls"]))
    url, servers = bench_targets(target, topology, servers)
    spec = WorkloadSpec(
        opts["conversations"],
        opts["turns"],
        opts["system_tokens"],
        opts["start_history"],
        opts["new_tokens"],
        opts["output_tokens"],
        opts["think_time"],
        opts["concurrency"],
        opts["workload_mode"],
        opts["stream"],
        opts["seed"],
        model=opts["model"],
        mark_last_turn=opts["mark_last_turn"],
        shape=opts["shape"],
        scale=opts["scale"],
    )
    duration = opts["duration"]
    sustained = None if duration is None else SustainedSpec(duration * 60, ToolLatency(opts["think_median"], opts["think_sigma"]))
    chosen = modes.modes(opts["reuse_modes"], opts["p_cache_modes"], opts["paths_modes"])
    return modes.run_modes(url, spec, chosen, servers, sustained, progress(sustained is not None))
