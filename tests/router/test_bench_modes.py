"""`bpdkv bench` modes start from the same state (checked on P), and the sustained mode, against the emulated fleet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from bpdkv.bench.modes import Mode, modes
from bpdkv.cli import main

SMALL = [
    "--conversations",
    "3",
    "--turns",
    "3",
    "--system-tokens",
    "64",
    "--new-tokens",
    "40",
    "--output-tokens",
    "8",
    "--concurrency",
    "3",
]


def test_every_mode_draws_its_own_prompts() -> None:
    seeds = {m.label: m.seed(5) for m in modes("both", "both")}
    assert len(set(seeds.values())) == 4
    assert Mode("on", "on").seed(5) != Mode("on", "on").seed(6)  # and another --seed gives other prompts again


def test_a_mode_that_finds_its_prompts_on_p_is_refused(fleet_factory: Any, tmp_path: Path) -> None:
    fleet = fleet_factory()
    p_url = fleet.emulator_urls[0]
    args = ["bench", fleet.url, *SMALL, "--reuse", "on", "--prefill-cache", "on", "--prefill-metrics", p_url]
    first = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "a.json")])
    assert first.exit_code == 0, first.output
    fresh = json.loads((tmp_path / "a.json").read_text())["runs"][0]["fresh_start"]
    assert fresh["fresh"] and fresh["hit_tokens"] <= fresh["allowed_tokens"]
    # The same mode and seed again on the same P: its prompts are cached, the comparison would be biased.
    again = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "b.json")])
    assert again.exit_code == 1
    assert "not a fresh start" in again.output and "reuse-on/prefill-cache-on" in again.output
    warm = json.loads((tmp_path / "b.json").read_text())["runs"][0]["fresh_start"]
    assert not warm["fresh"] and warm["hit_tokens"] > warm["allowed_tokens"]
    # Reported, not failed, when asked; another seed is fresh again.
    assert CliRunner().invoke(main, [*args, "--allow-warm"]).exit_code == 0
    assert CliRunner().invoke(main, [*args, "--seed", "9"]).exit_code == 0


def test_sustained_mode_reports_over_time(fleet_factory: Any, tmp_path: Path) -> None:
    fleet = fleet_factory(d_settings={"first_token_delay": 0.01})
    p_url, d_url = fleet.emulator_urls[:2]
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    args = [*SMALL, "--reuse", "both", "--prefill-cache", "off", "--duration", "0.05", "--think-median", "0.05", "--think-sigma", "0.5"]
    result = CliRunner().invoke(
        main, ["bench", fleet.url, *args, "--prefill-metrics", p_url, "--decode-metrics", d_url, "--out", str(out), "--plot", str(png)]
    )
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [r["label"] for r in runs] == ["reuse-on/prefill-cache-off", "reuse-off/prefill-cache-off"]
    for run in runs:
        # 3 s of load with ~50 ms think times: conversations end after 3 turns and new ones replace them
        assert run["errors"] == 0 and run["requests"] > 9
        assert max(s["conversation"] for s in run["samples"]) >= 3
        assert run["ttft_over_time"] and all(w["p99"] is not None for w in run["ttft_over_time"])
        assert run["d_timeline"] and {"kv_usage", "held_share", "live_share", "waiting"} <= set(run["d_timeline"][0])
        assert run["fresh_start"]["fresh"]
        assert run["sustained"]["duration_s"] == 3.0
    assert runs[0]["servers"][p_url]["external_tokens"] > 0 and runs[1]["servers"][p_url]["external_tokens"] == 0
    assert "TTFT p99 ms" in result.output and "waiting max" in result.output
    assert png.stat().st_size > 1000
