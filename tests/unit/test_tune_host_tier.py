"""bpdkv tune recommends D's host-memory tier (kv_host_memory_gib) from the same signals as the TTL: the holds the
turn gaps ask for beyond D's hold budget, in GiB of D's KV cache, with the hit rate predicted with the tier against
HBM only; nothing to add when HBM holds it all; capped by the node's RAM; in the override as a comment."""

from __future__ import annotations

import dataclasses

import pytest

from bpdkv import tune
from bpdkv.topology.validate import load_topology
from tests.conftest import ROOT
from tests.unit.test_tune_hold_budget import GAPS, NOW, signals

D_KV = 60.0  # GiB of D's HBM KV cache
WITH_SIZES = dataclasses.replace(NOW, d_kv_gib=D_KV)


def test_past_the_budget_the_tier_holds_the_excess() -> None:
    s = signals(GAPS, held_share=0.25, budget_share=0.3)
    rec = tune.recommend_host_tier(s, WITH_SIZES)
    want = tune.predict_ttl(s, NOW, 280)  # p90 270 s + 10 s margin
    excess = want.held_share - 0.3  # type: ignore[operator]
    assert rec.predicted["excess_share_of_d_kv"] == pytest.approx(excess, abs=1e-3)
    assert rec.recommended == 8 * -(-excess * D_KV * tune.HOST_TIER_HEADROOM // 8) and rec.recommended > 0
    # with the tier every hold is kept: the hit rate of the TTL the gaps ask for; HBM only: the capped TTL's
    capped = tune.ttl_within_budget(s, NOW, 280, 0.3)
    assert capped is not None
    assert rec.predicted["hit_rate_with_tier"] == pytest.approx(want.hit_rate, abs=1e-3)
    assert rec.predicted["hit_rate_hbm_only"] == pytest.approx(capped.hit_rate, abs=1e-3)
    assert rec.predicted["hit_rate_with_tier"] > rec.predicted["hit_rate_hbm_only"]
    assert rec.changes and "(HBM only)" in rec.effect


def test_within_the_budget_nothing_is_added() -> None:
    rec = tune.recommend_host_tier(signals(GAPS, held_share=0.1, budget_share=0.5), WITH_SIZES)
    assert rec.recommended == 0.0 and not rec.changes and "HBM holds it all" in rec.evidence


def test_too_little_data_and_unknown_sizes_are_said() -> None:
    assert tune.recommend_host_tier(signals(GAPS[:10], held_share=0.25), WITH_SIZES).recommended is None
    rec = tune.recommend_host_tier(signals(GAPS, held_share=0.25, budget_share=0.3), NOW)  # no d_kv_gib
    assert rec.recommended is None and "KV cache size is unknown" in rec.evidence and rec.predicted["hit_rate_with_tier"] > 0
    assert tune.recommend_host_tier(signals(GAPS), WITH_SIZES).recommended is None  # no hold gauges from D


def test_the_nodes_ram_caps_it() -> None:
    small = dataclasses.replace(WITH_SIZES, d_kv_gib=10_000.0, host_ram_gib=128.0)
    rec = tune.recommend_host_tier(signals(GAPS, held_share=0.25, budget_share=0.3), small)
    assert rec.recommended == 96 and rec.predicted["host_tier_room_gib"] == 96  # 0.8 x 128 = 102.4, in 8 GiB steps


def test_it_is_one_of_the_recommendations_and_the_override_says_it() -> None:
    s = signals(GAPS, held_share=0.25, budget_share=0.3)
    recs = tune.recommend(s, WITH_SIZES)
    assert [r.setting for r in recs][-1] == "kv_host_memory_gib"
    text = tune.override_yaml(tune.TuneResult("t", s, tuple(recs)), "t")
    assert any(line.startswith("# kv_host_memory_gib: ") for line in text.splitlines())


def test_current_of_reads_d_and_its_node() -> None:
    t = load_topology(ROOT / "examples" / "h200-shared-qwen3-8b-host-tier.yaml").topology
    c = tune.current_of(t)
    assert c.host_tier_gib == 48 and c.host_ram_gib == 128 and c.d_kv_gib is not None and 30 < c.d_kv_gib < 60
    assert tune.current_of(load_topology(ROOT / "examples" / "local-cpu.yaml").topology).host_tier_gib == 0
