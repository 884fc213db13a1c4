"""The operator's monitoring files: Prometheus scrape config (file_sd per role) and the Grafana dashboard."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from click.testing import CliRunner
from prometheus_client import generate_latest

from bpdkv.cli import main
from bpdkv.observability import INSTANCE_LABEL, ROLE_LABEL, grafana_dashboard, observability_files, queried_metrics
from bpdkv.router.metrics import RouterMetrics
from bpdkv.topology.validate import load_topology
from tests.conftest import ROOT

EXAMPLE = ROOT / "examples" / "local-cpu.yaml"


def _topology():  # type: ignore[no-untyped-def]
    return load_topology(EXAMPLE, str(EXAMPLE)).topology


def test_scrape_config_points_at_per_role_target_files_naming_every_instance() -> None:
    topology = _topology()
    files = observability_files(topology)
    config = yaml.safe_load(files["prometheus.yml"])
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {f"bpdkv-{topology.name}-{role}" for role in ("router", "prefill", "decode")}
    seen = {}
    for job in jobs.values():
        (sd,) = job["file_sd_configs"]
        for rel in sd["files"]:
            for group in json.loads(files[rel]):
                (target,) = group["targets"]
                seen[group["labels"][INSTANCE_LABEL]] = (target, group["labels"][ROLE_LABEL])
    expected = {i.name: (f"{n.host}:{i.port}", i.role) for n in topology.nodes for i in n.instances}
    assert seen == expected


def test_dashboard_covers_router_vllm_guard_and_nixl() -> None:
    dashboard = grafana_dashboard(_topology())
    metrics = queried_metrics(dashboard)
    for needed in (
        "bpdkv_router_ttft_seconds_bucket",
        "bpdkv_router_reuse_total",
        "bpdkv_router_upstream_seconds_bucket",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "vllm:bpdkv_verified_tokens_total",
        "vllm:bpdkv_mismatch_cuts_total",
        "vllm:bpdkv_unverified_refused_total",
        "vllm:nixl_xfer_time_seconds_bucket",
        "vllm:nixl_bytes_transferred_sum",
    ):
        assert needed in metrics
    ids = [p["id"] for p in dashboard["panels"]]  # type: ignore[index]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:  # type: ignore[attr-defined]
        for target in panel.get("targets", []):
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert 'topology="$topology"' in target["expr"]


def test_every_router_metric_the_dashboard_reads_is_defined_by_the_router() -> None:
    metrics = RouterMetrics()
    metrics.reuse.labels("hit").inc()
    metrics.upstream.labels("prefill").observe(0.1)
    metrics.requests.labels("/v1/chat/completions", "200").inc()
    metrics.paths.labels("decode_local", "few_new_tokens").inc()
    metrics.engine_running.labels("decode", "decode-0").set(1)
    metrics.engine_waiting.labels("decode", "decode-0").set(0)
    exposed = {line.split("{")[0].split(" ")[0] for line in generate_latest(metrics.registry).decode().splitlines() if line[:1] != "#"}
    wanted = {m for m in queried_metrics(grafana_dashboard(_topology())) if m.startswith("bpdkv_router_")}
    assert wanted and wanted <= exposed, wanted - exposed


def test_render_writes_monitoring_files_beside_the_hosts(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["render", str(EXAMPLE), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    monitoring = tmp_path / "_observability"
    assert yaml.safe_load((monitoring / "prometheus.yml").read_text())["scrape_configs"]
    assert json.loads((monitoring / "grafana-dashboard.json").read_text())["panels"]
    assert {p.name for p in (monitoring / "targets").iterdir()} == {"router.json", "prefill.json", "decode.json"}
