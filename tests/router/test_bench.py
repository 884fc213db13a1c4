"""`bpdkv bench` against the emulated fleet (test double): deterministic workload, report, compare, plot."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from bpdkv.bench.workload import Conversation, WorkloadSpec
from bpdkv.cli import main


def test_workload_is_deterministic_for_a_seed() -> None:
    spec = WorkloadSpec(conversations=2, turns=3, system_tokens=50, new_tokens=20, seed=7)
    a = [Conversation(spec, 1).next_request(0)["prompt"] for _ in range(2)]
    assert a[0] == a[1]
    other = Conversation(WorkloadSpec(conversations=2, turns=3, system_tokens=50, new_tokens=20, seed=8), 1).next_request(0)["prompt"]
    assert other != a[0]
    c0, c1 = Conversation(spec, 0).next_request(0)["prompt"], Conversation(spec, 1).next_request(0)["prompt"]
    assert c0[:50] == c1[:50] and c0[50:] != c1[50:]  # shared system prompt, own user turns


def test_bench_runs_modes_and_reports(fleet_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(
        p_settings={"prefill_seconds_per_token": 0.0002, "pull_seconds_per_token": 0.00001}, d_settings={"first_token_delay": 0.01}
    )
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = [
        "bench",
        fleet.url,
        "--conversations",
        "3",
        "--turns",
        "4",
        "--system-tokens",
        "100",
        "--new-tokens",
        "40",
        "--output-tokens",
        "8",
        "--concurrency",
        "3",
        "--reuse",
        "both",
        "--prefill-cache",
        "off",
        "--metrics",
        fleet.emulator_urls[0],
        "--out",
        str(out),
        "--plot",
        str(png),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    labels = [r["label"] for r in report["runs"]]
    assert labels == ["reuse-on/prefill-cache-off", "reuse-off/prefill-cache-off"]
    on, off = report["runs"]
    assert on["requests"] == off["requests"] == 12 and on["errors"] == 0
    assert on["servers"][fleet.emulator_urls[0]]["external_tokens"] > 0
    assert off["servers"][fleet.emulator_urls[0]]["external_tokens"] == 0
    assert set(on["ttft_by_turn"]) == {"0", "1", "2", "3"}
    # P emulates 0.2 ms per computed token: pulling history instead of computing it must show in TTFT
    assert on["ttft_turns_ge_2"]["median"] < off["ttft_turns_ge_2"]["median"]
    assert png.stat().st_size > 1000
    assert "reuse off/on (same run)" in result.output
    cmp = CliRunner().invoke(main, ["bench", "compare", str(out), str(out)])
    assert cmp.exit_code == 0 and json.loads(cmp.output)[0]["ttft_median_ratio"] == 1.0
