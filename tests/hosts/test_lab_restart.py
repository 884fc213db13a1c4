"""The test hosts restart a unit whose main process died, as systemd would (bpdkv/lab/supervisor.py in each host's
init): Restart=, RestartSec=, the start limit; a stop is not undone. Real hosts, real service manager, no vLLM."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from bpdkv.lab.hosts import TestHost, TestHosts

pytestmark = pytest.mark.hosts
LOG = "/var/log/journal/bpdkv-lab-supervisor.log"


def until(what: str, check: Callable[[], bool], limit: float = 60.0) -> None:
    """A gate: wait for a condition the test states (bounded only so that a broken supervisor fails, never paced)."""
    deadline = time.monotonic() + limit
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"never happened: {what}")
        time.sleep(0.2)


def unit(lab: TestHosts, host: TestHost, name: str, body: str) -> None:
    (host.fs / "etc/systemd/system" / name).write_text(f"[Unit]\nDescription=lab restart test\n{body}")
    assert lab.exec(host, f"systemctl daemon-reload >/dev/null 2>&1; systemctl start {name}").returncode == 0


def log(lab: TestHosts, host: TestHost) -> str:
    return lab.exec(host, f"cat {LOG} 2>/dev/null").stdout


def test_a_killed_unit_comes_back_and_a_stopped_one_does_not(hosts: TestHosts) -> None:
    host = hosts.hosts[0]
    unit(
        hosts,
        host,
        "lab-sleeper.service",
        "[Service]\nExecStart=/bin/sh -c 'sleep 1000 & exec sleep 1001'\nRestart=on-failure\nRestartSec=1\n",
    )
    until("the unit runs", lambda: hosts.main_pid(host, "lab-sleeper.service") is not None)
    first = hosts.main_pid(host, "lab-sleeper.service")
    assert first is not None
    until("its child is remembered", lambda: "sleep 1000" in hosts.exec(host, "pgrep -af 'sleep 100[0]'").stdout)
    killed = hosts.kill_unit(host, "lab-sleeper.service")
    assert killed == first
    until("the unit restarted", lambda: hosts.main_pid(host, "lab-sleeper.service") not in (None, first))
    until("the supervisor said so", lambda: "lab-sleeper.service: restarted (restart 1)" in log(hosts, host))
    assert f"lab-sleeper.service: main process {first} killed by SIGKILL; restarting in 1 s (restart 1)" in log(hosts, host)
    assert "lab-sleeper.service: restarted (restart 1)" in log(hosts, host)
    assert hosts.exec(host, "systemctl is-active lab-sleeper.service").stdout.strip() == "active"

    # A stop is clean (SIGTERM): on-failure does not restart it.
    assert hosts.exec(host, "systemctl stop lab-sleeper.service").returncode == 0
    assert hosts.exec(host, "systemctl is-active lab-sleeper.service").stdout.strip() == "inactive"
    assert log(hosts, host).count("restarting in") == 1


def test_the_start_limit_leaves_a_crashing_unit_failed(hosts: TestHosts) -> None:
    host = hosts.hosts[2]
    unit(
        hosts,
        host,
        "lab-crasher.service",
        "StartLimitIntervalSec=120\nStartLimitBurst=2\n[Service]\nExecStart=/bin/sh -c 'sleep 2; exit 3'\nRestart=on-failure\nRestartSec=100ms\n",
    )
    until("the start limit refused a restart", lambda: "start request repeated too quickly" in log(hosts, host), 120)
    text = log(hosts, host)
    assert text.count("lab-crasher.service: restarted") == 2, text
    assert "exited with status 3" in text
    until("the unit is failed", lambda: hosts.exec(host, "systemctl is-active lab-crasher.service").stdout.strip() == "failed")
