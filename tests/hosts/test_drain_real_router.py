"""A rolling apply drains through the real router's admin API (its own key) on the router host: the instance goes
drained → restarted → serving, and a client loop through the router sees no failed request meanwhile."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.hosts.conftest import bpdkv, topology_doc, write_topology

pytestmark = pytest.mark.hosts

ROUTER = "http://10.213.0.13:8000"


def call(path: str, body: dict[str, Any] | None = None, key: str | None = None, timeout: float = 10) -> tuple[int, Any]:
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(ROUTER + path, data=data, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, str(exc)


def test_rolling_apply_drains_through_the_real_router_and_no_request_fails(hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    real_cli = Path(sys.executable).parent / "bpdkv"
    if not real_cli.exists():
        pytest.skip(f"no bpdkv CLI beside {sys.executable} to run the real router on the router host")
    # The router host runs the real `bpdkv router` (this checkout's); P and D stay fake_vllm.py servers.
    router_cli = hosts.hosts[2].fs / "opt/bpdkv/venv/bin/bpdkv"
    router_cli.write_text(f'#!/bin/sh\nexec {real_cli} "$@"\n')
    router_cli.chmod(0o755)
    (tmp_path / "admin.key").write_text("admin-key-for-hosts-test\n")
    doc = topology_doc(hosts)
    doc["vllm"]["env"] = {"FAKE_VERSION": "v1", "FAKE_DELAY": "0.05"}
    doc["router"] = {"admin_key": {"secret": {"file": "admin.key"}}}
    doc["nodes"][0]["instances"].append({"role": "decode", "port": 8201})  # a second D serves while the first restarts
    topo = write_topology(tmp_path / "t.yaml", doc)
    first = bpdkv("apply", str(topo), "-y")
    assert first.returncode == 0, first.stdout + first.stderr
    key = "admin-key-for-hosts-test"
    assert call("/admin/upstreams")[0] == 401  # the admin API wants its own key
    status, listing = call("/admin/upstreams", key=key)
    assert status == 200, listing
    target = next(u["name"] for u in listing["upstreams"] if u["url"] == "http://10.213.0.12:8200")
    assert {u["state"] for u in listing["upstreams"]} == {"serving"}
    model = call("/v1/models")[1]["data"][0]["id"]

    doc["nodes"][1]["instances"][0]["env"] = {"FAKE_VERSION": "v2"}  # only host2's D changes
    write_topology(topo, doc)
    stop = threading.Event()
    answers: list[tuple[int, str]] = []
    states: list[str] = []

    def clients() -> None:
        deadline = time.monotonic() + 90
        while not stop.is_set() and time.monotonic() < deadline:
            code, data = call("/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 2})
            answers.append((code, data["choices"][0]["text"] if code == 200 else str(data)[:200]))

    def watch() -> None:
        deadline = time.monotonic() + 90
        while not stop.is_set() and time.monotonic() < deadline:
            code, data = call("/admin/upstreams", key=key, timeout=5)
            if code == 200:
                state = next(u["state"] for u in data["upstreams"] if u["name"] == target)
                if not states or states[-1] != state:
                    states.append(state)
            time.sleep(0.05)

    threads = [threading.Thread(target=clients), threading.Thread(target=clients), threading.Thread(target=watch)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        rolled = bpdkv("apply", str(topo), "-y")
        time.sleep(1.5)  # the client loop goes on after the undrain: the restarted D takes traffic again
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert rolled.returncode == 0, rolled.stdout + rolled.stderr
    assert f"drained {target}" in rolled.stdout and f"undrained {target}" in rolled.stdout
    failed = [a for a in answers if a[0] != 200]
    assert len(answers) >= 20 and not failed, (len(answers), failed[:5])
    assert "v2" in {text for _, text in answers}  # the restarted D served again before the loop ended
    # the router's own view: serving → draining/drained (while it restarts) → serving again
    assert states[0] == "serving" and states[-1] == "serving" and "drained" in states, states
    assert states.index("drained") < len(states) - 1
    journal = (hosts.hosts[2].fs / "var/log/journal/bpdkv-router-0.service.log").read_text()
    assert f"admin: drain {target}" in journal and f"admin: undrain {target}" in journal
    assert bpdkv("plan", str(topo)).returncode == 0 and bpdkv("status", str(topo)).returncode == 0
