"""Soak: a real `bpdkv router` process, emulated P and D (2 each) restarted one after another under concurrent
multi-turn traffic (plain conversations, clients all claiming one X-Session-Id, concurrent branches of one history).
No client error except the in-flight requests of the upstream being killed (a clean error, never a hang), every
answer equal to a single server's, no KV of another history pulled, the router's RSS flat.
CI runs BPDKV_SOAK_SECONDS (default 75 s, ~8 restarts); benchmarks/router_soak.py runs 10 minutes."""

from __future__ import annotations

import json
import os

import pytest

from bpdkv.testing.soak import Outcome, SoakSettings, run_soak

pytestmark = pytest.mark.slow
SECONDS = float(os.environ.get("BPDKV_SOAK_SECONDS", "75"))


def test_soak_with_restarts_of_prefill_and_decode() -> None:
    # Half the clients pause between turns (an agent running its tools), so conversations outlive their D's restart.
    settings = SoakSettings(
        duration=SECONDS, concurrency=9, restart_every=max(SECONDS / 10, 5.0), down_seconds=2.0, request_timeout=20.0, think_seconds=0.5
    )
    report = run_soak(settings)
    summary = report.summary()
    print(json.dumps({k: v for k, v in summary.items() if k != "settings"}, indent=1))
    restarted = {k.upstream for k in report.restarts}
    assert {"prefill-0", "decode-0", "prefill-1", "decode-1"} <= restarted, f"every upstream restarted at least once: {restarted}"
    assert summary["outcomes"]["ok"] > 10 * SECONDS / 60 * settings.concurrency, "the soak served a steady load"
    assert report.failures() == [], "only in-flight requests of a killed upstream may fail"
    assert summary["outcomes"][Outcome.HANG.value] == 0 and summary["outcomes"][Outcome.WRONG_ANSWER.value] == 0
    assert report.pulls > 0, "P pulled D's blocks during the soak (reuse through P was exercised)"
    assert report.local_turns > 0, "D continued turns from its own hold during the soak (decode_local was exercised)"
    assert report.wrong_kv_tokens == 0, "no history got the KV of another (shared session id, concurrent branches)"
    assert report.rss_growth_mb() < 25, f"router RSS grew {report.rss_growth_mb():.1f} MB: {report.rss_mb}"
