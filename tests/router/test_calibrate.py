"""`bpdkv calibrate` against the emulator (a test double with set compute and pull costs): the break-even it finds
must be the one those costs imply; the real-fleet run is in tests/hosts/test_fleet_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from click.testing import CliRunner

from bpdkv.bench.calibrate import SizeResult, calibrate, cost_seed, override_yaml
from bpdkv.cli import main
from bpdkv.topology.validate import load_topology

COMPUTE = 0.002  # s per prompt token P computes
PULL = 0.0002  # s per token pulled
FIXED = 0.1  # s per pull, whatever its size
# Break-even N* = FIXED / (COMPUTE - PULL) ≈ 55.6 tokens → 64 in whole 16-token blocks.


def emulated(fleet_factory: Any, fixed: float = FIXED) -> Any:
    return fleet_factory(
        p_settings={
            "prefill_seconds_per_token": COMPUTE,
            "pull_seconds_per_token": PULL,
            "pull_fixed_seconds": fixed,
            "kv_recompute_threshold": 0,
        },
        d_settings={"block_size": 16},
    )


def test_break_even_matches_the_costs(fleet_factory: Any, tmp_path: Path) -> None:
    fleet = emulated(fleet_factory)
    p, d = fleet.prefill[0], fleet.decode[0]
    urls = fleet.emulator_urls
    cal = calibrate(urls[0], urls[1], "emulated", [16, 32, 64, 128, 256], repeat=1, block_size=16, current_threshold=0, gpu=True)
    rows = {r.tokens: r for r in cal.sizes}
    assert all(r.pull_s is not None and r.pulled_tokens == r.tokens for r in cal.sizes)  # every size really pulled N
    assert rows[32].pull_s > rows[32].compute_s and rows[64].pull_s < rows[64].compute_s  # type: ignore[operator]
    assert cal.recommended_threshold == 64
    assert cal.descriptor_bound and "block_size 16" in cal.descriptor_bound  # GPU fleet with 16-token blocks
    assert p.counters["nixl_xfer_count"] >= 5 and d is not None
    fragment = yaml.safe_load(override_yaml(cal, "test"))
    assert fragment["kv_transfer"]["kv_recompute_threshold"] == 64 and fragment["model"]["block_size"] == 128
    # The seed of P's cost model: P's rate (1 / COMPUTE), the link's overhead (FIXED) and rate (emulated bytes / PULL).
    seed = fragment["kv_transfer"]["pull_cost_seed"]
    assert abs(seed["prefill_tokens_per_s"] - 1 / COMPUTE) < 0.2 / COMPUTE
    link = seed["links"]["*"]
    assert abs(link["overhead_s"] - FIXED) < 0.05 and abs(link["bytes_per_s"] - 1024 / PULL) < 0.3 * 1024 / PULL
    # The fragment merges into a real topology and validates.
    doc = yaml.safe_load((Path(__file__).parents[2] / "examples" / "local-cpu.yaml").read_text())
    doc["kv_transfer"].update(fragment["kv_transfer"])
    merged = tmp_path / "merged.yaml"
    merged.write_text(yaml.safe_dump(doc))
    merged_kv = load_topology(merged).topology.kv_transfer
    assert merged_kv.kv_recompute_threshold == 64 and merged_kv.pull_cost_seed == seed


def test_pulls_that_never_pay_get_no_threshold(fleet_factory: Any, tmp_path: Path) -> None:
    fleet = emulated(fleet_factory, fixed=2.0)  # a pull costs more than computing 256 tokens
    urls = fleet.emulator_urls
    out, override = tmp_path / "cal.json", tmp_path / "override.yaml"
    result = CliRunner().invoke(
        main,
        [
            "calibrate",
            "--prefill",
            urls[0],
            "--decode",
            urls[1],
            "--model",
            "emulated",
            "--sizes",
            "32,128",
            "--repeat",
            "1",
            "--out",
            str(out),
            "--write-override",
            str(override),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["recommended_threshold"] is None and any("never beat" in n for n in data["notes"])
    text = override.read_text()
    assert "kv_recompute_threshold" not in yaml.safe_load(text)["kv_transfer"] and "no kv_recompute_threshold" in text
    # The cost model's seed still goes next to it: P then computes from its first offer instead of learning by a pull.
    seed = yaml.safe_load(text)["kv_transfer"]["pull_cost_seed"]
    assert seed["links"]["127.0.0.1"]["overhead_s"] > 1.5 and seed == data["cost_seed"]


def test_bad_sizes_are_one_line(fleet_factory: Any) -> None:
    result = CliRunner().invoke(
        main, ["calibrate", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", "--model", "m", "--sizes", "a,b"]
    )
    assert result.exit_code != 0 and "--sizes 'a,b'" in result.output and "Traceback" not in result.output


def test_a_link_faster_than_the_measurement_can_tell_is_seeded_at_the_rate_nixl_measured() -> None:
    """Pulls that cost what computing their tail costs (a fast link): the fitted slope is ~0 and its inverse would be an
    absurd rate; the seed says the rate NIXL itself measured instead (its transfer times against the bytes: 1 ms more per
    128 KiB, past 1 ms per transfer)."""
    per_token = 0.001
    sizes = [
        # P computes the 512 - n tokens of the tail; the pull itself costs next to nothing (timing noise).
        SizeResult(n, 512, 512 * per_token, (512 - n) * per_token + noise, n, xfer, n * 1024.0)
        for n, xfer, noise in ((128, 0.002, 0.0004), (256, 0.003, 0.0), (384, 0.004, 0.0001))
    ]
    seed = cost_seed(sizes, "http://10.0.0.2:8200")
    assert seed is not None and set(seed["links"]) == {"10.0.0.2", "*"}
    assert seed["links"]["*"]["bytes_per_s"] == round(128 * 1024 / 0.001), seed
