"""`bpdkv logs --since` on real SSH test hosts: the lab stamps each journal line when it arrives (as journald does),
so entries carry their time, --since filters by it in journalctl's forms, and a bad time is each host's error."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.hosts.conftest import bpdkv, topology_doc, write_topology

pytestmark = pytest.mark.hosts


def _entries(stdout: str) -> list[tuple[float, str]]:
    """(time, 'host/instance: message') of each printed line; every line must carry a time."""
    out = []
    for line in stdout.splitlines():
        when, rest = line.split(" ", 1)
        out.append((datetime.fromisoformat(when).timestamp(), rest))
    return out


def test_since_filters_by_the_time_each_line_arrived(hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    topo = str(write_topology(tmp_path / "t.yaml", topology_doc(hosts)))
    applied = bpdkv("apply", topo, "-y")
    assert applied.returncode == 0, applied.stdout[-3000:] + applied.stderr[-3000:]
    time.sleep(0.5)  # the start lines are stamped (the lab stamps every 0.1 s)
    middle = time.time()
    time.sleep(0.3)
    restarted = hosts.exec(hosts.hosts[0], "systemctl restart bpdkv-prefill-0.service")
    assert restarted.returncode == 0, restarted.stderr
    time.sleep(0.5)

    everything = bpdkv("logs", topo)
    assert everything.returncode == 0, everything.stderr
    entries = _entries(everything.stdout)
    times = [t for t, _ in entries]
    assert times == sorted(times), everything.stdout  # merged in time order across the three hosts
    starts = [t for t, text in entries if text.startswith("host1/prefill-0: fake_vllm listening")]
    assert len(starts) == 2 and starts[0] < middle < starts[1], everything.stdout

    since = bpdkv("logs", topo, "--since", f"@{middle:.6f}")
    assert since.returncode == 0, since.stderr
    later = _entries(since.stdout)
    assert later == [(t, text) for t, text in entries if t >= middle], since.stdout
    assert [text.split(" args=")[0] for _, text in later if "listening" in text] == ["host1/prefill-0: fake_vllm listening on 8100"]
    assert not any(text.startswith(("host2/", "host3/")) for _, text in later), since.stdout  # D and router wrote nothing since

    # journalctl's other forms: an absolute UTC time, relative times.
    utc = datetime.fromtimestamp(middle, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f UTC")
    absolute = bpdkv("logs", topo, "--since", utc)
    assert (absolute.returncode, absolute.stdout) == (0, since.stdout), absolute.stderr
    relative = bpdkv("logs", topo, "--since", "-1h")
    assert (relative.returncode, relative.stdout) == (0, everything.stdout), relative.stderr
    future = bpdkv("logs", topo, "--since", "+1h")
    assert future.returncode == 0 and future.stdout == ""
    # --since with -n: the last N of those since the time.
    one = bpdkv("logs", topo, "--instance", "prefill-0", "--since", f"@{middle:.6f}", "-n", "1")
    assert _entries(one.stdout) == [e for e in later if e[1].startswith("host1/")][-1:]

    bad = bpdkv("logs", topo, "--since", "next tuesday-ish")
    assert bad.returncode == 1 and bad.stdout == ""
    assert sorted(line.split(":")[0] for line in bad.stderr.splitlines()) == ["host1/prefill-0", "host2/decode-0", "host3/router-0"]
    assert all("Failed to parse timestamp: next tuesday-ish" in line for line in bad.stderr.splitlines()), bad.stderr
