"""The test hosts' restart supervisor's decisions (bpdkv/lab/supervisor.py), without a host: a unit file's restart
settings, systemd's restart table, the start limit. tests/hosts/test_lab_restart.py runs it inside real test hosts."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from benchmarks import upgrade
from bpdkv.lab.supervisor import RestartPolicy, StartLimit, Supervisor, parse_seconds
from bpdkv.render import render_topology
from tests.unit.test_cohort_plan import load


def test_time_spans_as_systemd_writes_them() -> None:
    assert parse_seconds("5", 0) == 5 and parse_seconds("5s", 0) == 5 and parse_seconds("100ms", 0) == 0.1
    assert parse_seconds("1min 30s", 0) == 90 and parse_seconds("infinity", 0) == float("inf")
    assert parse_seconds("soon", 7) == 7


def test_the_rendered_engine_unit_restarts_on_failure_after_5_s(tmp_path: Path) -> None:
    topology = load(tmp_path, "t", upgrade.topology(upgrade.NEW))
    unit = next(a for a in render_topology(topology) if a.path.endswith("bpdkv-decode-0.service"))
    policy = RestartPolicy.parse(unit.content)
    assert policy == RestartPolicy("on-failure", 5.0, 10.0, 5)  # start limit: systemd's defaults (none rendered)
    assert policy.wants_restart(None, signal.SIGKILL) and policy.wants_restart(1, None)
    assert not policy.wants_restart(0, None) and not policy.wants_restart(None, signal.SIGTERM)  # a stop is clean


def test_start_limit_settings_in_unit_or_service_section() -> None:
    text = "[Unit]\nStartLimitIntervalSec=60\nStartLimitBurst=2\n[Service]\nRestart=always\nRestartSec=100ms\n"
    assert RestartPolicy.parse(text) == RestartPolicy("always", 0.1, 60.0, 2)
    assert RestartPolicy.parse("[Service]\nRestart=sometimes\n").restart == "no"


def test_restart_table() -> None:
    def table(restart: str) -> list[bool]:
        p = RestartPolicy(restart)
        return [
            p.wants_restart(0, None),
            p.wants_restart(3, None),
            p.wants_restart(None, signal.SIGTERM),
            p.wants_restart(None, signal.SIGKILL),
        ]

    assert table("no") == [False, False, False, False]
    assert table("always") == [True, True, True, True]
    assert table("on-success") == [True, False, True, False]
    assert table("on-failure") == [False, True, False, True]
    assert table("on-abnormal") == [False, False, False, True]


def test_start_limit_counts_starts_within_the_interval() -> None:
    limit, policy = StartLimit(), RestartPolicy("always", 0.1, 10.0, 2)
    assert limit.allow("u", policy, 0.0) and limit.allow("u", policy, 1.0)
    assert not limit.allow("u", policy, 2.0)
    assert limit.allow("u", policy, 11.5)  # the first start left the window
    assert limit.allow("v", policy, 2.0)  # per unit


def test_a_reaped_main_process_is_found_by_its_status_file_and_a_clean_end_is_not_restarted(tmp_path: Path) -> None:
    units, run = tmp_path / "units", tmp_path / "run"
    units.mkdir()
    run.mkdir()
    (units / "a.service").write_text("[Service]\nExecStart=/bin/true\nRestart=on-failure\n")
    (run / "a.service.status").write_text("ActiveState=active\nMainPID=4242\n")
    sup = Supervisor(str(units), str(run), str(tmp_path / "log"), systemctl="/bin/false")
    assert sup.main_pids() == {4242: "a.service"}
    sup.reaped(4242, 0)  # exit 0: on-failure does not restart
    sup.reaped(999, 9)  # not a unit's main process
    assert not (tmp_path / "log").exists()
    sup.reaped(4242, signal.SIGKILL)  # wait status of a SIGKILLed process
    assert "a.service: main process 4242 killed by SIGKILL; restarting in 0.1 s (restart 1)" in (tmp_path / "log").read_text()
    assert os.WIFSIGNALED(signal.SIGKILL)


def test_a_unit_stopped_or_restarted_meanwhile_is_left_alone(tmp_path: Path) -> None:
    """Restart=always: the main process ended by a `systemctl stop` is not started again (the unit is inactive by the
    time RestartSec has passed); only a unit still `failed` is."""
    units = tmp_path / "units"
    units.mkdir()
    (units / "a.service").write_text("[Service]\nRestart=always\nRestartSec=0\n")
    fake = tmp_path / "systemctl"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n[ "$1" = is-active ] && cat {tmp_path}/state\nexit 0\n')
    fake.chmod(0o755)
    sup = Supervisor(str(units), str(tmp_path), str(tmp_path / "log"), systemctl=str(fake))
    policy = RestartPolicy.parse((units / "a.service").read_text())
    (tmp_path / "state").write_text("inactive\n")
    sup._restart_later("a.service", policy, 1)
    assert "a.service: not restarted: it is inactive" in (tmp_path / "log").read_text()
    assert "start a.service" not in (tmp_path / "calls").read_text()
    (tmp_path / "state").write_text("failed\n")
    sup._restart_later("a.service", policy, 1)
    assert "start a.service" in (tmp_path / "calls").read_text()
    assert "a.service: restarted (restart 1)" in (tmp_path / "log").read_text()
