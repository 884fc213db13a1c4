"""Router behaviour against the protocol-faithful vLLM emulator (test double) — fast, on loopback."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import httpx
import pytest

from tests.router.helpers import SYSTEM, chat, complete_tokens, conversation


def test_multiturn_chat_reuses_d_kv_and_matches_reference(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(p_settings={"prefix_caching": False})
    got = conversation(fleet.url, turns=4)
    assert got == conversation(reference, turns=4)
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 3
    assert fleet.metric("bpdkv_router_reuse_total", outcome="miss") == 1
    p = fleet.prefill[0]
    assert p.counters["prompt_tokens:external_kv_transfer"] > 0
    assert p.counters.get("emulator_wrong_kv_tokens", 0) == 0
    # The client never sees kv_transfer_params; P got the do_remote_decode template on turn 1, D's params after.
    first, second = p.requests[0]["kv_transfer_params"], p.requests[1]["kv_transfer_params"]
    assert first["do_remote_decode"] is True and first["remote_block_ids"] is None
    assert second["remote_engine_id"] == fleet.decode[0].engine_id and second["remote_block_ids"]
    assert all(r["max_tokens"] == 1 and r["stream"] is False for r in p.requests)


def test_streaming_chat_passes_chunks_and_captures_params(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory()
    got = conversation(fleet.url, turns=4, stream=True)
    assert got == conversation(reference, turns=4)
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 3
    _, events = chat(fleet.url, [{"role": "user", "content": "hi there"}], stream=True)
    assert events and all("kv_transfer_params" not in e for e in events)
    assert fleet.decode[0].requests[-1]["stream"] is True


def test_nonstream_response_passed_through_whole(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory()
    _, data = chat(fleet.url, [{"role": "user", "content": "hello"}])
    _, direct = chat(reference, [{"role": "user", "content": "hello"}])
    assert set(data) == set(direct) - {"kv_transfer_params"} and "kv_transfer_params" not in data
    assert data["usage"]["completion_tokens"] > 0 and data["choices"][0]["logprobs"] is None


def test_token_id_completions_matched_by_prefix(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(p_settings={"prefix_caching": False})
    for stream in (False, True):
        prompt = list(range(1, 200)) if not stream else list(range(300, 450))
        ref_prompt = list(prompt)
        for _turn in range(3):
            text, out = complete_tokens(fleet.url, prompt, stream=stream)
            ref_text, ref_out = complete_tokens(reference, ref_prompt)
            assert text == ref_text
            prompt = prompt + out + list(range(5, 40))
            ref_prompt = ref_prompt + ref_out + list(range(5, 40))
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 4
    assert fleet.prefill[0].counters.get("emulator_wrong_kv_tokens", 0) == 0


def test_unpatched_decode_stream_counts_missing_params(fleet_factory, caplog) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(d_settings={"stream_params": False})
    with caplog.at_level(logging.WARNING, logger="bpdkv.router"):
        conversation(fleet.url, turns=3, stream=True)
    assert fleet.metric("bpdkv_router_d_params_missing_total") == 3
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 0
    assert sum("returned no kv_transfer_params" in r.message for r in caplog.records) == 1  # warned once


def test_client_kv_transfer_params_are_stripped(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory()
    evil = {
        "do_remote_decode": True,
        "remote_engine_id": "attacker",
        "remote_block_ids": [1, 2],
        "remote_host": "10.9.9.9",
        "remote_port": 1,
    }
    chat(fleet.url, [{"role": "user", "content": "hi"}], kv_transfer_params=evil)
    p_params = fleet.prefill[0].requests[-1]["kv_transfer_params"]
    d_params = fleet.decode[0].requests[-1]["kv_transfer_params"]
    assert p_params["remote_host"] is None and p_params["remote_engine_id"] is None
    assert d_params["remote_engine_id"] == fleet.prefill[0].engine_id
    completions = httpx.post(
        fleet.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": evil}, timeout=10
    )
    assert completions.status_code == 200
    assert fleet.prefill[0].requests[-1]["kv_transfer_params"]["remote_host"] is None


def test_expired_session_is_never_handed_to_prefill(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    now = [1000.0]
    # D keeps blocks 20 s and says so (relative expiry); router margin 10 s → usable for 10 s.
    fleet = fleet_factory(d_settings={"decoder_kv_blocks_ttl": 20}, router_changes={"session_ttl": 470}, clock=lambda: now[0])
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question, long enough to matter"}]
    text, _ = chat(fleet.url, messages)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "second"}]
    now[0] += 11
    text2, resp = chat(fleet.url, messages)
    assert text2, resp
    assert fleet.metric("bpdkv_router_reuse_total", outcome="expired") == 1
    assert fleet.prefill[0].counters.get("nixl_num_kv_expired_reqs", 0) == 0
    assert fleet.prefill[0].requests[-1]["kv_transfer_params"]["remote_block_ids"] is None


def test_emulator_is_faithful_about_expiry(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    """Guards the double: handing P blocks that expire within 5 s gives HTTP 500 like upstream."""
    fleet = fleet_factory(d_settings={"decoder_kv_blocks_ttl": 4})
    messages = [{"role": "user", "content": "x" * 200}]
    d_url = fleet.emulator_urls[1]
    p_url = fleet.emulator_urls[0]
    p1 = httpx.post(
        p_url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=10,
    ).json()
    d1 = httpx.post(
        d_url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 5, "kv_transfer_params": p1["kv_transfer_params"]},
        timeout=10,
    ).json()
    messages += [{"role": "assistant", "content": d1["choices"][0]["message"]["content"]}, {"role": "user", "content": "more"}]
    p2 = httpx.post(
        p_url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 1, "kv_transfer_params": d1["kv_transfer_params"]},
        timeout=10,
    )
    assert p2.status_code == 500


def test_below_threshold_pull_skipped_by_prefill(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(p_settings={"kv_recompute_threshold": 10_000})
    conversation(fleet.url, turns=2)
    assert fleet.prefill[0].counters.get("emulator_pulls_skipped") == 1
    assert fleet.prefill[0].counters.get("prompt_tokens:external_kv_transfer", 0) == 0


def test_entries_are_single_use(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q1"}]
    text, _ = chat(fleet.url, messages)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "q2"}]
    chat(fleet.url, messages)
    chat(fleet.url, messages)  # a retry of the same turn must not pull freed blocks again
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 1
    assert fleet.prefill[0].counters.get("nixl_num_kv_expired_reqs", 0) == 0


def test_tenants_never_share_sessions_and_keys_stay_out_of_logs(fleet_factory, tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys"
    keys.write_text("# router keys\nsk-alpha-SECRET\nsk-beta-SECRET\n")
    fleet = fleet_factory(router_changes={"api_keys_file": str(keys)})
    a = {"Authorization": "Bearer sk-alpha-SECRET"}
    b = {"Authorization": "Bearer sk-beta-SECRET"}
    assert httpx.post(fleet.url + "/v1/chat/completions", json={"messages": []}, timeout=10).status_code == 401
    assert (
        httpx.post(
            fleet.url + "/v1/chat/completions", json={"messages": []}, headers={"Authorization": "Bearer nope"}, timeout=10
        ).status_code
        == 401
    )
    with caplog.at_level(logging.DEBUG):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "shared question"}]
        text, _ = chat(fleet.url, messages, headers=a)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "next"}]
        chat(fleet.url, messages, headers=b)  # same history, other tenant: must miss
        assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 0
        chat(fleet.url, messages, headers=a)
        assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 1
    assert "SECRET" not in caplog.text
    assert all("SECRET" not in json.dumps(r) for r in fleet.prefill[0].requests)


def test_explicit_session_id_checked_against_history(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory()
    h = {"X-Session-Id": "conv-1"}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q1"}]
    text, _ = chat(fleet.url, messages, headers=h)
    edited = messages + [{"role": "assistant", "content": text + " (edited)"}, {"role": "user", "content": "q2"}]
    chat(fleet.url, edited, headers=h)
    assert fleet.metric("bpdkv_router_reuse_total", outcome="mismatch") == 1
    # body field works too and never reaches vLLM
    text, _ = chat(fleet.url, messages, session_id="conv-2")
    assert "session_id" not in fleet.decode[0].requests[-1]
    chat(fleet.url, messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "q2"}], session_id="conv-2")
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 1


def test_health_ready_models_metrics(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory()
    assert httpx.get(fleet.url + "/health", timeout=5).json() == {"status": "ok"}
    ready = httpx.get(fleet.url + "/ready", timeout=5)
    assert ready.status_code == 200 and ready.json()["prefill"] == ["prefill-0"]
    assert httpx.get(fleet.url + "/v1/models", timeout=5).json()["data"][0]["id"] == "emulated"
    chat(fleet.url, [{"role": "user", "content": "hi"}])
    text = httpx.get(fleet.url + "/metrics", timeout=5).text
    for name in (
        "bpdkv_router_requests_total",
        "bpdkv_router_ttft_seconds_bucket",
        "bpdkv_router_upstream_seconds_bucket",
        "bpdkv_router_active_sessions",
        "bpdkv_router_backend_healthy",
        "bpdkv_router_store_errors_total",
    ):
        assert name in text
    assert fleet.metric("bpdkv_router_requests_total", route="/v1/chat/completions", status="200") == 1
    assert fleet.metric("bpdkv_router_active_sessions") == 1


def test_bad_json_is_a_400(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory()
    resp = httpx.post(fleet.url + "/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}, timeout=5)
    assert resp.status_code == 400 and "not valid JSON" in resp.text


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_and_decode_failures_retry_elsewhere(fleet_factory, reference, stream: bool) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(n_prefill=2, n_decode=2)
    first = conversation(fleet.url, turns=2, stream=stream)
    fleet.group.stop_one(0)  # prefill-0 dies
    fleet.group.stop_one(2)  # decode-0 dies
    answers = [conversation(fleet.url, turns=2, stream=stream) for _ in range(3)]
    assert first == answers[0] == conversation(reference, turns=2)
    assert fleet.metric("bpdkv_router_upstream_errors_total") >= 1
    statuses = fleet.metric("bpdkv_router_requests_total", status="200")
    assert statuses == 8


def test_slow_prefill_times_out_cleanly(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    from bpdkv.router.config import Timeouts

    # P would take ~25 s (1 s a token): the router gives up at its 0.5 s prefill timeout, long before P would answer.
    # The bound is P's own time, not a guess at how fast a loaded machine is (a 5 s bound on a 1.5 s P failed at load 11).
    fleet = fleet_factory(
        p_settings={"prefill_seconds_per_token": 1.0},
        router_changes={"timeouts": Timeouts(connect=1, prefill=0.5, decode_first_byte=1, decode_idle=1)},
    )
    start = time.monotonic()
    _, resp = chat(fleet.url, [{"role": "user", "content": "x" * 100}])
    assert resp.status_code == 502 and "no prefill upstream succeeded" in resp.text and "Timeout" in resp.text
    assert time.monotonic() - start < 20


def test_slow_decode_first_byte_times_out(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    from bpdkv.router.config import Timeouts

    # D's first token would come after 30 s: the 502 must come from the router's 0.5 s first-byte timeout, well before.
    fleet = fleet_factory(
        d_settings={"first_token_delay": 30},
        router_changes={"timeouts": Timeouts(connect=1, prefill=2, decode_first_byte=0.5, decode_idle=0.5)},
    )
    start = time.monotonic()
    resp = httpx.post(fleet.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True}, timeout=60)
    assert resp.status_code == 502
    assert time.monotonic() - start < 20


def test_client_disconnect_cancels_upstream(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(d_settings={"token_interval": 0.1})
    body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", fleet.url + "/v1/chat/completions", json=body, timeout=10) as resp:
        for _ in resp.iter_lines():
            break  # first event, then hang up
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and fleet.decode[0].counters.get("emulator_streams_cancelled", 0) < 1:
        time.sleep(0.05)
    assert fleet.decode[0].counters.get("emulator_streams_cancelled") == 1
    assert fleet.metric("bpdkv_router_in_flight") == 0
    assert fleet.metric("bpdkv_router_backend_outstanding") == 0
    assert fleet.metric("bpdkv_router_requests_total", status="499") == 1


def test_benchmark_switches_reuse_off_and_fresh_prefill_salt(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory()
    off = {"X-Bpdkv-Reuse": "off", "X-Bpdkv-Prefill-Cache": "off"}
    conversation(fleet.url, turns=3, headers=off)
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 0
    assert fleet.metric("bpdkv_router_sessions_stored_total") == 0
    salts = [r.get("cache_salt") for r in fleet.prefill[0].requests]
    assert all(salts) and len(set(salts)) == 3  # a fresh salt per P request
    assert all("cache_salt" not in r for r in fleet.decode[0].requests)  # D keeps its cache


def test_client_gone_before_first_byte_releases_everything(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    """The abandon path: the client leaves while D has not sent a byte; D's request is cancelled, nothing stays counted."""
    fleet = fleet_factory(d_settings={"first_token_delay": 2.0})
    body = {"messages": [{"role": "user", "content": "slow start"}], "max_tokens": 5, "stream": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fleet.url + "/v1/chat/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and fleet.metric("bpdkv_router_requests_total", status="499") < 1:
        time.sleep(0.05)
    assert fleet.metric("bpdkv_router_requests_total", status="499") == 1
    assert fleet.metric("bpdkv_router_in_flight") == 0
    assert fleet.metric("bpdkv_router_backend_outstanding") == 0
    while time.monotonic() < deadline and fleet.decode[0].counters.get("emulator_streams_cancelled", 0) < 1:
        time.sleep(0.05)
    assert fleet.decode[0].counters.get("emulator_streams_cancelled", 0) == 1  # D's response was closed
