"""Operator-side monitoring files for a topology: a Prometheus scrape configuration and a Grafana dashboard.

Pure: topology in, file contents out. They go to the operator's own disk (`bpdkv render` writes them under
`<out>/_observability/`; node names cannot start with "_"), never to a node. Prometheus reads per-role target files
(file-based service discovery), so a changed fleet only rewrites the JSON target files. Every metric a panel queries
is one the router (bpdkv_router_*), vLLM (vllm:*) or bpdkv's node plugin (vllm:bpdkv_*) exposes; the end-to-end fleet
test checks them against the real servers' /metrics.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import yaml

from bpdkv import __version__
from bpdkv.topology.model import Topology

OUT_DIR = "_observability"
ROLES = ("router", "prefill", "decode")
# Target labels: prefixed, because the router's own metrics already carry a `role` label (the upstream's role).
ROLE_LABEL = "bpdkv_role"
INSTANCE_LABEL = "bpdkv_instance"
RATE = "[$__rate_interval]"
SEL = 'topology="$topology"'


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # Grafana unit id
    queries: tuple[Query, ...]
    description: str = ""


def _quantiles(metric: str, selector: str, by: str, legend: str) -> tuple[Query, ...]:
    group = f"le, {by}" if by else "le"
    return tuple(
        Query(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}{RATE})))", f"p{int(q * 100)} {legend}")
        for q in (0.5, 0.95)
    )


def _role(role: str) -> str:
    return f'{SEL}, {ROLE_LABEL}="{role}"'


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Router",
        (
            Panel("Router time to first byte", "s", _quantiles("bpdkv_router_ttft_seconds", SEL, "", ""), "What clients wait for."),
            Panel(
                "Reuse outcome per request",
                "reqps",
                (Query(f"sum by (outcome) (rate(bpdkv_router_reuse_total{{{SEL}}}{RATE}))", "{{outcome}}"),),
                "hit: P was handed D's blocks; miss/expired/refused/...: why not.",
            ),
            Panel(
                "Time between a conversation's turns",
                "s",
                (
                    *_quantiles("bpdkv_router_turn_gap_seconds", SEL, "", ""),
                    Query(f"histogram_quantile(0.9, sum by (le) (rate(bpdkv_router_turn_gap_seconds_bucket{{{SEL}}}{RATE})))", "p90"),
                ),
                "Users' think time, end of a turn's answer to the next turn. A TTL below its p90 loses reuse silently: "
                "`bpdkv tune` recommends decoder_kv_blocks_ttl from it.",
            ),
            Panel(
                "Reuse misses by cause",
                "reqps",
                (Query(f"sum by (cause) (rate(bpdkv_router_reuse_misses_total{{{SEL}}}{RATE}))", "{{cause}}"),),
                "expired: the turn came after the TTL; released: D let the hold go early (hold budget); computed: P "
                "decided to compute; restarted, nothing_stored, refused_pin, mismatch, ...: see docs/operations.md (Tuning).",
            ),
            Panel(
                "Paths per turn",
                "reqps",
                (Query(f"sum by (path) (rate(bpdkv_router_paths_total{{{SEL}}}{RATE}))", "{{path}}"),),
                "decode_local: continued on the D that holds it (no P); prefill_pull: P pulled the history from D; prefill_full: computed.",
            ),
            Panel(
                "Engine load the router sees",
                "short",
                (
                    Query(f"max by (upstream) (bpdkv_router_engine_running{{{SEL}}})", "running {{upstream}}"),
                    Query(f"max by (upstream) (bpdkv_router_engine_waiting{{{SEL}}})", "waiting {{upstream}}"),
                ),
                "Each engine's own /metrics, read about once a second: placement and the decode_local decision use it.",
            ),
            Panel(
                "Upstream latency (P: whole request, D: to first byte)",
                "s",
                _quantiles("bpdkv_router_upstream_seconds", SEL, "role", "{{role}}"),
            ),
            Panel(
                "Requests by status",
                "reqps",
                (Query(f"sum by (route, status) (rate(bpdkv_router_requests_total{{{SEL}}}{RATE}))", "{{route}} {{status}}"),),
            ),
        ),
    ),
    (
        "vLLM",
        (
            Panel(
                "vLLM time to first token", "s", _quantiles("vllm:time_to_first_token_seconds", SEL, ROLE_LABEL, f"{{{{{ROLE_LABEL}}}}}")
            ),
            Panel("Inter-token latency (decode)", "s", _quantiles("vllm:inter_token_latency_seconds", _role("decode"), "", "")),
            Panel(
                "KV cache usage",
                "percentunit",
                (Query(f"max by ({INSTANCE_LABEL}) (vllm:kv_cache_usage_perc{{{SEL}}})", f"{{{{{INSTANCE_LABEL}}}}}"),),
                "D holds finished requests' blocks for the TTL: a D near 100 % makes new requests wait.",
            ),
            Panel(
                "Prefill prompt tokens by source",
                "short",
                (Query(f"sum by (source) (rate(vllm:prompt_tokens_by_source_total{{{_role('prefill')}}}{RATE}))", "{{source}}"),),
                "external_kv_transfer: tokens pulled from D instead of computed.",
            ),
        ),
    ),
    (
        "bpdkv reuse guard",
        (
            Panel(
                "Pulls verified, cut, refused",
                "short",
                (
                    Query(f"sum(rate(vllm:bpdkv_verified_tokens_total{{{SEL}}}{RATE}))", "verified tokens"),
                    Query(f"sum(rate(vllm:bpdkv_mismatch_cuts_total{{{SEL}}}{RATE}))", "cut (prompt diverged)"),
                    Query(f"sum(rate(vllm:bpdkv_unverified_refused_total{{{SEL}}}{RATE}))", "refused (no digests)"),
                    Query(f"sum(rate(vllm:bpdkv_expiring_refused_total{{{SEL}}}{RATE}))", "refused (expiring)"),
                ),
            ),
            Panel(
                "Offers of D's KV: pulled or recomputed (P's cost model)",
                "reqps",
                (
                    Query(f"sum by (outcome, reason) (rate(vllm:bpdkv_pull_decisions_total{{{SEL}}}{RATE}))", "{{outcome}} ({{reason}})"),
                    Query(
                        f'sum(rate(vllm:bpdkv_pull_decisions_total{{{SEL}, outcome="recomputed"}}{RATE})) / '
                        f"sum(rate(vllm:bpdkv_pull_decisions_total{{{SEL}}}{RATE}))",
                        "share recomputed",
                    ),
                ),
                "recomputed/link_slower: pulling from that D was predicted slower than P computing the tokens.",
            ),
            Panel(
                "P→D link rate (measured) vs break-even",
                "Bps",
                (
                    Query(f"max by (link) (vllm:bpdkv_link_bytes_per_second{{{SEL}}})", "{{link}}"),
                    Query(f"max by (link) (vllm:bpdkv_link_break_even_bytes_per_second{{{SEL}}})", "break-even {{link}}"),
                ),
                "Below break-even no pull pays: P computes instead (UCX on EFA, P and D on one GPU, no GPUDirect?).",
            ),
            Panel(
                "Blocks D holds for a next turn",
                "percentunit",
                (
                    Query(
                        f"sum by ({INSTANCE_LABEL}) (vllm:bpdkv_held_blocks{{{SEL}}}) / "
                        f"sum by ({INSTANCE_LABEL}) (vllm:bpdkv_kv_blocks_total{{{SEL}}})",
                        f"{{{{{INSTANCE_LABEL}}}}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "NIXL",
        (
            Panel("NIXL transfer time", "s", _quantiles("vllm:nixl_xfer_time_seconds", SEL, "", "")),
            Panel(
                "NIXL bytes transferred",
                "Bps",
                (Query(f"sum by ({INSTANCE_LABEL}) (rate(vllm:nixl_bytes_transferred_sum{{{SEL}}}{RATE}))", f"{{{{{INSTANCE_LABEL}}}}}"),),
            ),
        ),
    ),
)

_METRIC_IN_QUERY = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\{")


def queried_metrics(dashboard: dict[str, object]) -> set[str]:
    """Every series name the dashboard's queries read (each query names its series with a `{...}` selector)."""
    names: set[str] = set()
    for panel in dashboard.get("panels", []):  # type: ignore[attr-defined]
        for target in panel.get("targets", []):
            names.update(_METRIC_IN_QUERY.findall(target["expr"]))
    return names


def scrape_targets(topology: Topology) -> dict[str, list[dict[str, object]]]:
    """file_sd target groups per role: one group per instance, so each series carries its instance name."""
    groups: dict[str, list[dict[str, object]]] = {role: [] for role in ROLES}
    for node, inst in ((n, i) for n in topology.nodes for i in n.instances):
        groups[inst.role].append(
            {
                "targets": [f"{node.host}:{inst.port}"],
                "labels": {"topology": topology.name, ROLE_LABEL: inst.role, INSTANCE_LABEL: inst.name, "bpdkv_node": node.name},
            }
        )
    return groups


def prometheus_config(topology: Topology) -> str:
    jobs = [
        {
            "job_name": f"bpdkv-{topology.name}-{role}",
            "metrics_path": "/metrics",
            "file_sd_configs": [{"files": [f"targets/{role}.json"], "refresh_interval": "1m"}],
        }
        for role in ROLES
    ]
    header = (
        f"# Managed by bpdkv {__version__} (topology {topology.name}): scrape jobs per role; targets in targets/*.json\n"
        "# (file-based service discovery, paths relative to this file). Merge scrape_configs into your prometheus.yml.\n"
    )
    return header + yaml.safe_dump({"global": {"scrape_interval": "15s"}, "scrape_configs": jobs}, sort_keys=False)


def grafana_dashboard(topology: Topology) -> dict[str, object]:
    panels: list[dict[str, object]] = []
    y = 0
    next_id = 1
    for row_title, row_panels in ROWS:
        panels.append({"type": "row", "title": row_title, "id": next_id, "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        next_id, y = next_id + 1, y + 1
        for i, panel in enumerate(row_panels):
            panels.append(
                {
                    "type": "timeseries",
                    "id": next_id,
                    "title": panel.title,
                    "description": panel.description,
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                    "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)},
                    "targets": [
                        {
                            "refId": chr(ord("A") + k),
                            "expr": q.expr,
                            "legendFormat": q.legend,
                            "datasource": {"type": "prometheus", "uid": "${datasource}"},
                        }
                        for k, q in enumerate(panel.queries)
                    ],
                }
            )
            next_id += 1
        y += 8 * ((len(row_panels) + 1) // 2)
    return {
        "title": f"bpdkv {topology.name}",
        "uid": f"bpdkv-{topology.name}"[:40],
        "tags": ["bpdkv", "vllm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
                {"name": "topology", "type": "constant", "query": topology.name, "hide": 2},
            ]
        },
        "panels": panels,
    }


def observability_files(topology: Topology) -> dict[str, str]:
    """Relative path (under the operator's output folder) -> content."""
    files = {"prometheus.yml": prometheus_config(topology)}
    for role, groups in scrape_targets(topology).items():
        files[f"targets/{role}.json"] = json.dumps(groups, indent=2) + "\n"
    files["grafana-dashboard.json"] = json.dumps(grafana_dashboard(topology), indent=2) + "\n"
    return files
