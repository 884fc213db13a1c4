"""The drain race of a roll (issue 39): a turn is committed to its conversation's old generation when it reaches P; if
that generation's last D is drained, ejected or dies while P computes — or its last P is gone before the turn reaches
it — the turn is computed again on the newest generation that serves: 200 with the reference answer, never a 5xx,
and no location of the old generation offered to the new one.

Deterministic: the old P is held at a gate (it has the turn, it has not answered) while the test drains, ejects or
kills the old D; the router's health loop checks once at start, so only the turn itself finds what changed."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bpdkv import contracts
from bpdkv.router.app import Router
from bpdkv.router.config import HealthSettings
from bpdkv.testing.vllm_emulator import ServerGroup
from tests.router.test_router_generations import NEW, OLD, Conversation, engines, metric, router_config, wait_for

GATE_S = 15.0


class Gate:
    """An engine's ASGI app, held once (when armed) at its next completion request until released (bounded)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.armed = False
        self.arrived = threading.Event()
        self.release = threading.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.armed and scope["type"] == "http" and scope["path"].endswith("/completions"):
            self.armed = False
            self.arrived.set()
            deadline = time.monotonic() + GATE_S
            while not self.release.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        await self.app(scope, receive, send)


class TwoGenerations:
    """Old and new P and D, each its own server (one can be stopped alone); a router whose health loop checked once."""

    def __init__(self) -> None:
        (self.p_old, self.d_old), (self.p_new, self.d_new) = engines("0.31.0"), engines("0.32.0")
        self.gate = Gate(self.p_old.app)
        self.groups = {
            "p-old": ServerGroup([self.gate]),
            "d-old": ServerGroup([self.d_old.app]),
            "p-new": ServerGroup([self.p_new.app]),
            "d-new": ServerGroup([self.d_new.app]),
        }
        urls = {name: group.start()[0] for name, group in self.groups.items()}
        config = dataclasses.replace(router_config(urls), health=HealthSettings(interval=3600, failures_to_eject=3, backoff_max=60))
        self.router = Router(config)
        self.router_group = ServerGroup([self.router.app])
        (self.url,) = self.router_group.start()
        wait_for(self.url, {name: "serving" for name in urls})

    def old_conversation(self, reference: str) -> Conversation:
        """A conversation whose first turn is stored on the old D (the new generation drained for that turn)."""
        for name in ("p-new", "d-new"):
            assert httpx.post(f"{self.url}/admin/upstreams/{name}/drain", timeout=10).status_code == 200
        talk = Conversation(self.url, reference, "old")
        talk.turn()
        for name in ("p-new", "d-new"):
            assert httpx.post(f"{self.url}/admin/upstreams/{name}/undrain", timeout=10).status_code == 200
        assert len(self.d_old.requests) == 1 and not self.p_new.requests
        return talk

    def stop(self) -> None:
        self.gate.release.set()
        self.router_group.stop()
        for group in self.groups.values():
            group.stop()


@pytest.fixture
def gens() -> Iterator[TwoGenerations]:
    made = TwoGenerations()
    yield made
    made.stop()


def no_location_across(gens: TwoGenerations) -> None:
    """No engine was ever sent a location on an engine of the other generation."""
    ids = {OLD.id: {gens.p_old.engine_id, gens.d_old.engine_id}, NEW.id: {gens.p_new.engine_id, gens.d_new.engine_id}}
    for generation, pair in ((OLD.id, (gens.p_old, gens.d_old)), (NEW.id, (gens.p_new, gens.d_new))):
        for engine in pair:
            for body in engine.requests:
                other = (body.get(contracts.KV_TRANSFER_PARAMS) or {}).get(contracts.REMOTE_ENGINE_ID)
                assert other is None or other in ids[generation], f"{engine.settings.role} of {generation} was sent engine {other}"
            assert engine.counters.get("emulator_cross_generation_reads", 0) == 0


def statuses(url: str) -> list[str]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return [line for line in text.splitlines() if line.startswith("bpdkv_router_requests_total{")]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("loss", ["drain", "eject", "kill"])
def test_the_old_generation_loses_its_last_d_while_p_computes(gens: TwoGenerations, reference: str, loss: str, stream: bool) -> None:
    talk = gens.old_conversation(reference)
    gens.gate.armed = True
    failure: list[BaseException] = []

    def second_turn() -> None:
        try:
            talk.turn(stream=stream)  # asserts 200 and the reference answer
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            failure.append(exc)

    turn = threading.Thread(target=second_turn)
    turn.start()
    assert gens.gate.arrived.wait(GATE_S)  # the turn is committed to the old generation: its P has it
    d_old = gens.router.decode.member("d-old")
    assert d_old is not None
    if loss == "drain":
        assert httpx.post(f"{gens.url}/admin/upstreams/d-old/drain", timeout=10).status_code == 200
    elif loss == "eject":

        async def eject() -> None:  # as failed requests of other turns do
            for _ in range(gens.router.config.health.failures_to_eject):
                gens.router.decode.failure(d_old, "ConnectionRefused")

        gens.router_group.call(eject())
    else:
        gens.groups["d-old"].stop()  # the D process is gone; the router has not checked since
    gens.gate.release.set()
    turn.join(GATE_S * 2)
    assert not turn.is_alive() and not failure, failure
    assert statuses(gens.url) == ['bpdkv_router_requests_total{route="/v1/chat/completions",status="200"} 2.0']
    assert len(gens.p_old.requests) == 2  # the old P computed the turn (with the old D's location) ...
    assert len(gens.d_old.requests) == 1  # ... but no old D took it: the new generation computed it again
    assert len(gens.p_new.requests) == 1 and len(gens.d_new.requests) == 1
    assert (gens.p_new.requests[0].get(contracts.KV_TRANSFER_PARAMS) or {}).get(contracts.REMOTE_ENGINE_ID) is None
    assert metric(gens.url, "bpdkv_router_generation_turns_total", generation=NEW.id, kind="rescued") == 1
    assert metric(gens.url, "bpdkv_router_reuse_misses_total", cause="other_generation") == 1
    talk.turn()  # and the conversation goes on within the new generation, reusing its new D's blocks
    assert metric(gens.url, "bpdkv_router_generation_turns_total", generation=NEW.id, kind="continued") == 1
    no_location_across(gens)


def test_the_old_generation_lost_its_last_p_before_the_turn_reached_it(gens: TwoGenerations, reference: str) -> None:
    talk = gens.old_conversation(reference)
    gens.groups["p-old"].stop()  # the router has not checked since: the turn is committed to the old generation
    talk.turn()
    assert statuses(gens.url) == ['bpdkv_router_requests_total{route="/v1/chat/completions",status="200"} 2.0']
    assert len(gens.p_old.requests) == 1 and len(gens.d_old.requests) == 1
    assert len(gens.p_new.requests) == 1 and len(gens.d_new.requests) == 1
    assert (gens.p_new.requests[0].get(contracts.KV_TRANSFER_PARAMS) or {}).get(contracts.REMOTE_ENGINE_ID) is None
    assert metric(gens.url, "bpdkv_router_generation_turns_total", generation=OLD.id, kind="continued") == 1
    assert metric(gens.url, "bpdkv_router_generation_turns_total", generation=NEW.id, kind="rescued") == 1
    no_location_across(gens)


def test_without_another_generation_the_failure_is_the_clients_as_before(gens: TwoGenerations, reference: str) -> None:
    """Where no other generation serves, nothing is rescued: every D failing is the 502 it always was."""
    talk = gens.old_conversation(reference)
    for name in ("p-new", "d-new"):
        assert httpx.post(f"{gens.url}/admin/upstreams/{name}/drain", timeout=10).status_code == 200
    gens.groups["d-old"].stop()
    talk.messages.append({"role": "user", "content": "one more"})
    resp = httpx.post(gens.url + "/v1/chat/completions", json={"model": "emulated", "messages": talk.messages, "max_tokens": 5}, timeout=30)
    assert resp.status_code == 502 and "no decode upstream succeeded" in resp.json()["error"]["message"]
    assert not gens.p_new.requests
