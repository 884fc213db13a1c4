"""Issue 35 item 2 without test hosts: a proxy_command that fails is one line per host with its exit status and the
last lines of its stderr (real commands, real `bpdkv plan` processes), never paramiko's tracebacks; one that hangs is
given up on with what it said. Nothing here needs an SSH server: the proxy is where it fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bpdkv.deploy.connectors import ConnectorError
from bpdkv.deploy.connectors.ssh import SshConnector, SshOptions
from bpdkv.topology.model import Node, SshSpec

SSM_DENIED = (
    "An error occurred (AccessDeniedException) when calling the StartSession operation: "
    "User: arn:aws:iam::123456789012:user/ci is not authorized to perform: ssm:StartSession on resource: $0"
)


def _node(host: str, spec: SshSpec) -> Node:
    return Node("n1", host, "10.0.0.1", None, "cpu", 0, None, 0, (), spec, (), ("nodes", 0))


def _spec(tmp_path: Path, proxy: str, timeout: float = 3.0) -> SshSpec:
    return SshSpec("ubuntu", 22, None, str(tmp_path / "known_hosts"), None, timeout, proxy)


@pytest.mark.parametrize("delay", ["", "sleep 0.3; "], ids=["at-once", "after-the-banner-was-sent"])
def test_a_failing_proxy_command_says_its_exit_status_and_stderr(tmp_path: Path, delay: str) -> None:
    """At once: paramiko's banner write hits a broken pipe. Later (as aws ssm start-session): the output ends."""
    proxy = f"sh -c '{delay}echo starting >&2; echo denied for $0 >&2; exit 255' %h"
    with pytest.raises(ConnectorError) as err:
        SshConnector(_node("10.0.0.5", _spec(tmp_path, proxy)), SshOptions(command_timeout=5.0))
    assert str(err.value) == "n1: unreachable: ubuntu@10.0.0.5:22: proxy_command exited 255: starting; denied for 10.0.0.5"


def test_a_proxy_killed_by_a_signal_and_one_that_prints_nothing(tmp_path: Path) -> None:
    with pytest.raises(ConnectorError) as err:
        SshConnector(_node("10.0.0.5", _spec(tmp_path, "sh -c 'kill -9 $$'")), SshOptions(command_timeout=5.0))
    assert str(err.value) == "n1: unreachable: ubuntu@10.0.0.5:22: proxy_command was killed by signal 9 (nothing on its stderr)"
    with pytest.raises(ConnectorError) as err:
        SshConnector(_node("10.0.0.5", _spec(tmp_path, "false")), SshOptions(command_timeout=5.0))
    assert str(err.value) == "n1: unreachable: ubuntu@10.0.0.5:22: proxy_command exited 1 (nothing on its stderr)"


def test_a_proxy_command_that_cannot_start_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConnectorError) as err:
        SshConnector(_node("10.0.0.5", _spec(tmp_path, "/nonexistent/aws ssm start-session")), SshOptions(command_timeout=5.0))
    assert (
        str(err.value) == "n1: unreachable: ubuntu@10.0.0.5:22: proxy_command could not start: /nonexistent/aws: No such file or directory"
    )


def test_a_proxy_that_hangs_is_given_up_on_with_what_it_said(tmp_path: Path) -> None:
    """It runs, prints on stderr, never relays SSH: the connect ends at its timeout and names the proxy; the proxy
    process is ended (no process left behind)."""
    marker = tmp_path / "pid"
    proxy = f"sh -c 'echo $$ > {marker}; echo waiting for the session >&2; exec sleep 60'"
    with pytest.raises(ConnectorError) as err:
        SshConnector(_node("10.0.0.5", _spec(tmp_path, proxy, timeout=1.0)), SshOptions(command_timeout=3.0))
    assert str(err.value).startswith(
        "n1: unreachable: ubuntu@10.0.0.5:22: no SSH answer through proxy_command within 1s "
        "(it was still running; its stderr: waiting for the session; paramiko: "
    ), str(err.value)
    pid = int(marker.read_text())
    for _ in range(50):  # the reaper waits for it; bounded
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            break
        subprocess.run(["sleep", "0.1"], check=True)
    else:
        pytest.fail(f"proxy process {pid} still running")


def test_plan_through_a_failing_proxy_is_one_line_per_host_and_no_traceback(tmp_path: Path) -> None:
    """The issue's case: 13 hosts behind `aws ssm start-session` without access printed 26 paramiko tracebacks."""
    fake_aws = tmp_path / "aws"
    fake_aws.write_text(f'#!/bin/sh\nsleep 0.2\necho >&2\necho "{SSM_DENIED.replace("$0", "$4")}" >&2\nexit 255\n')
    fake_aws.chmod(0o755)
    nodes = [
        {"name": f"host{i}", "host": f"10.213.9.{i}", "hardware": "cpu", "instances": [{"role": role, "port": 8100 + i}]}
        for i, role in enumerate(["prefill", "decode", "router", "prefill", "decode"], start=1)
    ]
    doc = {
        "apiVersion": "bpdkv/v1",
        "name": "proxy-test",
        "profile": "tiny-cpu",
        "ssh": {
            "user": "ubuntu",
            "known_hosts": str(tmp_path / "known_hosts"),
            "connect_timeout": 5,
            "proxy_command": f"{fake_aws} ssm start-session --target %h --document-name AWS-StartSSHSession",
        },
        "bootstrap": {"enabled": False},
        "nodes": nodes,
    }
    topo = tmp_path / "t.yaml"
    topo.write_text(yaml.safe_dump(doc, sort_keys=False))
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, "-m", "bpdkv.cli", "plan", str(topo)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr and "Exception (client)" not in result.stderr, result.stderr
    assert result.stderr.splitlines() == [
        f"host{i}: reachable: unreachable: ubuntu@10.213.9.{i}:22: proxy_command exited 255: {SSM_DENIED.replace('$0', f'10.213.9.{i}')}"
        for i in range(1, 6)
    ]
