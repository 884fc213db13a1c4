"""`bpdkv_router_generation_serving` is current without traffic: the health loop sets it after every pass, so after a
quiet spell it follows a D going unhealthy, a drain and a recovery with no turn and no scrape in between."""

from __future__ import annotations

import time

import httpx

from bpdkv.router.app import Router
from bpdkv.testing.vllm_emulator import ServerGroup
from tests.router.test_router_generations import NEW, OLD, engines, metric, router_config

WAIT_S = 15.0


def test_the_serving_gauge_follows_health_and_drains_without_turns() -> None:
    (p_old, d_old), (p_new, d_new) = engines("0.31.0"), engines("0.32.0")
    group = ServerGroup([p_old.app, d_old.app, p_new.app, d_new.app])
    urls = dict(zip(("p-old", "d-old", "p-new", "d-new"), group.start(), strict=True))
    router = Router(router_config(urls))  # health checks every 0.5 s
    router_group = ServerGroup([router.app])
    (url,) = router_group.start()

    def serving(generation: str) -> float | None:
        """The gauge as the router holds it (read from its registry: no scrape, which would set it too)."""
        return router.metrics.registry.get_sample_value("bpdkv_router_generation_serving", {"generation": generation})

    def until(generation: str, value: float) -> None:
        deadline = time.monotonic() + WAIT_S
        while serving(generation) != value and time.monotonic() < deadline:
            time.sleep(0.05)
        assert serving(generation) == value, f"{generation}: {serving(generation)}, wanted {value}"

    try:
        until(OLD.id, 1)  # set by the health loop: no turn has passed
        until(NEW.id, 1)
        d_new.healthy = False  # the new D fails its checks: the new generation no longer serves
        until(NEW.id, 0)
        assert serving(OLD.id) == 1
        d_new.healthy = True
        until(NEW.id, 1)
        assert httpx.post(f"{url}/admin/upstreams/d-old/drain", timeout=10).status_code == 200
        until(OLD.id, 0)
        assert not any(e.requests for e in (p_old, d_old, p_new, d_new))  # all of it without a single turn
        assert metric(url, "bpdkv_router_generation_serving", generation=OLD.id) == 0  # and a scrape says the same
        assert metric(url, "bpdkv_router_generation_serving", generation=NEW.id) == 1
    finally:
        router_group.stop()
        group.stop()
