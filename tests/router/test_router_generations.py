"""Two generations of P and D behind one real router (emulated engines of vLLM 0.31.0 and 0.32.0).

Conversations started on the old generation continue there while it serves, new ones go to the new generation, and
after the old one is drained and stopped its conversations are computed on the new one with no error. Every request
the engines logged is checked: no P was ever offered a D location of another generation, no D pulled from a P of
another generation (and the engines, which fail a cross-release pull as NIXL's handshake does, counted none)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from bpdkv import contracts
from bpdkv.bench.runner import metric_value
from bpdkv.router.app import Router
from bpdkv.router.config import GenerationSpec, HealthSettings, PathSettings, RouterConfig, Timeouts, UpstreamSpec
from bpdkv.router.upstream_http import UpstreamClient
from bpdkv.router.upstreams import build_members, check_identity
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator
from tests.router.helpers import SYSTEM, chat

OLD, NEW = GenerationSpec("gen-old", "0.31.0", "tiny-model"), GenerationSpec("gen-new", "0.32.0", "tiny-model")


def engines(version: str) -> tuple[VllmEmulator, VllmEmulator]:
    # P without its own prefix cache nor a cost model: every continued turn it serves reads D's blocks (a hit)
    common: dict[str, Any] = {"vllm_version": version, "model_root": "tiny-model", "prefix_caching": False}
    return VllmEmulator(EmulatorSettings(role="prefill", **common)), VllmEmulator(EmulatorSettings(role="decode", **common))


def wait_for(url: str, want: dict[str, str], timeout: float = 30.0) -> None:
    """Until the router's admin view gives each named upstream the wanted state."""
    deadline = time.monotonic() + timeout
    states: dict[str, Any] = {}
    while time.monotonic() < deadline:
        states = {u["name"]: u["state"] for u in httpx.get(url + "/admin/upstreams", timeout=10).json()["upstreams"]}
        if all(states.get(k) == v for k, v in want.items()):
            return
        time.sleep(0.1)
    raise AssertionError(f"router upstreams {states}, wanted {want}")


def router_config(urls: dict[str, str], old_decode_label: str = OLD.id) -> RouterConfig:
    return RouterConfig(
        prefill=(UpstreamSpec("p-old", urls["p-old"], OLD.id), UpstreamSpec("p-new", urls["p-new"], NEW.id)),
        decode=(UpstreamSpec("d-old", urls["d-old"], old_decode_label), UpstreamSpec("d-new", urls["d-new"], NEW.id)),
        generations=(OLD, NEW),
        timeouts=Timeouts(connect=2, prefill=10, decode_first_byte=10, decode_idle=10),
        health=HealthSettings(interval=0.5, failures_to_eject=3, backoff_max=2),
        paths=PathSettings(local_max_tokens=0),  # every turn through P: the pull path is what generations guard
    )


def assert_no_cross_generation(groups: dict[str, tuple[VllmEmulator, VllmEmulator]]) -> int:
    """From the engines' request logs: every engine id a request named is of the engine's own generation."""
    ids = {name: {p.engine_id, d.engine_id} for name, (p, d) in groups.items()}
    offered = 0
    for name, pair in groups.items():
        for engine in pair:
            for body in engine.requests:
                params = body.get(contracts.KV_TRANSFER_PARAMS) or {}
                other = params.get(contracts.REMOTE_ENGINE_ID)
                if other is None:
                    continue
                offered += 1
                assert other in ids[name], f"{engine.settings.role} of {name} was sent a location on engine {other}"
            assert engine.counters.get("emulator_cross_generation_reads", 0) == 0
    return offered


class Conversation:
    def __init__(self, url: str, reference: str, tag: str) -> None:
        self.url, self.reference, self.tag = url, reference, tag
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM + tag}]
        self.turns = 0

    def turn(self, stream: bool = False) -> None:
        self.messages.append({"role": "user", "content": f"{self.tag}: question {self.turns}, tell me more please."})
        text, data = chat(self.url, self.messages, stream=stream)
        assert text, f"{self.tag} turn {self.turns}: {getattr(data, 'status_code', '')} {getattr(data, 'text', data)}"
        expected, _ = chat(self.reference, self.messages)
        assert text == expected, f"{self.tag} turn {self.turns}: answer differs from a single server's"
        self.messages.append({"role": "assistant", "content": text})
        self.turns += 1


def metric(url: str, name: str, **labels: str) -> float:
    return metric_value(httpx.get(url + "/metrics", timeout=10).text, name, labels)


def test_old_conversations_stay_new_ones_move_and_none_fails_when_the_old_generation_goes(reference: str) -> None:
    groups = {"old": engines("0.31.0"), "new": engines("0.32.0")}
    old_group = ServerGroup(list(e.app for e in groups["old"]))
    new_group = ServerGroup(list(e.app for e in groups["new"]))
    p_old, d_old = old_group.start()
    p_new, d_new = new_group.start()
    for engine in groups["new"]:
        engine.healthy = False  # the new generation is not up yet
    router = Router(router_config({"p-old": p_old, "d-old": d_old, "p-new": p_new, "d-new": d_new}))
    router_group = ServerGroup([router.app])
    (url,) = router_group.start()
    try:
        wait_for(url, {"p-old": "serving", "d-old": "serving", "p-new": "unhealthy", "d-new": "unhealthy"})
        old_talks = [Conversation(url, reference, f"old{i}") for i in range(3)]
        for talk in old_talks:
            talk.turn()
            talk.turn(stream=True)
        assert len(groups["old"][0].requests) == 6 and not groups["new"][0].requests

        for engine in groups["new"]:
            engine.healthy = True  # the new generation comes up beside the old one
        wait_for(url, {"p-new": "serving", "d-new": "serving"})
        new_talks = [Conversation(url, reference, f"new{i}") for i in range(3)]
        for talk in new_talks:
            talk.turn()
        for talk in old_talks:
            talk.turn(stream=True)  # continues on the old generation: its D holds the history
        for talk in new_talks:
            talk.turn(stream=True)
        assert len(groups["old"][0].requests) == 9 and len(groups["new"][0].requests) == 6
        assert metric(url, "bpdkv_router_generation_turns_total", generation=OLD.id, kind="new") == 3
        assert metric(url, "bpdkv_router_generation_turns_total", generation=OLD.id, kind="continued") == 6  # turns 2, 3
        assert metric(url, "bpdkv_router_generation_turns_total", generation=NEW.id, kind="new") == 3
        assert metric(url, "bpdkv_router_generation_turns_total", generation=NEW.id, kind="continued") == 3
        reused = sum(metric(url, "bpdkv_router_reuse_total", outcome=o) for o in ("hit", "partial"))
        assert reused == 9  # every continued turn read its D's blocks, within its generation

        # The old generation goes: drained (as an upgrade does before stopping it), then its engines stop.
        for name in ("p-old", "d-old"):
            assert httpx.post(f"{url}/admin/upstreams/{name}/drain", timeout=10).status_code == 200
        old_group.stop()
        for talk in old_talks:
            talk.turn()  # computed on the new generation: D's old location is never offered to a new P
            talk.turn(stream=True)  # and from there on, reused there
        assert len(groups["old"][0].requests) == 9 and len(groups["new"][0].requests) == 12
        # Moved: its old D's location was found but that generation no longer serves; once the router saw the old D
        # down, the lookup refuses the location itself and the turn counts as new. Either way: computed on the new one.
        moved = metric(url, "bpdkv_router_generation_turns_total", generation=NEW.id, kind="moved")
        assert moved + metric(url, "bpdkv_router_generation_turns_total", generation=NEW.id, kind="new") == 3 + 3
        assert metric(url, "bpdkv_router_generation_turns_total", generation=NEW.id, kind="continued") == 3 + 3
        text = httpx.get(url + "/metrics", timeout=10).text
        statuses = [line for line in text.splitlines() if line.startswith("bpdkv_router_requests_total{")]
        assert statuses == ['bpdkv_router_requests_total{route="/v1/chat/completions",status="200"} 21.0'], statuses
        assert metric(url, "bpdkv_router_generation_serving", generation=OLD.id) == 0
        assert assert_no_cross_generation(groups) > 0
    finally:
        router_group.stop()
        new_group.stop()
        old_group.stop()


def test_an_engine_that_is_not_of_its_generation_is_never_paired(reference: str) -> None:
    """A mis-rendered config labels the 0.31.0 D as of the 0.32.0 generation: the router reads its /version and never
    uses it; the 0.32.0 pair serves every turn."""
    groups = {"old": engines("0.31.0"), "new": engines("0.32.0")}
    group = ServerGroup([e.app for pair in groups.values() for e in pair])
    p_old, d_old, p_new, d_new = group.start()
    router = Router(router_config({"p-old": p_old, "d-old": d_old, "p-new": p_new, "d-new": d_new}, old_decode_label=NEW.id))
    router_group = ServerGroup([router.app])
    (url,) = router_group.start()
    try:
        wait_for(url, {"d-old": "mismatched", "p-new": "serving", "d-new": "serving"})
        view = {u["name"]: u for u in httpx.get(url + "/admin/upstreams", timeout=10).json()["upstreams"]}
        assert view["d-old"]["problem"] == f"runs vLLM 0.31.0; its generation {NEW.id} is vLLM 0.32.0"
        talks = [Conversation(url, reference, f"c{i}") for i in range(4)]
        for _ in range(3):
            for talk in talks:
                talk.turn()
        assert not groups["old"][1].requests and not groups["old"][0].requests  # the old P has no D of its generation
        assert len(groups["new"][1].requests) == 12
        assert assert_no_cross_generation(groups) > 0
    finally:
        router_group.stop()
        group.stop()


def test_the_identity_check_reads_the_engine_release_and_model() -> None:
    """check_identity against real emulated engines: the right one is confirmed, another release or model is named."""
    right = VllmEmulator(EmulatorSettings(role="decode", vllm_version="0.32.0", model_root="tiny-model"))
    other_model = VllmEmulator(EmulatorSettings(role="decode", vllm_version="0.32.0+cpu", model_root="/models/other"))
    silent = VllmEmulator(EmulatorSettings(role="decode", vllm_version="0.32.0"))  # no root in /v1/models: cannot tell
    group = ServerGroup([right.app, other_model.app, silent.app])
    urls = group.start()
    try:
        specs = tuple(UpstreamSpec(name, u, NEW.id) for name, u in zip(("right", "other", "silent"), urls, strict=True))
        members = build_members(specs, "decode", (NEW,))

        async def check_all_three() -> None:
            client = UpstreamClient(2.0)
            try:
                for m in members:
                    await check_identity(m, client, 5.0)
            finally:
                await client.close()

        asyncio.run(check_all_three())
        by_name = {m.name: m for m in members}
        assert by_name["right"].identity_verified and by_name["right"].identity_problem is None
        assert by_name["other"].identity_problem == f"serves /models/other; its generation {NEW.id} is tiny-model"
        assert not by_name["other"].available(0.0)
        assert by_name["silent"].identity_verified  # taken at its config's word where the engine cannot tell
    finally:
        group.stop()
