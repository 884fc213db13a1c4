"""Two worker processes of one `bpdkv router`, a real redis-server between them: what one worker learns or is told,
the other acts on — single-use D locations, sessions bound to their history and tenant, admin drains. Every request
on a new connection, so the kernel spreads them over both workers (each assert below would fail about half the time
if a worker kept its own state)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bpdkv.prometheus_text import metric_value
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator
from tests.router.helpers import SYSTEM, chat
from tests.router.test_router_workers import _start_router, _stop, _worker_pids

TRIES = 12  # new connections per check: all on one worker has probability 2**-11


@pytest.fixture
def fleet() -> Iterator[tuple[VllmEmulator, list[VllmEmulator], list[str]]]:
    p = VllmEmulator(EmulatorSettings(role="prefill", prefix_caching=False))
    ds = [VllmEmulator(EmulatorSettings(role="decode", token_interval=0.02)) for _ in range(2)]
    group = ServerGroup([p.app, *(d.app for d in ds)])
    urls = group.start()
    yield p, ds, urls
    group.stop()


def _metric(url: str, name: str, **labels: str) -> float:
    return metric_value(httpx.get(url + "/metrics", timeout=10).text, name, labels)


def _listing(url: str) -> dict[str, dict[str, Any]]:
    resp = httpx.get(url + "/admin/upstreams", timeout=10)
    assert resp.status_code == 200, resp.text
    return {u["name"]: u for u in resp.json()["upstreams"]}


def test_single_use_session_binding_and_tenants_across_workers(fleet: Any, tmp_path: Path) -> None:
    p, ds, urls = fleet
    proc, port, _ = _start_router(tmp_path, urls[:2], workers=2)
    try:
        url = f"http://127.0.0.1:{port}"
        assert len(_worker_pids(proc)) == 2
        history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first"}]
        text, _ = chat(url, history)
        nxt = [*history, {"role": "assistant", "content": text}, {"role": "user", "content": "second"}]
        # The same next turn from many clients at once, on both workers: D's location is taken exactly once.
        barrier = threading.Barrier(TRIES)
        answers: list[str] = []

        def send() -> None:
            barrier.wait()
            answers.append(chat(url, nxt)[0])

        threads = [threading.Thread(target=send) for _ in range(TRIES)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(answers) == TRIES and all(answers)
        assert _metric(url, "bpdkv_router_reuse_total", outcome="hit") == 1
        assert _metric(url, "bpdkv_router_reuse_total", outcome="miss") == 1 + TRIES - 1
        pulls = [r["kv_transfer_params"]["remote_block_ids"] is not None for r in p.requests]
        assert pulls.count(True) <= 1  # at most one P was handed D's blocks (the one hit)
        assert p.counters.get("emulator_wrong_kv_tokens", 0) == 0

        # An explicit session id stays bound to its history: another history naming it neither takes nor replaces it.
        sid = {"X-Session-Id": "conversation-A"}
        mine = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "my question"}]
        text, _ = chat(url, mine, headers=sid)
        mine += [{"role": "assistant", "content": text}, {"role": "user", "content": "my follow-up"}]
        for i in range(TRIES // 2):
            other = [{"role": "user", "content": f"unrelated {i}"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
            chat(url, other, headers=sid)
        assert _metric(url, "bpdkv_router_reuse_total", outcome="mismatch") == TRIES // 2
        assert _metric(url, "bpdkv_router_sessions_not_stored_total") == TRIES // 2
        # Another tenant (another API key) with the very same history and id: never this tenant's entry.
        chat(url, mine, headers={**sid, "Authorization": "Bearer someone-else"})
        hits = _metric(url, "bpdkv_router_reuse_total", outcome="hit")
        assert hits == 1
        chat(url, mine, headers=sid)
        assert _metric(url, "bpdkv_router_reuse_total", outcome="hit") == hits + 1
    finally:
        _stop(proc)


def test_drain_reaches_every_worker_and_counts_their_requests(fleet: Any, tmp_path: Path) -> None:
    _, ds, urls = fleet
    proc, port, _ = _start_router(tmp_path, urls, workers=2)
    try:
        url = f"http://127.0.0.1:{port}"
        assert set(_listing(url)) == {"prefill-0", "decode-0", "decode-1"}
        done = threading.Event()

        def slow() -> None:  # one stream on decode-0 (the least loaded is the first), on one of the workers
            chat(url, [{"role": "user", "content": "slow one"}], stream=True, max_tokens=150, ignore_eos=True)
            done.set()

        threading.Thread(target=slow, daemon=True).start()
        deadline = time.monotonic() + 10
        while not ds[0].requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ds[0].requests
        drained = httpx.post(url + "/admin/upstreams/decode-0/drain", timeout=10).json()
        # Whichever worker took the call: the stream in flight on either worker counts.
        assert drained["state"] == "draining" and drained["in_flight"] == 1, drained
        for i in range(TRIES):
            listed = _listing(url)["decode-0"]
            assert (listed["state"], listed["in_flight"]) == ("draining", 1), (i, listed, done.is_set())
        before = len(ds[0].requests)
        for i in range(TRIES):
            chat(url, [{"role": "user", "content": f"new {i}"}])
        assert len(ds[0].requests) == before  # neither worker sent a new request to the drained D
        assert done.wait(15)
        deadline = time.monotonic() + 2
        while _listing(url)["decode-0"]["state"] != "drained" and time.monotonic() < deadline:
            time.sleep(0.02)
        for _ in range(TRIES):
            assert _listing(url)["decode-0"]["state"] == "drained"
        undrained = httpx.post(url + "/admin/upstreams/decode-0/undrain", timeout=10).json()
        assert undrained["state"] == "serving", undrained
        for _ in range(TRIES):
            assert _listing(url)["decode-0"]["state"] == "serving"
        for i in range(TRIES):
            chat(url, [{"role": "user", "content": f"after {i}"}])
        assert len(ds[0].requests) > before  # it serves again (every worker's listing above says so for that worker)
    finally:
        _stop(proc)
