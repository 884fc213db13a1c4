"""Per-turn paths (router/paths.py): short continued turns run on the D that holds the conversation (decode_local),
long ones go through P and pull (prefill_pull), new ones through P (prefill_full) — decided from the new-token
estimate, D's state (draining, restarted, released hold) and its engine's load; outputs equal a single server's."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bpdkv import contracts
from bpdkv.router import paths
from bpdkv.router.config import PathSettings
from bpdkv.router.paths import PathInputs, PathReason, TurnPath
from bpdkv.router.upstreams import EngineLoad, Upstream
from bpdkv.testing.vllm_emulator import VllmEmulator
from tests.router.helpers import SYSTEM, chat

AUTO = PathSettings(load_interval=0.05)  # the product's defaults, engine signals read every 50 ms
DEFAULTS = PathSettings()


# ---- the decision, alone -------------------------------------------------------------------------------------------
def inputs(**changes: Any) -> PathInputs:
    base: dict[str, Any] = {
        "stored": True,
        "new_tokens": 100,
        "local_allowed": True,
        "decode_available": True,
        "decode_waiting": 0.0,
        "decode_kv_usage": 0.3,
        "decode_local_tokens": 0,
    }
    return PathInputs(**{**base, **changes})


@pytest.mark.parametrize(
    ("changes", "path", "reason"),
    [
        ({}, TurnPath.DECODE_LOCAL, PathReason.FEW_NEW_TOKENS),
        ({"new_tokens": 512}, TurnPath.DECODE_LOCAL, PathReason.FEW_NEW_TOKENS),
        ({"new_tokens": 513}, TurnPath.PREFILL_PULL, PathReason.TOO_MANY_NEW_TOKENS),
        ({"stored": False}, TurnPath.PREFILL_FULL, PathReason.NOTHING_STORED),
        ({"local_allowed": False}, TurnPath.PREFILL_PULL, PathReason.LOCAL_OFF),
        ({"new_tokens": None}, TurnPath.PREFILL_PULL, PathReason.SIZE_UNKNOWN),
        ({"decode_available": False}, TurnPath.PREFILL_PULL, PathReason.DECODE_UNAVAILABLE),
        ({"decode_waiting": 1.0}, TurnPath.PREFILL_PULL, PathReason.DECODE_QUEUEING),
        ({"decode_kv_usage": 0.9}, TurnPath.PREFILL_PULL, PathReason.DECODE_KV_FULL),
        ({"decode_waiting": None, "decode_kv_usage": None}, TurnPath.DECODE_LOCAL, PathReason.FEW_NEW_TOKENS),  # no signal
        ({"decode_local_tokens": 400}, TurnPath.DECODE_LOCAL, PathReason.FEW_NEW_TOKENS),
        ({"decode_local_tokens": 413}, TurnPath.PREFILL_PULL, PathReason.DECODE_PREFILL_BUDGET),
    ],
)
def test_decision_matrix(changes: dict[str, Any], path: TurnPath, reason: PathReason) -> None:
    got = paths.decide(inputs(**changes), DEFAULTS)
    assert (got.path, got.reason) == (path, reason)


def test_zero_turns_decode_local_off() -> None:
    got = paths.decide(inputs(new_tokens=1), PathSettings(local_max_tokens=0))
    assert (got.path, got.reason) == (TurnPath.PREFILL_PULL, PathReason.LOCAL_OFF)


@settings(max_examples=400, deadline=None)
@given(
    stored=st.booleans(),
    n=st.one_of(st.none(), st.integers(1, 4000)),
    allowed=st.booleans(),
    available=st.booleans(),
    waiting=st.one_of(st.none(), st.integers(0, 5).map(float)),
    kv=st.one_of(st.none(), st.floats(0, 1)),
    in_flight=st.integers(0, 1200),
    limit=st.integers(0, 2000),
)
def test_decision_fuzzed_local_only_when_every_condition_holds(
    stored: bool, n: int | None, allowed: bool, available: bool, waiting: float | None, kv: float | None, in_flight: int, limit: int
) -> None:
    s = PathSettings(local_max_tokens=limit)
    got = paths.decide(inputs(stored=stored, new_tokens=n, local_allowed=allowed, decode_available=available,
                              decode_waiting=waiting, decode_kv_usage=kv, decode_local_tokens=in_flight), s)  # fmt: skip
    local = (
        stored
        and allowed
        and limit > 0
        and n is not None
        and n <= limit
        and available
        and (waiting is None or waiting <= s.local_max_waiting)
        and (kv is None or kv < s.local_max_kv_usage)
        and (in_flight == 0 or in_flight + n <= limit)
    )
    assert (got.path is TurnPath.DECODE_LOCAL) is local
    assert (got.path is TurnPath.PREFILL_FULL) is (not stored)


@pytest.mark.parametrize(
    ("running", "waiting", "own", "in_flight_now", "seen_waiting"),
    [
        (0.0, 1.0, 1, 0, 0.0),  # the turn's own D request, waiting on P's KV when read, is over: D is not queueing
        (1.0, 0.0, 1, 0, 0.0),
        (0.0, 1.0, 1, 1, 1.0),  # still in flight: the signal stands
        (1.0, 1.0, 1, 0, 1.0),  # the engine had more than this router's own: another router's request may still wait
        (0.0, 2.0, None, 0, 2.0),  # not known what was this router's (the emulator's override, an old read)
    ],
)
def test_a_signal_made_only_of_the_routers_own_finished_requests_is_superseded(
    running: float, waiting: float, own: int | None, in_flight_now: int, seen_waiting: float
) -> None:
    d = Upstream("decode-0", "http://d", "decode")
    d.engine_load = EngineLoad(running, waiting, 0.2, at=100.0, own=own)
    d.outstanding = in_flight_now
    got = paths.inputs_for(True, 10, True, d, now=100.5)
    assert got.decode_waiting == seen_waiting and got.decode_kv_usage == 0.2
    want = TurnPath.DECODE_LOCAL if seen_waiting == 0 else TurnPath.PREFILL_PULL
    assert paths.decide(got, DEFAULTS).path is want
    assert d.fresh_load(100.0 + d.load_fresh_for + 0.1) is None  # and a stale one is no signal at all


# ---- through the router ----------------------------------------------------------------------------------------------
def path_count(fleet: Any, path: TurnPath, reason: PathReason | None = None) -> float:
    labels = {"path": path.value} | ({"reason": reason.value} if reason else {})
    return fleet.metric("bpdkv_router_paths_total", **labels)


def local_turns(d: VllmEmulator) -> list[dict[str, Any]]:
    return [r for r in d.requests if (r.get(contracts.KV_TRANSFER_PARAMS) or {}).get(contracts.LOCAL_TURN)]


def fresh_messages() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"conversation {uuid.uuid4().hex[:8]}: first question"}]


@pytest.mark.parametrize("stream", [False, True])
def test_short_turns_continue_on_d_and_a_long_one_goes_through_p(fleet_factory, reference, stream: bool) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(router_changes={"paths": AUTO})
    p, d = fleet.prefill[0], fleet.decode[0]
    messages = fresh_messages()
    for turn in range(6):
        if turn == 3:  # a tool returns a long document: through P, which pulls the history from D
            messages.append({"role": "tool", "content": "document: " + "the decode node keeps the blocks. " * 80})
        elif turn:
            messages.append({"role": "user", "content": f"short follow-up {turn}"})
        p_seen, d_computed = len(p.requests), d.counters.get("prompt_tokens:local_compute", 0)
        text, _ = chat(fleet.url, messages, stream=stream)
        assert text == chat(reference, messages)[0], turn
        prompt = len(VllmEmulator.chat_tokens(messages))
        if turn in (0, 3):
            assert len(p.requests) == p_seen + 1, turn
        else:
            assert len(p.requests) == p_seen, f"turn {turn}: P received a continued turn"
            computed = d.counters["prompt_tokens:local_compute"] - d_computed
            assert 0 < computed < prompt / 3, (turn, computed, prompt)  # D's own cache covered the history
        messages.append({"role": "assistant", "content": text})
    assert path_count(fleet, TurnPath.PREFILL_FULL) == 1
    assert path_count(fleet, TurnPath.PREFILL_PULL, PathReason.TOO_MANY_NEW_TOKENS) == 1
    assert path_count(fleet, TurnPath.DECODE_LOCAL, PathReason.FEW_NEW_TOKENS) == 4
    assert p.counters.get("prompt_tokens:external_kv_transfer", 0) > 0  # the long turn pulled D's history
    assert fleet.metric("bpdkv_router_reuse_total", outcome="hit") == 5
    # Each local turn released the hold it superseded and D holds the newest: one hold for the conversation.
    released = [r[contracts.KV_TRANSFER_PARAMS].get(contracts.RELEASE_REQUEST_IDS) for r in local_turns(d)]
    assert len(released) == 4 and all(ids and len(ids) == 1 for ids in released)
    assert len(d.held) == 1
    assert all(contracts.KV_TRANSFER_PARAMS not in r or contracts.LOCAL_TURN not in r[contracts.KV_TRANSFER_PARAMS] for r in p.requests)


def test_client_params_stay_stripped_on_a_local_turn(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(router_changes={"paths": AUTO})
    messages = fresh_messages()
    text, _ = chat(fleet.url, messages)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "next"}]
    evil = {"kv_transfer_params": {"remote_engine_id": "attacker", "remote_block_ids": [[1]], "do_remote_decode": True}}
    chat(fleet.url, messages, **evil)
    sent = local_turns(fleet.decode[0])[-1][contracts.KV_TRANSFER_PARAMS]
    assert set(sent) <= {contracts.LOCAL_TURN, contracts.RELEASE_REQUEST_IDS, contracts.HOLD, contracts.RETURN_FORECAST}, sent


def test_last_turn_on_d_holds_nothing(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(router_changes={"paths": AUTO})
    messages = fresh_messages()
    text, _ = chat(fleet.url, messages)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "bye"}]
    chat(fleet.url, messages, headers={contracts.LAST_TURN_HEADER: "true"})
    sent = local_turns(fleet.decode[0])[-1][contracts.KV_TRANSFER_PARAMS]
    assert sent[contracts.HOLD] is False and fleet.decode[0].held == {}


def _two_turns(fleet: Any, reference: str, headers: dict[str, str] | None = None, between: Any = None) -> tuple[str, str]:
    """Turn 1 and a short turn 2 (after `between()`): (path, reason) of turn 2; the answers must equal the reference."""
    messages = fresh_messages()
    text, _ = chat(fleet.url, messages, headers=headers)
    assert text == chat(reference, messages)[0]
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}]
    if between is not None:
        between(messages)
    before = {(pth, r): path_count(fleet, pth, r) for pth in TurnPath for r in PathReason}
    second, resp = chat(fleet.url, messages, headers=headers)
    assert second == chat(reference, messages)[0], resp
    (turn2,) = [key for key in before if path_count(fleet, *key) > before[key]]
    return turn2[0].value, turn2[1].value


def _wait_for_load(fleet: Any, upstream: str, waiting: float | None = None, kv: float | None = None) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        text = httpx.get(fleet.url + "/metrics", timeout=5).text
        ok = waiting is None or f'bpdkv_router_engine_waiting{{role="decode",upstream="{upstream}"}} {waiting}' in text
        ok = ok and (kv is None or f'bpdkv_router_engine_kv_usage{{role="decode",upstream="{upstream}"}} {kv}' in text)
        if ok:
            return
        time.sleep(0.05)
    raise AssertionError(f"router never saw {upstream}'s load")


def _wait_for_budget(fleet: Any, upstream: str, tokens: tuple[int, int] | None) -> None:
    """Until the router's step budget for `upstream` is within `tokens` (None: not measured, no series)."""
    deadline = time.monotonic() + 10
    series = f'bpdkv_router_local_budget_tokens{{role="decode",upstream="{upstream}"}}'
    while time.monotonic() < deadline:
        text = httpx.get(fleet.url + "/metrics", timeout=5).text
        line = next((x for x in text.splitlines() if x.startswith(series)), None)
        if line is None and tokens is None:
            return
        if line is not None and tokens is not None and tokens[0] <= float(line.split()[-1]) <= tokens[1]:
            return
        time.sleep(0.05)
    raise AssertionError(f"the router's step budget for {upstream} never came within {tokens}")


def test_d_states_and_load_keep_turns_off_d(fleet_factory, reference, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys"
    keys.write_text("sk-alpha\nsk-beta\n")
    fleet = fleet_factory(n_decode=2, router_changes={"paths": AUTO, "api_keys_file": str(keys)})
    a = {"Authorization": "Bearer sk-alpha"}
    d0 = fleet.decode[0]
    router = fleet.routers[0]
    assert _two_turns(fleet, reference, a) == ("decode_local", "few_new_tokens")

    def drain(_: Any) -> None:
        httpx.post(fleet.url + "/admin/upstreams/decode-0/drain", timeout=10)

    assert _two_turns(fleet, reference, a, drain) == ("prefill_pull", "decode_unavailable")
    httpx.post(fleet.url + "/admin/upstreams/decode-0/undrain", timeout=10)

    def queueing(_: Any) -> None:
        d0.load_override = (4.0, 2.0, 0.2)
        _wait_for_load(fleet, "decode-0", waiting=2.0)

    def kv_full(_: Any) -> None:
        d0.load_override = (1.0, 0.0, 0.97)
        _wait_for_load(fleet, "decode-0", kv=0.97)

    # A new conversation goes to the D that is not queueing: let decode-0 take turn 1, then load it.
    for between, want in ((queueing, ("prefill_pull", "decode_queueing")), (kv_full, ("prefill_pull", "decode_kv_full"))):
        d0.load_override = (0.0, 0.0, 0.0)
        _wait_for_load(fleet, "decode-0", waiting=0.0, kv=0.0)
        assert _two_turns(fleet, reference, a, between) == want
    d0.load_override = None

    # The same history from another tenant: nothing stored for it, through P.
    messages = fresh_messages()
    text, _ = chat(fleet.url, messages, headers=a)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}]
    full = path_count(fleet, TurnPath.PREFILL_FULL)
    assert chat(fleet.url, messages, headers={"Authorization": "Bearer sk-beta"})[0] == chat(reference, messages)[0]
    assert path_count(fleet, TurnPath.PREFILL_FULL) == full + 1

    def released(_: Any) -> None:
        import asyncio

        asyncio.run(
            router.store.mark_released([f"{m}:{rid}" for m, d in (("decode-0", d0), ("decode-1", fleet.decode[1])) for rid in d.held], 60)
        )

    assert _two_turns(fleet, reference, a, released) == ("prefill_full", "nothing_stored")
    assert _two_turns(fleet, reference, {**a, contracts.PATHS_HEADER: contracts.PATHS_PULL_ONLY}) == ("prefill_pull", "local_off")


def test_a_restarted_d_gets_no_local_turn_and_the_client_sees_nothing(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    """Seen restart (its health check failed, then passed): its sessions are not offered, the turn goes through P."""
    fleet = fleet_factory(router_changes={"paths": AUTO, "health": dataclass_health(0.2)})
    d = fleet.decode[0]

    def restart(_: Any) -> None:
        d.healthy = False
        wait_until(lambda: fleet.metric("bpdkv_router_backend_healthy", role="decode", upstream="decode-0") == 0)
        d.restart()
        d.healthy = True
        wait_until(lambda: fleet.metric("bpdkv_router_backend_healthy", role="decode", upstream="decode-0") == 1)

    assert _two_turns(fleet, reference, None, restart) == ("prefill_full", "nothing_stored")
    assert local_turns(d) == []


def test_an_unseen_restart_is_served_correctly_from_scratch(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    """No health check saw it: the local turn reaches the new engine, which computes the whole prompt — the same
    answer; its new engine id is learnt from that answer and the conversation continues on D."""
    fleet = fleet_factory(router_changes={"paths": AUTO})
    d = fleet.decode[0]
    messages = fresh_messages()
    text, _ = chat(fleet.url, messages)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}]
    d.restart()
    computed = d.counters.get("prompt_tokens:local_compute", 0)
    text, _ = chat(fleet.url, messages)
    assert text == chat(reference, messages)[0]
    assert d.counters["prompt_tokens:local_compute"] - computed == len(VllmEmulator.chat_tokens(messages))
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "and after that?"}]
    assert chat(fleet.url, messages)[0] == chat(reference, messages)[0]
    assert path_count(fleet, TurnPath.DECODE_LOCAL) == 2


def test_d_gone_before_its_first_byte_falls_back_through_p(fleet_factory, reference) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(n_decode=2, router_changes={"paths": AUTO})
    messages = fresh_messages()
    text, _ = chat(fleet.url, messages)
    assert len(fleet.decode[0].requests) == 1  # the tie goes to decode-0
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}]
    fleet.group.stop_one(1)  # decode-0 (servers: prefill-0, decode-0, decode-1)
    for stream in (False, True):
        got, _ = chat(fleet.url, messages, stream=stream)
        assert got == chat(reference, messages)[0]
        if not stream:
            assert path_count(fleet, TurnPath.PREFILL_FULL, PathReason.LOCAL_FAILED) == 1
    assert fleet.metric("bpdkv_router_requests_total", route="/v1/chat/completions", status="502") == 0


def test_estimate_tracks_what_d_computes(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    """The emulator's tokens are UTF-8 bytes: with chars_per_token 1 the router's estimate follows D's real work within
    the emulator's template markup (ChatML markers are bytes here, a few special tokens in a real tokenizer) and one block."""
    fleet = fleet_factory(router_changes={"paths": PathSettings(chars_per_token=1.0, load_interval=0)})
    d = fleet.decode[0]
    messages = fresh_messages()
    text, _ = chat(fleet.url, messages)
    for follow_up in ("a", "tell me more about the decode node, and its held blocks", "x" * 300):
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": follow_up}]
        computed = d.counters.get("prompt_tokens:local_compute", 0)
        estimated = fleet.metric("bpdkv_router_turn_new_tokens_sum", path="decode_local")
        text, _ = chat(fleet.url, messages)
        real = d.counters["prompt_tokens:local_compute"] - computed
        guess = fleet.metric("bpdkv_router_turn_new_tokens_sum", path="decode_local") - estimated
        assert len(follow_up) < real and abs(real - guess) <= 64 + d.settings.block_size, (follow_up[:10], real, guess)
    assert path_count(fleet, TurnPath.DECODE_LOCAL) == 3


def test_load_places_new_conversations_and_prefills(fleet_factory) -> None:  # type: ignore[no-untyped-def]
    fleet = fleet_factory(n_prefill=2, n_decode=2, router_changes={"paths": AUTO})
    fleet.decode[0].load_override = (8.0, 3.0, 0.5)
    fleet.prefill[0].load_override = (2.0, 4.0, 0.5)
    _wait_for_load(fleet, "decode-0", waiting=3.0)
    for _ in range(4):
        chat(fleet.url, fresh_messages())
    assert len(fleet.decode[0].requests) == 0 and len(fleet.decode[1].requests) == 4
    assert len(fleet.prefill[0].requests) == 0 and len(fleet.prefill[1].requests) == 4
    text = httpx.get(fleet.url + "/metrics", timeout=5).text
    assert 'bpdkv_router_engine_running{role="decode",upstream="decode-0"} 8.0' in text


# ---- fuzzed: the matrix on a live fleet --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def matrix_fleet() -> Any:
    from tests.router.conftest import make_fleet, stop_fleet
    from tests.router.test_router_paths import AUTO as auto

    fleet = make_fleet(n_decode=2, router_changes={"paths": auto})
    yield fleet
    stop_fleet(fleet)


@pytest.fixture(scope="module")
def matrix_reference() -> Any:
    from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup

    emu = VllmEmulator(EmulatorSettings(role="both"))
    group = ServerGroup([emu.app])
    (url,) = group.start()
    yield url
    group.stop()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    size=st.sampled_from([5, 200, 900, 3000]),
    waiting=st.sampled_from([0.0, 2.0]),
    kv=st.sampled_from([0.1, 0.95]),
    drained=st.booleans(),
    restarted=st.booleans(),
    released=st.booleans(),
    other_tenant=st.booleans(),
    step=st.sampled_from(["roomy", "tight", "unmeasured"]),
)
def test_matrix_fuzzed(
    matrix_fleet: Any, matrix_reference: str, size: int, waiting: float, kv: float, drained: bool, restarted: bool, released: bool,
    other_tenant: bool, step: str,
) -> None:  # fmt: skip
    fleet = matrix_fleet
    for d in fleet.decode:
        d.load_override = (0.0, 0.0, 0.0)
        d.step_override = (0.02, 100)  # D's streams step every 20 ms (median 17.5 ms in vLLM's buckets)
    # P's measured rate: a step budget of 0.05 x 17.5 ms x rate = 875 tokens (roomy) or 8 (tight); 0 = none measured.
    rate = {"roomy": 1_000_000.0, "tight": 10_000.0, "unmeasured": 0.0}[step]
    fleet.prefill[0].prefill_rate_override = rate
    for name in ("decode-0", "decode-1"):
        _wait_for_load(fleet, name, waiting=0.0, kv=0.0)
    tenant = {"Authorization": "Bearer alpha"}
    messages = fresh_messages()
    seen = [len(d.requests) for d in fleet.decode]
    text, _ = chat(fleet.url, messages, headers=tenant)
    holder = next(i for i, d in enumerate(fleet.decode) if len(d.requests) > seen[i])
    d = fleet.decode[holder]
    name = f"decode-{holder}"
    messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": "r" * size}]
    d.load_override = (1.0, waiting, kv)  # D streams one request of another conversation
    _wait_for_load(fleet, name, waiting=waiting, kv=kv)
    _wait_for_budget(fleet, name, {"roomy": (600, 900), "tight": (1, 9), "unmeasured": None}[step])
    if drained:
        httpx.post(fleet.url + f"/admin/upstreams/{name}/drain", timeout=10)
    if restarted:  # seen by the router: the D refused a request on its way down (as a health check would)
        fleet.routers[0].decode.member(name).restarted_at = time.time()
    if released:
        import asyncio

        asyncio.run(fleet.routers[0].store.mark_released([f"{name}:{rid}" for rid in d.held], 60))
    before = {pth: path_count(fleet, pth) for pth in TurnPath}
    local_before = len(local_turns(d))
    try:
        got, _ = chat(fleet.url, messages, headers={"Authorization": "Bearer beta"} if other_tenant else tenant)
    finally:
        if drained:
            httpx.post(fleet.url + f"/admin/upstreams/{name}/undrain", timeout=10)
    assert got == chat(matrix_reference, messages)[0]
    (taken,) = [pth for pth in TurnPath if path_count(fleet, pth) > before[pth]]
    stored = not (restarted or released or other_tenant)
    # The router's estimate by hand: (b"m\\0tool\\0" + content) / 3 chars per token, 8 per message, one block of 16.
    estimate = -(-(7 + size) // 3) + 8 + 16
    budget = {"roomy": 600, "tight": 9, "unmeasured": -1}[step]  # at least / at most (the turns' own gaps count too)
    local = stored and estimate <= 512 and not drained and waiting == 0 and kv < 0.9 and estimate <= budget
    want = TurnPath.DECODE_LOCAL if local else TurnPath.PREFILL_PULL if stored else TurnPath.PREFILL_FULL
    assert taken is want, (size, waiting, kv, drained, restarted, released, other_tenant, taken)
    assert (len(local_turns(d)) > local_before) is local


def dataclass_health(interval: float) -> Any:
    from bpdkv.router.config import HealthSettings

    return HealthSettings(interval=interval, failures_to_eject=1, backoff_max=1)


def wait_until(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)
