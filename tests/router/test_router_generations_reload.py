"""The router's config file, reloaded while it serves (router/reload.py): upstreams and generations apply in place,
nothing else does, a bad file changes nothing, and a member moved to another generation is never offered a location
of its old one. Real routers on loopback in front of emulated engines (test doubles) of vLLM 0.31.0 and 0.32.0."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bpdkv import contracts
from bpdkv.router import sessions
from bpdkv.router.app import Router
from bpdkv.router.config import RouterConfig, UpstreamSpec, load_config
from bpdkv.router.metrics import RouterMetrics
from bpdkv.router.reuse import ReusePolicy
from bpdkv.router.upstreams import Pool, build_members
from bpdkv.sse import Reply
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator
from tests.router.helpers import chat
from tests.router.test_router_generations import NEW, OLD, Conversation, engines, metric

WAIT_S = 15.0  # a reload is due within about a second; bound every wait well above it


def gen(spec: Any) -> dict[str, Any]:
    return {"id": spec.id, "vllm": spec.vllm, "model_root": spec.model_root}


def config_doc(
    prefill: dict[str, tuple[str, str]], decode: dict[str, tuple[str, str]], generations: tuple[Any, ...] = (OLD, NEW), **extra: Any
) -> dict[str, Any]:
    """A router config file: name → (url, generation) per role."""
    return {
        "listen": "127.0.0.1",
        "port": 0,
        "generations": [gen(g) for g in generations],
        "prefill": [{"name": n, "url": u, "generation": g} for n, (u, g) in prefill.items()],
        "decode": [{"name": n, "url": u, "generation": g} for n, (u, g) in decode.items()],
        "timeouts": {"connect": 2, "prefill": 10, "decode_first_byte": 10, "decode_idle": 10},
        "health": {"interval": 0.5, "failures_to_eject": 3, "backoff_max": 2},
        "paths": {"local_max_tokens": 0},  # every turn through P: the pull path is what generations guard
        **extra,
    }


def write(path: Path, doc: dict[str, Any]) -> str:
    """Write the file as a renderer would (a new file moved into place); its digest as the router shows it."""
    raw = yaml.safe_dump(doc).encode()
    tmp = path.with_suffix(".new")
    tmp.write_bytes(raw)
    tmp.replace(path)
    return hashlib.sha256(raw).hexdigest()[:16]


def admin_config(url: str) -> dict[str, Any]:
    resp = httpx.get(url + "/admin/config", timeout=10)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def wait_config(url: str, digest: str, serving: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    view: dict[str, Any] = {}
    while time.monotonic() < deadline:
        view = admin_config(url)
        if view["digest"] == digest and (serving is None or all(view["serving"].get(g) == c for g, c in serving.items())):
            return view
        time.sleep(0.1)
    raise AssertionError(f"router config {view}, wanted digest {digest} serving {serving}")


class Lab:
    """Emulated engines, each in its own server (one can be stopped alone), and one router from a config file."""

    def __init__(self) -> None:
        self.groups: list[ServerGroup] = []
        self.router: Router | None = None

    def engine(self, emulator: VllmEmulator) -> str:
        group = ServerGroup([emulator.app])
        self.groups.append(group)
        (url,) = group.start()
        return url

    def start_router(self, path: Path) -> str:
        self.router = Router(load_config(path))
        group = ServerGroup([self.router.app])
        self.groups.append(group)
        (url,) = group.start()
        return url

    def stop(self) -> None:
        for group in reversed(self.groups):
            group.stop()


@pytest.fixture
def lab() -> Iterator[Lab]:
    made = Lab()
    yield made
    made.stop()


def engine_ids_by_generation(groups: dict[str, list[VllmEmulator]]) -> dict[str, set[str]]:
    return {g: {e.engine_id for e in members} for g, members in groups.items()}


def assert_locations_within_generation(groups: dict[str, list[VllmEmulator]]) -> int:
    """Every D location (engine id) any engine was sent is of its own generation; returns how many were sent."""
    ids = engine_ids_by_generation(groups)
    sent = 0
    for g, members in groups.items():
        for engine in members:
            for body in engine.requests:
                other = (body.get(contracts.KV_TRANSFER_PARAMS) or {}).get(contracts.REMOTE_ENGINE_ID)
                if other is None:
                    continue
                sent += 1
                assert other in ids[g], f"{engine.settings.role} of {g} was sent a location on engine {other}"
            assert engine.counters.get("emulator_cross_generation_reads", 0) == 0
    return sent


def test_reload_adds_a_generation_and_new_conversations_go_there_once_it_serves(lab: Lab, reference: str, tmp_path: Path) -> None:
    (p_old, d_old), (p_new, d_new) = engines("0.31.0"), engines("0.32.0")
    urls = {name: lab.engine(e) for name, e in (("p-old", p_old), ("d-old", d_old), ("p-new", p_new), ("d-new", d_new))}
    path = tmp_path / "router.yaml"
    first = write(path, config_doc({"p-old": (urls["p-old"], OLD.id)}, {"d-old": (urls["d-old"], OLD.id)}))
    url = lab.start_router(path)
    view = wait_config(url, first, {OLD.id: {"prefill": 1, "decode": 1}})
    assert view["generations"] == [OLD.id, NEW.id] and view["serving"][NEW.id] == {"prefill": 0, "decode": 0}
    listed = httpx.get(url + "/admin/upstreams", timeout=10).json()
    assert listed["config"] == {"digest": first, "loaded_at": view["loaded_at"]}
    assert {u["name"]: u["generation"] for u in listed["upstreams"]} == {"p-old": OLD.id, "d-old": OLD.id}

    old_talk = Conversation(url, reference, "old")
    old_talk.turn()
    old_talk.turn(stream=True)

    # The new generation's P and D join the running router: no restart, new conversations go there once they serve.
    second = write(
        path,
        config_doc(
            {"p-old": (urls["p-old"], OLD.id), "p-new": (urls["p-new"], NEW.id)},
            {"d-old": (urls["d-old"], OLD.id), "d-new": (urls["d-new"], NEW.id)},
        ),
    )
    view = wait_config(url, second, {OLD.id: {"prefill": 1, "decode": 1}, NEW.id: {"prefill": 1, "decode": 1}})
    assert view["loaded_at"] > listed["config"]["loaded_at"] and view["pending_restart"] == []
    new_talk = Conversation(url, reference, "new")
    new_talk.turn()
    new_talk.turn(stream=True)
    old_talk.turn()  # the old conversation continues where its D holds it
    assert len(p_old.requests) == 3 and len(p_new.requests) == 2
    assert metric(url, "bpdkv_router_generation_turns_total", generation=NEW.id, kind="new") == 1
    assert metric(url, "bpdkv_router_generation_turns_total", generation=OLD.id, kind="continued") == 2

    # The old generation leaves the file: its members get no new requests; its conversation moves, with no error.
    third = write(path, config_doc({"p-new": (urls["p-new"], NEW.id)}, {"d-new": (urls["d-new"], NEW.id)}, (NEW,)))
    view = wait_config(url, third, {NEW.id: {"prefill": 1, "decode": 1}})
    assert view["generations"] == [NEW.id] and OLD.id not in view["serving"]
    old_talk.turn()
    assert len(p_old.requests) == 3 and len(p_new.requests) == 3
    assert assert_locations_within_generation({OLD.id: [p_old, d_old], NEW.id: [p_new, d_new]}) > 0
    text = httpx.get(url + "/metrics", timeout=10).text
    assert 'bpdkv_router_backend_healthy{role="decode",upstream="d-old"}' not in text  # no series of a removed member
    assert f'bpdkv_router_generation_serving{{generation="{OLD.id}"}}' not in text


def test_a_member_moved_to_the_new_generation_in_place_is_not_offered_old_locations(lab: Lab, reference: str, tmp_path: Path) -> None:
    """d-0 runs the old release; the file then points d-0 at an engine of the new release, in the new generation (a
    cohort upgraded in place). The conversation whose D was d-0 is computed on the new generation: no P is ever sent
    the old engine's location."""
    (p_old, d_old), (p_new, d_new) = engines("0.31.0"), engines("0.32.0")
    _, d_upgraded = engines("0.32.0")
    names = (("p-old", p_old), ("d-old", d_old), ("p-new", p_new), ("d-new", d_new), ("d-upgraded", d_upgraded))
    urls = {name: lab.engine(e) for name, e in names}
    path = tmp_path / "router.yaml"
    prefill = {"p-0": (urls["p-old"], OLD.id), "p-1": (urls["p-new"], NEW.id)}
    first = write(path, config_doc(prefill, {"d-0": (urls["d-old"], OLD.id), "d-1": (urls["d-new"], NEW.id)}))
    url = lab.start_router(path)
    wait_config(url, first, {OLD.id: {"prefill": 1, "decode": 1}, NEW.id: {"prefill": 1, "decode": 1}})
    # An old-generation conversation (stored on d-0) — started on the old generation by taking the new one away a moment.
    for name in ("p-1", "d-1"):
        assert httpx.post(f"{url}/admin/upstreams/{name}/drain", timeout=10).status_code == 200
    talk = Conversation(url, reference, "moved")
    talk.turn()
    talk.turn()
    for name in ("p-1", "d-1"):
        assert httpx.post(f"{url}/admin/upstreams/{name}/undrain", timeout=10).status_code == 200
    assert (
        len(p_old.requests) == 2
        and len(d_old.requests) == 2
        and p_old.requests[1][contracts.KV_TRANSFER_PARAMS].get(contracts.REMOTE_ENGINE_ID) == d_old.engine_id
    )  # the second turn was offered d-0's location: there is one to refuse after the move

    second = write(path, config_doc(prefill, {"d-0": (urls["d-upgraded"], NEW.id), "d-1": (urls["d-new"], NEW.id)}))
    view = wait_config(url, second, {OLD.id: {"prefill": 1, "decode": 0}, NEW.id: {"prefill": 1, "decode": 2}})
    assert view["pending_restart"] == []
    listed = {u["name"]: u for u in httpx.get(url + "/admin/upstreams", timeout=10).json()["upstreams"]}
    assert listed["d-0"]["url"] == urls["d-upgraded"] and listed["d-0"]["generation"] == NEW.id
    talk.turn()
    talk.turn(stream=True)  # and from there on, continued within the new generation
    assert len(p_old.requests) == 2 and len(d_old.requests) == 2
    assert len(p_new.requests) == 2
    assert assert_locations_within_generation({OLD.id: [p_old, d_old], NEW.id: [p_new, d_new, d_upgraded]}) > 0
    assert d_old.engine_id not in {(b.get(contracts.KV_TRANSFER_PARAMS) or {}).get(contracts.REMOTE_ENGINE_ID) for b in p_new.requests}
    assert metric(url, "bpdkv_router_reuse_total", outcome="refused") >= 1


def test_a_location_stored_under_another_generation_is_refused_whenever_it_was_stored() -> None:
    """Workers reload about a second apart: one that has not reloaded yet may store a location on the old engine after
    this one moved the member. The entry's generation, not only its time, refuses it."""
    now = [1000.0]
    pool = Pool("decode", build_members((UpstreamSpec("d-0", "http://old", OLD.id),), "decode", (OLD, NEW)))
    member = pool.members[0]
    member.identity_verified = True
    config = RouterConfig(prefill=(UpstreamSpec("p-0", "http://p", OLD.id),), decode=(UpstreamSpec("d-0", "http://old", OLD.id),))
    store = sessions.MemoryStore(clock=lambda: now[0])
    policy = ReusePolicy(config, store, pool, RouterMetrics(), lambda: now[0])
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "first"}]
    params = {contracts.DO_REMOTE_DECODE: True, contracts.REMOTE_BLOCK_IDS: [1, 2], contracts.REMOTE_ENGINE_ID: "engine-old"}

    async def store_then_lookup(move: bool) -> sessions.Reuse:
        body = {"model": "m", "messages": messages}
        ident = sessions.identify(sessions.CHAT, "tenant", body, None, "auto")
        assert ident is not None
        reply = Reply(content=["an answer"], finish_reason="stop", params=dict(params, **{contracts.REMOTE_REQUEST_ID: str(now[0])}))
        await policy.after_decode(ident, body, reply, member)  # stored while d-0 was of the old generation
        if move:  # this worker's reload happened a moment *before* the other worker stored that entry
            check = pool.reconcile((UpstreamSpec("d-0", "http://new", NEW.id),), (OLD, NEW), at=now[0] - 0.5)
            assert check == [member] and member.restarted_at < now[0]
            member.healthy = member.identity_verified = True  # its check found the new engine
        now[0] += 1
        nxt = {"model": "m", "messages": [*messages, reply.message(), {"role": "user", "content": "next"}]}
        ident2 = sessions.identify(sessions.CHAT, "tenant", nxt, None, "auto")
        assert ident2 is not None
        _, outcome = await policy.lookup(ident2)
        return outcome

    assert asyncio.run(store_then_lookup(move=False)) is sessions.Reuse.HIT
    messages[1] = {"role": "user", "content": "another conversation"}
    assert asyncio.run(store_then_lookup(move=True)) is sessions.Reuse.REFUSED


def test_a_bad_file_changes_nothing_and_says_why(lab: Lab, reference: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p, d = engines("0.32.0")
    urls = {"p": lab.engine(p), "d": lab.engine(d)}
    path = tmp_path / "router.yaml"
    good = config_doc({"p-0": (urls["p"], NEW.id)}, {"d-0": (urls["d"], NEW.id)})
    first = write(path, good)
    url = lab.start_router(path)
    wait_config(url, first, {NEW.id: {"prefill": 1, "decode": 1}})
    caplog.set_level(logging.INFO, logger="bpdkv.router")
    # A generation no upstream may name, then a file that is not YAML: each logged, neither applied.
    broken = config_doc({"p-0": (urls["p"], NEW.id)}, {"d-0": (urls["d"], "gen-unknown")})
    write(path, broken)
    deadline = time.monotonic() + WAIT_S
    while "not applied" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.1)
    (line,) = [r.getMessage() for r in caplog.records if "not applied" in r.getMessage()]
    assert str(path) in line and "gen-unknown" in line and "the running config stays" in line
    path.write_text("prefill: [unclosed\n")
    deadline = time.monotonic() + WAIT_S
    while "invalid YAML" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "invalid YAML" in caplog.text
    time.sleep(2.5)  # more polls of the same bad file: logged once
    assert sum("invalid YAML" in r.getMessage() for r in caplog.records) == 1
    view = admin_config(url)
    assert view["digest"] == first and view["serving"] == {OLD.id: {"prefill": 0, "decode": 0}, NEW.id: {"prefill": 1, "decode": 1}}
    Conversation(url, reference, "still").turn()


def test_a_change_of_another_key_is_logged_and_not_applied(
    lab: Lab, reference: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    p, d = engines("0.32.0")
    _, d2 = engines("0.32.0")
    urls = {"p": lab.engine(p), "d": lab.engine(d), "d2": lab.engine(d2)}
    path = tmp_path / "router.yaml"
    first = write(path, config_doc({"p-0": (urls["p"], NEW.id)}, {"d-0": (urls["d"], NEW.id)}))
    url = lab.start_router(path)
    wait_config(url, first, {NEW.id: {"prefill": 1, "decode": 1}})
    assert lab.router is not None
    caplog.set_level(logging.INFO, logger="bpdkv.router")
    # session_ttl and max_body_bytes change beside a new D: the D is applied, the two keys are not.
    changed = config_doc(
        {"p-0": (urls["p"], NEW.id)}, {"d-0": (urls["d"], NEW.id), "d-1": (urls["d2"], NEW.id)}, session_ttl=5, max_body_bytes=1024
    )
    second = write(path, changed)
    view = wait_config(url, second, {NEW.id: {"prefill": 1, "decode": 2}})
    assert view["pending_restart"] == ["session_ttl", "max_body_bytes"]
    lines = [r.getMessage() for r in caplog.records if "needs a restart" in r.getMessage()]
    assert lines == ["config change of session_ttl, max_body_bytes needs a restart; kept the running config for them"]
    assert lab.router.config.session_ttl != 5 and lab.router.config.max_body_bytes != 1024
    big = [{"role": "user", "content": "long " * 1000}]
    assert chat(url, big)[0] == chat(reference, big)[0]  # a body far above 1024 bytes is served: the running limit stays
    assert [m.name for m in lab.router.decode.members] == ["d-0", "d-1"]


def test_a_removed_member_finishes_its_stream(lab: Lab, reference: str, tmp_path: Path) -> None:
    """A D removed from the file while it streams: the stream ends complete, and no new request goes there."""
    p, d_slow = engines("0.32.0")
    # A gate, not a race: D streams one token every 2 s (40 tokens: 80 s) until the test has seen the reload land,
    # then at full speed. On a busy machine a reload can take seconds; the stream must still be running when it lands.
    d_slow.settings.token_interval = 2.0
    _, d_other = engines("0.32.0")
    urls = {"p": lab.engine(p), "slow": lab.engine(d_slow), "other": lab.engine(d_other)}
    path = tmp_path / "router.yaml"
    first = write(path, config_doc({"p-0": (urls["p"], NEW.id)}, {"d-slow": (urls["slow"], NEW.id)}))
    url = lab.start_router(path)
    wait_config(url, first, {NEW.id: {"prefill": 1, "decode": 1}})
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "a long answer please"}]
    got: list[str] = []
    streaming = threading.Thread(target=lambda: got.append(chat(url, messages, stream=True)[0]))
    streaming.start()
    deadline = time.monotonic() + WAIT_S
    while not d_slow.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    second = write(path, config_doc({"p-0": (urls["p"], NEW.id)}, {"d-other": (urls["other"], NEW.id)}))
    wait_config(url, second, {NEW.id: {"prefill": 1, "decode": 1}})
    assert streaming.is_alive()  # the reload came while D streamed
    assert not got
    d_slow.settings.token_interval = 0.0  # open the gate: the rest of the stream flows
    streaming.join(WAIT_S)
    assert got == [chat(reference, messages)[0]]
    Conversation(url, reference, "after").turn()
    assert len(d_slow.requests) == 1 and len(d_other.requests) == 1


def test_every_worker_reloads_its_config(tmp_path: Path) -> None:
    """`bpdkv router` with two worker processes: each watches the file by itself; every worker that answers shows the
    new digest and uses the D the file added, and a drain taken after the reload reaches the new D on both."""
    from tests.router.test_router_workers import _start_router, _stop, _worker_pids

    p = VllmEmulator(EmulatorSettings(role="prefill", prefix_caching=False))
    ds = [VllmEmulator(EmulatorSettings(role="decode")) for _ in range(2)]
    group = ServerGroup([p.app, *(d.app for d in ds)])
    urls = group.start()
    proc, port, _ = _start_router(tmp_path, urls[:2], workers=2)
    try:
        url = f"http://127.0.0.1:{port}"
        workers = set(_worker_pids(proc))
        assert len(workers) == 2
        path = tmp_path / "router.yaml"
        doc = yaml.safe_load(path.read_text())
        first = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        doc["decode"].append({"name": "decode-1", "url": urls[2]})
        second = write(path, doc)
        assert second != first
        seen: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and {pid for pid, v in seen.items() if v["digest"] == second} != workers:
            view = admin_config(url)  # a new connection each time: the kernel spreads them over the workers
            seen[view["pid"]] = view
            time.sleep(0.05)
        assert {pid for pid, v in seen.items() if v["digest"] == second} == workers, seen
        assert all(v["serving"] == {"": {"prefill": 1, "decode": 2}} for v in seen.values())
        # The new D is drained through one worker: no worker sends it a request after the answer.
        assert httpx.post(f"{url}/admin/upstreams/decode-1/drain", timeout=10).status_code == 200
        for i in range(8):
            messages = [{"role": "system", "content": "s"}, {"role": "user", "content": f"question {i}"}]
            assert chat(url, messages)[0]
        assert not ds[1].requests and len(ds[0].requests) == 8
    finally:
        _stop(proc)
        group.stop()
