"""`bpdkv logs` against three real SSH hosts whose units run under the lab's service manager (real journal lines)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.hosts.conftest import bpdkv, topology_doc, write_topology

pytestmark = pytest.mark.hosts


def test_logs_merges_every_instance_filters_follows_and_reports_a_dead_host(hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    topo = write_topology(tmp_path / "t.yaml", topology_doc(hosts))
    applied = bpdkv("apply", str(topo), "-y")
    assert applied.returncode == 0, applied.stdout + applied.stderr

    everything = bpdkv("logs", str(topo))
    assert everything.returncode == 0, everything.stderr
    prefixes = {line.split(" ")[1].rstrip(":") for line in everything.stdout.splitlines()}
    journal = hosts.exec(hosts.hosts[1], "ls -la /var/log/journal; tail -n 3 /var/log/journal/*").stdout
    # Each unit's own output under its host/instance (what the server printed when it started).
    assert prefixes == {"host1/prefill-0", "host2/decode-0", "host3/router-0"}, everything.stdout + journal
    assert "host2/decode-0: fake_vllm listening on 8200" in everything.stdout

    only = bpdkv("logs", str(topo), "--instance", "decode-0", "-n", "1")
    assert only.returncode == 0 and [line.split(" ")[1] for line in only.stdout.splitlines()] == ["host2/decode-0:"], only.stdout

    unknown = bpdkv("logs", str(topo), "--instance", "nope")
    assert unknown.returncode == 1 and unknown.stderr.count("\n") == 1 and "not in topology hosts-test" in unknown.stderr

    # -f prints what a unit writes after it started: P restarted prints its start line again.
    follow = subprocess.Popen(
        ["bpdkv", "logs", str(topo), "--instance", "prefill-0", "-n", "0", "-f", "--interval", "0.3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=dict(os.environ, PYTHONFAULTHANDLER="1"),  # SIGABRT dumps every thread's stack: where a slow exit waits
    )
    try:
        time.sleep(2)  # the first read (nothing printed with -n 0) is done
        restarted = hosts.exec(hosts.hosts[0], "systemctl restart bpdkv-prefill-0.service")
        assert restarted.returncode == 0, restarted.stderr
        deadline, seen = time.monotonic() + 20, ""
        assert follow.stdout is not None
        while "listening" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([follow.stdout], [], [], 1)
            if ready:
                seen += follow.stdout.readline()
        assert seen.count("\n") == 1 and "host1/prefill-0: fake_vllm listening on 8100" in seen, seen
    finally:
        os.killpg(follow.pid, signal.SIGINT)
        try:
            code = follow.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(follow.pid, signal.SIGABRT)
            follow.wait(10)
            pytest.fail(
                f"bpdkv logs -f still running 15 s after SIGINT; its threads:\n{follow.stderr.read()[-8000:] if follow.stderr else ''}"
            )
        assert code == 0

    hosts.kill_host(hosts.hosts[1])
    try:
        partial = bpdkv("logs", str(topo), "-n", "2")
        assert partial.returncode == 1
        assert "host1/prefill-0:" in partial.stdout and "host3/router-0:" in partial.stdout
        assert [line.split(":")[0] for line in partial.stderr.splitlines()] == ["host2/decode-0"], partial.stderr
    finally:
        hosts.restart_host(hosts.hosts[1])
