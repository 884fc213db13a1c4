"""The suite's own hooks (tests/suite.py): a run stopped by SIGTERM ends every process it started, as its fixtures'
teardowns do on Ctrl-C, and a server a test leaks is ended at the end of the session. Real pytest runs, real
processes in sessions of their own (as the vLLM servers are started)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT

LONG_LIVED = """
import subprocess, time
from pathlib import Path
import pytest

@pytest.fixture
def server(tmp_path_factory):
    # a server in a session of its own, wrapped like the vLLM servers (timeout → child)
    proc = subprocess.Popen(["timeout", "600", "sleep", "600"], start_new_session=True)
    Path({pidfile!r}).write_text(str(proc.pid))
    yield proc
    {teardown}

def test_runs_long(server):
    Path({ready!r}).write_text("ready")
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _run_until_ready(tmp_path: Path, teardown: str) -> tuple[subprocess.Popen[bytes], int, list[int]]:
    pidfile, ready = tmp_path / "server.pid", tmp_path / "ready"
    test = tmp_path / "test_long.py"
    test.write_text(LONG_LIVED.format(pidfile=str(pidfile), ready=str(ready), teardown=teardown))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.suite", "-p", "no:cacheprovider", str(test)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else b""
        assert time.monotonic() < deadline, "the inner test never started"
        time.sleep(0.1)
    server = int(pidfile.read_text())
    children = [int(p) for p in subprocess.run(["pgrep", "-P", str(server)], capture_output=True, text=True).stdout.split()]
    assert _alive(server) and children and all(_alive(c) for c in children)
    return proc, server, children


def _finish(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out.decode(errors="replace")


def test_sigterm_runs_the_teardowns_and_ends_what_the_run_started(tmp_path: Path) -> None:
    proc, server, children = _run_until_ready(tmp_path, teardown="proc.terminate(); proc.wait(10)")
    proc.send_signal(signal.SIGTERM)
    code, out = _finish(proc)
    assert code != 0, out  # interrupted, not a pass
    assert "SIGTERM: stopping" in out, out
    assert not _alive(server) and not any(_alive(c) for c in children), out


def test_a_server_the_test_leaks_is_ended_and_named(tmp_path: Path) -> None:
    proc, server, children = _run_until_ready(tmp_path, teardown="pass  # leaks the server")
    proc.send_signal(signal.SIGTERM)
    code, out = _finish(proc)
    assert code != 0, out
    assert "ended processes the tests left running" in out and "sleep 600" in out, out
    assert not _alive(server) and not any(_alive(c) for c in children), out
