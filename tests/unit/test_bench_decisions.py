"""`bpdkv bench` reports P's pull decisions (issue 34 item 6): read from P's /metrics by outcome and reason, as deltas
over the run, per turn >= 2 and the share recomputed because of the link."""

from __future__ import annotations

from bpdkv.bench import report, runner

BEFORE = """vllm:bpdkv_pull_decisions_total{engine="0",model_name="m",outcome="probe",reason="first_contact"} 1.0
"""
AFTER = """# HELP vllm:bpdkv_pull_decisions_total P: what became of each offer
vllm:bpdkv_pull_decisions_total{engine="0",model_name="m",outcome="probe",reason="first_contact"} 2.0
vllm:bpdkv_pull_decisions_total{engine="1",model_name="m",outcome="probe",reason="no_estimate"} 1.0
vllm:bpdkv_pull_decisions_total{engine="0",model_name="m",outcome="pulled",reason="link_faster"} 5.0
vllm:bpdkv_pull_decisions_total{engine="0",model_name="m",outcome="recomputed",reason="link_slower"} 2.0
"""


def test_decisions_are_counted_per_run_and_per_turn() -> None:
    assert runner.decision_counts(BEFORE) == {"decision:probe/first_contact": 1.0}
    before, after = {"p": runner.parse_metrics(BEFORE)}, {"p": runner.parse_metrics(AFTER)}
    deltas = runner.counter_deltas(before, after, ["p"])
    assert deltas["p"]["decision:probe/first_contact"] == 1.0 and deltas["p"]["decision:pulled/link_faster"] == 5.0
    got = report.decisions(deltas, later_turns=9)
    assert got["counts"] == {"probe/first_contact": 1.0, "probe/no_estimate": 1.0, "pulled/link_faster": 5.0, "recomputed/link_slower": 2.0}
    assert got["offers"] == 9 and got["per_turn"]["pulled/link_faster"] == 5 / 9
    assert got["recomputed_link_slower_share"] == 2 / 9
    assert report.decisions({"p": {"nixl_bytes_sum": 1.0}}, 0) == {
        "counts": {},
        "offers": 0,
        "per_turn": {},
        "recomputed_link_slower_share": None,
    }
