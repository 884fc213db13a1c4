"""Router test fleet: emulated P and D (test doubles) and real routers, all on loopback, bounded lifetimes."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bpdkv.bench.runner import metric_value
from bpdkv.lab.ports import free_port
from bpdkv.router.app import Router
from bpdkv.router.config import HealthSettings, PathSettings, RouterConfig, Timeouts, UpstreamSpec
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator


class Fleet:
    def __init__(self, prefill: list[VllmEmulator], decode: list[VllmEmulator], routers: list[Router], group: ServerGroup) -> None:
        self.prefill = prefill
        self.decode = decode
        self.routers = routers
        self.group = group
        urls = group.urls
        n = len(prefill) + len(decode)
        self.emulator_urls = urls[:n]
        self.router_urls = urls[n:]
        self.url = self.router_urls[0] if self.router_urls else ""

    def metric(self, name: str, router: int = 0, **labels: str) -> float:
        return metric_value(httpx.get(self.router_urls[router] + "/metrics", timeout=10).text, name, labels)


def make_fleet(
    n_prefill: int = 1,
    n_decode: int = 1,
    n_routers: int = 1,
    p_settings: dict[str, Any] | None = None,
    d_settings: dict[str, Any] | None = None,
    router_changes: dict[str, Any] | None = None,
    store_factory: Any = None,
    clock: Any = None,
) -> Fleet:
    prefill = [VllmEmulator(EmulatorSettings(role="prefill", **(p_settings or {}))) for _ in range(n_prefill)]
    decode = [VllmEmulator(EmulatorSettings(role="decode", **(d_settings or {}))) for _ in range(n_decode)]
    emu_group = ServerGroup([e.app for e in prefill + decode])
    urls = emu_group.start()
    base = RouterConfig(
        prefill=tuple(UpstreamSpec(f"prefill-{i}", u) for i, u in enumerate(urls[:n_prefill])),
        decode=tuple(UpstreamSpec(f"decode-{i}", u) for i, u in enumerate(urls[n_prefill:])),
        timeouts=Timeouts(connect=2, prefill=10, decode_first_byte=10, decode_idle=10),
        health=HealthSettings(interval=0, failures_to_eject=3, backoff_max=5),
        # The pull path, which most router tests are about; test_router_paths turns decode_local on (the product default).
        paths=PathSettings(local_max_tokens=0),
    )
    config = dataclasses.replace(base, **(router_changes or {}))
    kwargs: dict[str, Any] = {}
    if clock is not None:
        kwargs["clock"] = clock
    routers = [Router(config, store=store_factory() if store_factory else None, **kwargs) for _ in range(n_routers)]
    router_group = ServerGroup([r.app for r in routers])
    router_group.start()
    fleet = Fleet(prefill, decode, routers, emu_group)
    fleet.router_urls = router_group.urls
    fleet.url = fleet.router_urls[0]
    fleet._groups = [router_group, emu_group]  # type: ignore[attr-defined]
    return fleet


def stop_fleet(fleet: Fleet) -> None:
    for group in fleet._groups:  # type: ignore[attr-defined]
        group.stop()


@pytest.fixture
def fleet_factory() -> Iterator[Any]:
    made: list[Fleet] = []

    def factory(**kwargs: Any) -> Fleet:
        fleet = make_fleet(**kwargs)
        made.append(fleet)
        return fleet

    yield factory
    for fleet in made:
        stop_fleet(fleet)


@pytest.fixture
def reference() -> Iterator[str]:
    """A plain emulated server (no P/D): what a single vLLM would answer."""
    emu = VllmEmulator(EmulatorSettings(role="both"))
    group = ServerGroup([emu.app])
    (url,) = group.start()
    yield url
    group.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A real redis-server on loopback, started and ended by the test (by PID)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server missing: apt-get install -y redis-server (make test installs it)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            time.sleep(0.05)
    info = {"url": f"redis://127.0.0.1:{port}/0", "proc": proc, "port": port}
    yield info
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


os.environ.pop("BPDKV_BACKEND_API_KEY", None)
